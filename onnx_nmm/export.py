"""Export decoder-only LLMs from transformers to ONNX, as `forward(input_ids, attention_mask) -> logits`.

Needs the `export` extra (torch, transformers). Used by the tests, the demo and the benchmarks to get
real exported graphs: tiny random-weight models built from a config, or a real checkpoint.

Random-weight models have two traps (ASSETS.md): the dynamo optimizer drops all-zero biases and the
TorchScript exporter merges identical weights behind Identity nodes. `randomize` adds small noise to
every parameter so that neither happens and the export looks like a trained model's.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = ("llama", "qwen3", "mistral", "gpt2", "llama-tied", "qwen2")
EXPORTERS = ("dynamo", "dynamo-noopt", "torchscript")


@dataclass(frozen=True)
class TinyShape:
    """Width and depth of a random-weight test model."""

    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1000


def build_config(architecture: str, shape: TinyShape = TinyShape()):
    """A transformers config for `architecture` at the given width."""
    import transformers

    common = dict(vocab_size=shape.vocab, use_cache=False)
    if architecture == "gpt2":
        return transformers.GPT2Config(
            n_embd=shape.hidden, n_inner=shape.intermediate, n_layer=shape.layers,
            n_head=shape.heads, n_positions=1024, **common,
        )
    decoder = dict(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=2048, **common,
    )
    if architecture in ("llama", "llama-tied"):
        return transformers.LlamaConfig(tie_word_embeddings=architecture == "llama-tied", **decoder)
    if architecture == "qwen3":
        return transformers.Qwen3Config(head_dim=shape.hidden // shape.heads, tie_word_embeddings=False, **decoder)
    if architecture == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=False, **decoder)
    if architecture == "mistral":
        return transformers.MistralConfig(sliding_window=None, tie_word_embeddings=False, **decoder)
    raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")


def build_model(architecture: str, shape: TinyShape = TinyShape(), seed: int = 0):
    """A random-weight causal LM in eval mode, every parameter perturbed by noise."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(build_config(architecture, shape))
    randomize(model, seed)
    return model.eval()


def randomize(model, seed: int, scale: float = 0.02) -> None:
    """Add N(0, scale²) noise to every parameter (keeps biases non-zero and weights distinct)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def load_gguf_causal_lm(path: str | os.PathLike):
    """A transformers causal LM from a GGUF file (dequantized to float32), offline."""
    import torch
    import transformers

    path = Path(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()


class LogitsOnly:
    """Wraps a causal LM as `forward(input_ids, attention_mask) -> logits` (no cache, no dict)."""

    def __new__(cls, model):
        import torch

        class _Wrapper(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

        return _Wrapper(model)


def export_causal_lm(model, path: str | os.PathLike, exporter: str = "dynamo", external_data: bool = False,
                     batch: int = 2, seq_len: int = 8) -> Path:
    """Export `model` to `path` with dynamic batch and sequence axes; returns the path.

    exporter: "dynamo" (torch.onnx.export(dynamo=True), optimized), "dynamo-noopt" (optimize=False,
    which leaves `MatMul(X, Transpose(W))`), or "torchscript" (dynamo=False, opset 17).
    """
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = LogitsOnly(model).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    attention_mask = torch.ones(batch, seq_len, dtype=torch.int64)
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["logits"])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                    "logits": {0: "batch", 1: "sequence"}}
            torch.onnx.export(wrapper, (input_ids, attention_mask), str(path), dynamo=False, opset_version=17,
                              dynamic_axes=axes, **names)
            if external_data:
                _move_weights_to_external_data(path)
        else:
            batch_dim = torch.export.Dim("batch", min=1, max=64)
            seq_dim = torch.export.Dim("sequence", min=2, max=4096)
            shapes = {"input_ids": {0: batch_dim, 1: seq_dim}, "attention_mask": {0: batch_dim, 1: seq_dim}}
            program = torch.onnx.export(wrapper, (input_ids, attention_mask), dynamo=True, verbose=False,
                                        optimize=exporter == "dynamo", dynamic_shapes=shapes, **names)
            program.save(str(path), external_data=external_data)
    return path


def _move_weights_to_external_data(path: Path) -> None:
    import onnx

    from onnx_nmm.model_io import external_data_path, make_public

    model = onnx.load(str(path))
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".onnx", delete=False) as handle:
        temporary = Path(handle.name)
    onnx.save(model, str(temporary), save_as_external_data=True, location=external_data_path(path).name, size_threshold=1024)
    make_public(temporary)
    temporary.replace(path)
