"""What each of `tp` ranks holds of a decoder's widths, as `compile --tp` splits it (NxD Inference's split):

    q, and o's input rows      query heads, H/tp per rank, in order (rank r: heads r·H/tp … (r+1)·H/tp - 1)
    k, v, and the KV cache     KV heads, K/tp per rank when tp divides them; when tp is a multiple of them, the
                               one KV head the rank's query heads read, replicated on tp/K ranks
                               (GQA.REPLICATE_TO_TP_DEGREE)
    any other width            the intermediate of an MLP, the vocabulary, the hidden size of the embedding:
                               in tp consecutive parts, the first ones one wider where tp does not divide it

A tp that does not divide the query heads is refused (NxD pads them with empty heads; the rank programs here do
not), and so is one that neither divides the KV heads nor is a multiple of them (NxD then gives every query head
its own copy of its KV head, GQA.CONVERT_TO_MHA).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_nmm.errors import OptionError


@dataclass(frozen=True)
class RankShares:
    tp: int
    heads: int  # query heads of the whole model
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.heads % self.tp:
            raise OptionError(f"{{tp}} {self.tp} does not divide the model's {self.heads} query heads: choose a tp "
                              f"that does ({', '.join(map(str, divisors(self.heads)))}); onnx-nmm does not pad heads",
                              tp="tp")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:
            raise OptionError(f"{{tp}} {self.tp} neither divides the model's {self.kv_heads} KV heads nor is a "
                              "multiple of them, so its ranks' query heads would read different numbers of KV heads: "
                              f"choose a tp that does ({', '.join(map(str, divisors(self.heads)))} divide the query "
                              "heads)", tp="tp")

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def replicated_kv(self) -> bool:
        return self.kv_heads < self.tp

    def kv_head_indices(self, rank: int) -> range:
        """The KV heads rank `rank` holds."""
        if self.replicated_kv:
            first = rank // (self.tp // self.kv_heads)
            return range(first, first + 1)
        return range(rank * self.local_kv_heads, (rank + 1) * self.local_kv_heads)

    def query_columns(self, rank: int) -> np.ndarray:
        return _head_columns(range(rank * self.local_heads, (rank + 1) * self.local_heads), self.head_dim)

    def kv_columns(self, rank: int) -> np.ndarray:
        return _head_columns(self.kv_head_indices(rank), self.head_dim)

    def even(self, width: int, rank: int) -> np.ndarray:
        """Rank `rank`'s indices of a width split into tp consecutive parts."""
        return np.array_split(np.arange(width), self.tp)[rank]

    def note(self) -> str:
        """What each rank holds of the attention, in words."""
        kv = (f"{self.kv_heads} KV heads replicated, one per rank ({self.tp // self.kv_heads} ranks share each)"
              if self.replicated_kv else f"{self.local_kv_heads} of the {self.kv_heads} KV heads")
        return f"tp {self.tp}: {self.local_heads} of the {self.heads} query heads and {kv} per rank"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _head_columns(heads: range, head_dim: int) -> np.ndarray:
    return np.concatenate([np.arange(head * head_dim, (head + 1) * head_dim) for head in heads])
