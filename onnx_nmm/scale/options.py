"""How a streamed rewrite runs (onnx_nmm.scale.rewrite_streamed): where the factorizations run and how many
BLAS threads each uses. What is computed stays in RewriteOptions."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_nmm.errors import OptionError

LOCAL_RAY = "local"  # ray.init() with no address: a cluster on this machine (or RAY_ADDRESS's)


@dataclass(frozen=True)
class StreamOptions:
    """ray:     None: every matrix in this process; an address ("ray://head:10001", "auto") or LOCAL_RAY: one Ray
                task per matrix on that cluster
    threads:    BLAS threads per factorization (0: every core of the machine it runs on); factors are
                byte-identical wherever they are computed when this is the same
    resume:     take up the finished matrices a killed run with the same input and options left in
                `<output>.partial/`; False starts afresh"""

    ray: str | None = None
    threads: int = 0
    resume: bool = True

    def __post_init__(self):
        if self.threads < 0:
            raise OptionError(f"{{threads}} must be ≥ 0 (0: every core), got {self.threads}", threads="stream.threads")
