"""Export decoder-only LLMs from transformers to ONNX, as `forward(input_ids, attention_mask) -> logits`.

Needs the `export` extra (torch, transformers). `export_checkpoint` (the `export` command) turns a Hugging
Face folder or a GGUF file into ONNX; the tests, the demo and the benchmarks also export tiny random-weight
models built from a config. Module paths in the export are the checkpoint's own ("model.layers.0.mlp..."):
the model's forward is swapped for the export, not wrapped in another module.

Random-weight models have two traps: the dynamo optimizer drops all-zero biases and the
TorchScript exporter merges identical weights behind Identity nodes. `randomize` adds small noise to
every parameter so that neither happens and the export looks like a trained model's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from onnx_nmm.errors import DataError, MissingDependencyError, OptionError, OutputError

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


@contextlib.contextmanager
def _logits_forward(model):
    """`model` called as forward(input_ids, attention_mask) -> logits (no cache, no dict) for the duration.

    The instance's forward is swapped rather than the model wrapped in another module, which would put the
    wrapper's attribute in front of every module path the exporter records."""
    original = model.forward

    def forward(input_ids, attention_mask):
        return original(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    model.forward = forward
    try:
        yield model
    finally:
        del model.forward


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
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    attention_mask = torch.ones(batch, seq_len, dtype=torch.int64)
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["logits"])
    # torch.onnx logs a line for every torchvision op it cannot register when torchvision is absent
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), _logits_forward(model.eval()) as logits_model:
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                    "logits": {0: "batch", 1: "sequence"}}
            torch.onnx.export(logits_model, (input_ids, attention_mask), str(path), dynamo=False, opset_version=17,
                              dynamic_axes=axes, **names)
            if external_data:
                _move_weights_to_external_data(path)
        else:
            batch_dim = torch.export.Dim("batch", min=1, max=64)
            seq_dim = torch.export.Dim("sequence", min=2, max=4096)
            shapes = {"input_ids": {0: batch_dim, 1: seq_dim}, "attention_mask": {0: batch_dim, 1: seq_dim}}
            program = torch.onnx.export(logits_model, (input_ids, attention_mask), dynamo=True, verbose=False,
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


def load_checkpoint(source: str | os.PathLike):
    """A transformers causal LM in float32 from a Hugging Face folder (config.json and weights) or a GGUF
    file (dequantized), offline."""
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        return load_gguf_causal_lm(source)
    if not (source / "config.json").is_file():
        raise DataError(f"{source} is neither a .gguf file nor a Hugging Face model folder (one with config.json)")
    try:
        import torch
        import transformers
    except ImportError:
        raise MissingDependencyError("exporting needs torch and transformers: pip install 'onnx-nmm[export]'") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    return model.eval()


# Weights above this go to external data: protobuf cannot hold 2 GB, and a margin keeps the graph in.
EXTERNAL_DATA_BYTES = 2**30


def export_checkpoint(source: str | os.PathLike, output: str | os.PathLike, exporter: str = "dynamo",
                      external_data: bool | None = None, overwrite: bool = False) -> Path:
    """Export the causal LM of a Hugging Face folder or a GGUF file to `output` (weights to `<output>.data`
    with `external_data`; None: when they pass EXTERNAL_DATA_BYTES). Written under a temporary name and
    moved into place once complete; refused over an existing file unless `overwrite`."""
    from onnx_nmm.model_io import external_data_path

    output = Path(output)
    if exporter not in EXPORTERS:
        raise OptionError(f"{{exporter}} must be one of {', '.join(EXPORTERS)}, got {exporter!r}", exporter="exporter")
    if output.exists() and not overwrite:
        raise OutputError(f"{output} exists; choose another {{output}} or set {{overwrite}} to replace it",
                          output="output", overwrite="overwrite")
    model = load_checkpoint(source)
    if external_data is None:
        external_data = sum(p.numel() * p.element_size() for p in model.parameters()) > EXTERNAL_DATA_BYTES
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".onnx-nmm-", dir=output.parent))
    try:
        staged = export_causal_lm(model, staging / output.name, exporter, external_data=external_data)
        if external_data_path(staged).exists():
            os.replace(external_data_path(staged), external_data_path(output))
        os.replace(staged, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
