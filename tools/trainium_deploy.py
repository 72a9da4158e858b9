"""The Trainium deployment path, run end to end on SmolLM2-135M: docs/trainium.md's figures.

    python tools/trainium_deploy.py [--out docs/trainium.md]

1. export SmolLM2 with a KV cache by a script of our own (torch.onnx's TorchScript exporter, input names
   onnx-nmm does not write: tokens, attn_mask, positions, past.N.k / past.N.v), as a user's own export is;
2. rewrite it at keep 0.9 (the default method, calibrated on the Old Testament);
3. `compile --target trn1 --max-context 256 --dry-run`: prefill graphs for 128 and 256 tokens and a decode step;
4. `generate DIR --backend torch` (the compiled static-shape programs, lowered to PyTorch as the trace takes
   them) against `generate MODEL` on onnxruntime: the same text, token for token.
Every command is recorded in the page; Trainium times are modelled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, invocation  # noqa: E402

PROMPTS = ("What is the capital of France?", "Why is the sky blue?")
NEW_TOKENS = 24


def export_with_own_names(gguf: Path, path: Path) -> Path:
    """SmolLM2 with a KV cache, exported by torch.onnx (TorchScript) under names of this script's choosing."""
    if path.exists():
        return path
    import onnx
    import torch
    from transformers import DynamicCache

    from onnx_nmm import load_gguf_causal_lm

    model = load_gguf_causal_lm(gguf)
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, tokens, attn_mask, positions, *past):
            cache = DynamicCache(config=config)
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            output = self.lm(input_ids=tokens, attention_mask=attn_mask, position_ids=positions,
                             past_key_values=cache, use_cache=True)
            return output.logits, *(t for layer in output.past_key_values.layers for t in (layer.keys, layer.values))

    past = [f"past.{layer}.{kind}" for layer in range(layers) for kind in ("k", "v")]
    present = [name.replace("past", "present") for name in past]
    example = (torch.randint(0, config.vocab_size, (1, 5)), torch.ones(1, 8, dtype=torch.int64),
               torch.arange(3, 8)[None], *(torch.randn(1, heads, 3, head_dim) * 0.1 for _ in past))
    axes = {"tokens": {0: "batch", 1: "new"}, "attn_mask": {0: "batch", 1: "total"},
            "positions": {0: "batch", 1: "new"}, "next_logits": {0: "batch", 1: "new"},
            **{name: {0: "batch", 2: "past_len"} for name in past},
            **{name: {0: "batch", 2: "total"} for name in present}}
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".staged.onnx")
    with torch.no_grad():
        torch.onnx.export(Step().eval(), example, str(staged), dynamo=False, opset_version=17,
                          input_names=["tokens", "attn_mask", "positions", *past],
                          output_names=["next_logits", *present], dynamic_axes=axes)
    onnx.save(onnx.load(str(staged)), str(path), save_as_external_data=True, location=path.name + ".data")
    staged.unlink()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/trainium.md")
    parser.add_argument("--work", default="out/trainium-deploy")
    args = parser.parse_args()
    work = Path(args.work)
    gguf = assets.smollm2_gguf()
    exported = export_with_own_names(gguf, work / "smollm2-own-names.onnx")
    rewritten, compiled = work / "smollm2-keep0.9.onnx", work / "smollm2-keep0.9.neuron"
    onnx_nmm = CommandLog()
    onnx_nmm.produce([rewritten], "rewrite", exported, "-o", rewritten, "--keep", "0.9", "--calib",
                     assets.kjv_text("calibration"), "--tokenizer", gguf, "--budget", "global", "--quiet")
    onnx_nmm.run("compile", rewritten, "--target", "trn1", "--max-context", 256, "--dry-run", "-o", compiled,
                 "--force")
    manifest = json.loads((compiled / "manifest.json").read_text())
    dense = work / "smollm2-dense.neuron"
    onnx_nmm.run("compile", exported, "--target", "trn1", "--max-context", 256, "--dry-run", "-o", dense, "--force")
    priced = onnx_nmm.json("bench", dense, compiled, "--target", "trn1", "--prompt-lengths", "128,256",
                           "--contexts", "128", "--generation", "32,32", "--json")
    answers = []
    for prompt in PROMPTS:
        common = ["--prompt", prompt, "--tokenizer", gguf, "--max-new-tokens", NEW_TOKENS, "--json"]
        reference = onnx_nmm.json("generate", rewritten, *common)
        static = onnx_nmm.json("generate", compiled, *common, "--backend", "torch")
        answers.append((prompt, reference, static))
    write_page(Path(args.out), exported, manifest, priced["models"][1]["speedup"], answers, onnx_nmm.lines)
    return 0 if all(reference["tokens"] == static["tokens"] for _, reference, static in answers) else 1


def write_page(path: Path, exported: Path, manifest: dict, speedup: dict, answers: list,
               commands: list[str]) -> None:
    rows = "\n".join(
        f"| {graph['name']} | {graph['tokens']} | {len(graph['kernels'])} | {len(graph['fused_mlps'])} | "
        f"{sum(1 for choice in graph['mlp_kernels'] if not choice['fused'])} | "
        + (f"{graph['modelled_us']:,.1f} | {graph['modelled_dense_us']:,.1f}" if "modelled_us" in graph else "— | —")
        + f" | {graph['lowering_check']['max_abs']:.1e} |" for graph in manifest["graphs"])
    cache = manifest["cache"]["tensors"]
    said = "\n".join(f"| {prompt} | {reference['text']!r} | {static['text']!r} | "
                     f"{'yes' if reference['tokens'] == static['tokens'] else 'NO'} |"
                     for prompt, reference, static in answers)
    listed = "\n".join(commands)
    columns = ("graph", "tokens", "custom ops", "MLPs fused", "MLPs as projections", "modelled µs",
               "dense µs (modelled)", "lowering vs onnxruntime, max abs")
    header = "| " + " | ".join(columns) + " |\n|---|" + "---:|" * (len(columns) - 1)
    shape = "×".join(map(str, cache[0]["shape"]))
    versus = (f"prefill of 128 {speedup['prefill']['128']:.2f}×, of 256 {speedup['prefill']['256']:.2f}×, a decode "
              f"step {speedup['decode']['128']:.2f}×, a prompt of 32 and 32 new tokens end to end "
              f"{speedup['generation']['end to end']:.2f}×")
    path.write_text(PAGE.format(header=header, rows=rows, tensors=len(cache), shape=shape, answers=said, versus=versus,
                                machine=machine(), invocation=invocation(), commands=listed,
                                exported=exported.name, new=NEW_TOKENS))


PAGE = """# Deploying on Trainium

Neuron runs static shapes. A model that generates is therefore not one graph but several: a **prefill** graph
per prompt-length bucket, which writes a prompt's keys and values into the KV cache, and one **decode** graph,
which reads one new token, writes its keys and values at the position it is given and returns the next logits.
The cache has a fixed number of positions (`--max-context`) and is an input/output pair of every graph: the
buffer the runtime keeps on the device between steps. This is how every Trainium serving stack runs an LLM (NxD
Inference, transformers-neuronx, NeuronMM's own code); `onnx-nmm compile --max-context` makes those graphs
from any exported KV-cache model `rewrite` accepts.

## The path

```
onnx-nmm export model.gguf -o model.onnx                  # or your own export with a KV cache
onnx-nmm rewrite model.onnx -o small.onnx --calib my-text.txt --tokenizer model.gguf
onnx-nmm compile small.onnx --target trn1 --max-context 2048 -o small.neuron
onnx-nmm generate small.neuron --prompt "What is the capital of France?"
onnx-nmm bench small.neuron model.onnx --target trn1       # modelled: the compiled graphs as they run
```

`compile --max-context N` writes, into the folder:

- `prefill_<B>.onnx`: a prefill of B tokens, one per bucket (default 128, 512, 2048 below N, and N;
  `--buckets` to choose);
- `decode.onnx`: one decode step over the cache of N positions, written at its `cache_position` input (an
  onnxruntime-genai export has none: its GroupQueryAttention already takes the cache as one buffer of N
  positions and writes the step where the attention mask ends, so its graphs only get static shapes);
- `weights.data`: the weights of every graph, each written once: the graphs share them;
- `manifest.json`: the buckets; the cache, each tensor's shape and the output that aliases its input; every
  graph's custom ops with their kernel, block sizes and modelled time; every MLP's kernel choice with the times
  it compared; the lowering check;
- `<graph>/model.pt`, `<graph>/compiler/`: with the Neuron SDK, each graph's `torch_neuronx` trace and its NEFF
  (the weights kept out of the NEFF). The decode step is traced with its cache as the module's state, each
  cache tensor aliased to the present output that updates it (`input_output_aliases`), so the cache stays on
  the device between steps; the manifest says so under the decode graph's `cache_state`.

Each graph chooses its own MLP kernels: at a prefill of 512 tokens and at a decode step of one the fastest of
the fused MLP kernel, the projections launched one by one and (a factorized MLP) the dense MLP kernel on its
factors multiplied back is not the same (modelled), so each graph takes the fastest at its shape. Each graph is
lowered to PyTorch and checked against onnxruntime before the folder is put in place (a `MatMulNBits` that
onnxruntime's CPU runs at `accuracy_level` 4, int8 activations, as onnxruntime-genai's int4 builds ask, is
checked computing in float, as the lowered program and the device do). Without the Neuron SDK
the whole folder is still written (the trace is the only step missing) and `compile` exits 3 saying what to
install; `--dry-run` stops there on purpose.

`generate DIR` runs the folder: the prompt padded to the smallest bucket that holds it, then one decode step
per token. `--backend ort` and `--backend torch` run the very graphs on the CPU (torch: lowered to PyTorch as
the trace takes them), `--backend emulator` with the NKI kernels on the emulator, `--backend neuron` the
traces: after a prefill, its cache is copied into the decode trace's state once, and every step then passes
only the token, the mask and the position. A prompt longer than the largest bucket, or more tokens than the
cache holds, is a one-line error.
`bench DIR --target trn1` prices the folder as it runs (modelled): a prompt costs its bucket's prefill, and
every decode step attends over the whole cache, which is what a static cache costs.

## Checked here, on SmolLM2-135M

No machine here has a Trainium device. On SmolLM2-135M-Instruct, exported with its KV cache by a script that
is not onnx-nmm's ({exported}: torch.onnx's TorchScript exporter, inputs named `tokens`, `attn_mask`,
`positions`, `past.N.k`, `past.N.v`), rewritten at keep 0.9 and compiled with `--target trn1 --max-context 256
--dry-run`:

{header}
{rows}

(A narrowed MLP is a dense MLP of smaller width: its best dense path is itself, so its two times agree; against
the dense model's own compiled folder, `bench DENSE_DIR DIR --target trn1` prices the rewrite at: {versus},
modelled.) The cache: {tensors} tensors of {shape} (batch, heads, positions, head size), each aliased by its
present output. Greedy answers, {new} new tokens at most, the rewritten model on onnxruntime (its own dynamic cache)
against the compiled folder on the CPU (`generate DIR --backend torch`: the static-shape programs lowered to
PyTorch, the custom ops as torch math):

| prompt | `generate MODEL` (onnxruntime) | `generate DIR --backend torch` | same tokens |
|---|---|---|---|
{answers}

Machine: {machine}. Regenerate with `{invocation}`.

## What is modelled, what a device measures

Every Trainium time here and in `compile`'s and `bench --target`'s output is **modelled**: the kernels' cost
model ([kernels.md](kernels.md)) for the linear layers, a roofline for the rest ([speed.md](speed.md)). On a
Trainium machine, install the SDK (`pip install --extra-index-url https://pip.repos.neuron.amazonaws.com
torch-neuronx neuronx-cc nki`) and compile without `--dry-run`: each graph is traced with the same kernel source
the emulator runs, and `generate DIR --backend neuron` runs the traces. `bench-kernels --device` measures the
kernels themselves on the NeuronCore ([kernels.md](kernels.md)).

Not run yet, and not hidden: none of the device path has run on a device. The decode trace's cache state
follows torch-neuronx's documented aliasing (the pattern of AWS's T5 inference tutorial: state tensors as
parameters, `input_output_aliases` from each to its output, the state filled with `copy_` after the prefill);
here it is tested with a torch.jit trace of the same module on the CPU, where nothing aliases and the runtime
copies each step's present outputs back into the state instead, and the call to `torch_neuronx.trace` is
checked with the SDK stood in for (`tests/test_compile_generating.py`).

## Commands

```
{commands}
```
"""


if __name__ == "__main__":
    raise SystemExit(main())
