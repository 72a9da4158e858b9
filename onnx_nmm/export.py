"""Export decoder-only LLMs from transformers to ONNX: with a KV cache, the form runtimes generate with,

    (input_ids, attention_mask, position_ids, past_key_values.N.key/value) -> (logits, present.N.key/value)

(the names optimum and onnxruntime-genai use; the cache [batch, kv_heads, length, head_dim], empty at
length 0), or cache-free as `(input_ids, attention_mask) -> logits`.

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
import functools
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from onnx_nmm.errors import DataError, MissingDependencyError, OptionError, OutputError

ARCHITECTURES = ("llama", "qwen3", "mistral", "gpt2", "llama-tied", "qwen2", "gemma", "gemma2", "gemma3", "phi3", "phi",
                 "olmo", "olmo2", "granite")
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
    head_dim = shape.hidden // shape.heads
    untied = dict(tie_word_embeddings=False, **decoder)
    # Families whose default token ids lie outside a tiny vocabulary get ids inside it.
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    configs = {
        "qwen3": lambda: transformers.Qwen3Config(head_dim=head_dim, **untied),
        "qwen2": lambda: transformers.Qwen2Config(**untied),
        "mistral": lambda: transformers.MistralConfig(sliding_window=None, **untied),
        "gemma": lambda: transformers.GemmaConfig(head_dim=head_dim, **decoder, **tokens),
        "gemma2": lambda: transformers.Gemma2Config(head_dim=head_dim, **decoder, **tokens),
        "gemma3": lambda: transformers.Gemma3TextConfig(head_dim=head_dim, **decoder, **tokens),
        "phi3": lambda: transformers.Phi3Config(**untied, **tokens),
        "phi": lambda: transformers.PhiConfig(**untied, **tokens),
        "olmo": lambda: transformers.OlmoConfig(**untied, **tokens),
        "olmo2": lambda: transformers.Olmo2Config(**untied, **tokens),
        "granite": lambda: transformers.GraniteConfig(**decoder, **tokens),
    }
    if architecture not in configs:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")
    return configs[architecture]()


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
    import torch

    original = model.forward

    def forward(input_ids, attention_mask):
        # Positions per batch row: from their default [1, S] the dynamo exporter (opset 23+) writes a
        # RotaryEmbedding whose cos/sin caches do not have the input's batch, which onnxruntime refuses.
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                        use_cache=False).logits

    model.forward = forward
    try:
        yield model
    finally:
        del model.forward


@contextlib.contextmanager
def _cached_forward(model, positions: bool = True):
    """`model` called as forward(input_ids, attention_mask, position_ids, past) -> (logits, *present) for the
    duration, `past` and `present` the cache as flat tensors, each layer's key then value. Without `positions`,
    forward(input_ids, attention_mask, past): the model derives the positions from the cache's length, as
    transformers does when given a DynamicCache alone."""
    from transformers import DynamicCache

    original = model.forward

    def with_cache(input_ids, attention_mask, past, **position_ids):
        cache = DynamicCache(config=model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        output = original(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                          **position_ids)
        present = [tensor for layer in output.past_key_values.layers for tensor in (layer.keys, layer.values)]
        return output.logits, *present

    def forward(input_ids, attention_mask, position_ids, past):
        return with_cache(input_ids, attention_mask, past, position_ids=position_ids)

    def forward_without_positions(input_ids, attention_mask, past):
        return with_cache(input_ids, attention_mask, past)

    model.forward = forward if positions else forward_without_positions
    try:
        yield model
    finally:
        del model.forward


@dataclass(frozen=True)
class _ExportInputs:
    """Example inputs for the exporter, their names and which of their axes are dynamic."""

    args: tuple
    input_names: list[str]
    output_names: list[str]
    axes: dict[str, dict[int, str]]  # input or output name → {axis: dimension name}

    @classmethod
    def logits_only(cls, model, batch: int, seq_len: int) -> _ExportInputs:
        import torch

        tokens = {0: "batch", 1: "sequence"}
        return cls((torch.randint(0, model.config.vocab_size, (batch, seq_len)),
                    torch.ones(batch, seq_len, dtype=torch.int64)),
                   ["input_ids", "attention_mask"], ["logits"],
                   {"input_ids": tokens, "attention_mask": tokens, "logits": tokens})

    @classmethod
    def with_cache(cls, model, batch: int, seq_len: int, past_len: int = 3) -> _ExportInputs:
        """A step of seq_len tokens after past_len cached ones (neither 0 nor 1, which the exporter would fix)."""
        import torch

        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        tokens, total = {0: "batch", 1: "sequence"}, {0: "batch", 1: "past_sequence + sequence"}
        cache = [f"past_key_values.{layer}.{kind}" for layer in range(config.num_hidden_layers)
                 for kind in ("key", "value")]
        present = [name.replace("past_key_values", "present") for name in cache]
        past = tuple(torch.randn(batch, heads, past_len, head_dim) * 0.1 for _ in cache)
        args = (torch.randint(0, config.vocab_size, (batch, seq_len)),
                torch.ones(batch, past_len + seq_len, dtype=torch.int64),
                torch.arange(past_len, past_len + seq_len).expand(batch, seq_len).contiguous(), past)
        axes = {"input_ids": tokens, "attention_mask": total, "position_ids": tokens, "logits": tokens,
                **{name: {0: "batch", 2: "past_sequence"} for name in cache},
                **{name: {0: "batch", 2: "past_sequence + sequence"} for name in present}}
        return cls(args, ["input_ids", "attention_mask", "position_ids", *cache], ["logits", *present], axes)

    def without(self, name: str) -> _ExportInputs:
        """These inputs less the one called `name`."""
        index = self.input_names.index(name)
        return _ExportInputs(self.args[:index] + self.args[index + 1:], [n for n in self.input_names if n != name],
                             self.output_names, {key: axes for key, axes in self.axes.items() if key != name})

    def dynamic_shapes(self) -> tuple:
        """torch.export's form of `axes`: one dict per argument, a tuple of them for the cache."""
        import torch

        dims = {}

        def dim(name: str):
            if name not in dims:
                dims[name] = torch.export.Dim(name.replace(" ", "").replace("+", "_plus_"), min=1, max=8192)
            return dims[name]

        shapes = [{axis: dim(name) for axis, name in self.axes[input_name].items()}
                  for input_name in self.input_names]
        plain = len(self.args) if not isinstance(self.args[-1], tuple) else len(self.args) - 1
        return tuple(shapes[:plain]) + ((tuple(shapes[plain:]),) if plain < len(self.args) else ())


def export_causal_lm(model, path: str | os.PathLike, exporter: str = "dynamo", external_data: bool = False,
                     batch: int = 2, seq_len: int = 8, cache: bool = False, opset: int | None = None,
                     positions: bool = True) -> Path:
    """Export `model` to `path` with dynamic batch and sequence axes, with a KV cache if `cache`; returns the
    path. With a cache and not `positions`, the graph has no position_ids input and derives the positions, and
    its causal and padding masks, from the length of its past inputs (transformers' forward with a DynamicCache
    and nothing else, as `torch.onnx.export` of a model called that way writes it).

    exporter: "dynamo" (torch.onnx.export(dynamo=True), optimized), "dynamo-noopt" (optimize=False,
    which leaves `MatMul(X, Transpose(W))`), or "torchscript" (dynamo=False). `opset`: the ONNX opset to
    write (None: the exporter's default for dynamo, 17 for TorchScript); from 23 the dynamo exporter writes
    ONNX's fused Attention, RMSNormalization and RotaryEmbedding.
    """
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = (_ExportInputs.with_cache if cache else _ExportInputs.logits_only)(model, batch, seq_len)
    if cache and not positions:
        inputs = inputs.without("position_ids")
    names = dict(input_names=inputs.input_names, output_names=inputs.output_names)
    forward = functools.partial(_cached_forward, positions=positions) if cache else _logits_forward
    # torch.onnx logs a line for every torchvision op it cannot register when torchvision is absent
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), forward(model.eval()) as exported:
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(exported, inputs.args, str(path), dynamo=False, opset_version=opset or 17,
                              dynamic_axes=inputs.axes, **names)
            if external_data:
                _move_weights_to_external_data(path)
        else:
            program = torch.onnx.export(exported, inputs.args, dynamo=True, verbose=False, opset_version=opset,
                                        optimize=exporter == "dynamo", dynamic_shapes=inputs.dynamic_shapes(),
                                        **names)
            program.save(str(path), external_data=external_data)
    return path


def _move_weights_to_external_data(path: Path) -> None:
    import onnx

    from onnx_nmm.model_io import external_data_path, make_public

    model = onnx.load(str(path))
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".onnx", delete=False) as handle:
        temporary = Path(handle.name)
    onnx.save(model, str(temporary), save_as_external_data=True, location=external_data_path(path).name,
              size_threshold=1024)
    make_public(temporary)
    temporary.replace(path)


def load_checkpoint(source: str | os.PathLike):
    """A transformers causal LM in float32 from a Hugging Face folder (config.json and weights) or a GGUF
    file (dequantized), offline."""
    source = Path(source)
    if not source.exists():
        raise DataError(f"{source}: no such file or folder; give a .gguf file or a Hugging Face model folder")
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
                      external_data: bool | None = None, overwrite: bool = False, cache: bool = True,
                      positions: bool = True) -> Path:
    """Export the causal LM of a Hugging Face folder or a GGUF file to `output`, with a KV cache unless not
    `cache` (weights to `<output>.data` with `external_data`; None: when they pass EXTERNAL_DATA_BYTES), and
    with a position_ids input unless not `positions` (export_causal_lm).
    Written under a temporary name and moved into place once complete; refused over an existing file unless
    `overwrite`."""
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
        staged = export_causal_lm(model, staging / output.name, exporter, external_data=external_data, cache=cache,
                                  positions=positions)
        if external_data_path(staged).exists():
            os.replace(external_data_path(staged), external_data_path(output))
        os.replace(staged, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
