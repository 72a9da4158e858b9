"""The Trainium deployment path, run end to end on SmolLM2-135M: docs/trainium.md's figures (its sections
`trainium-deploy`, the graphs and answers, and `trainium-deploy-commands`; the rest of the page is prose).

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
from commands import CommandLog, invocation, write_section  # noqa: E402

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
    columns = ("graph", "tokens", "custom ops", "MLPs fused", "MLPs as projections", "modelled µs",
               "dense µs (modelled)", "lowering vs onnxruntime, max abs")
    header = "| " + " | ".join(columns) + " |\n|---|" + "---:|" * (len(columns) - 1)
    shape = "×".join(map(str, cache[0]["shape"]))
    versus = (f"prefill of 128 {speedup['prefill']['128']:.2f}×, of 256 {speedup['prefill']['256']:.2f}×, a decode "
              f"step {speedup['decode']['128']:.2f}×, a prompt of 32 and 32 new tokens end to end "
              f"{speedup['generation']['end to end']:.2f}×")
    checked = CHECKED.format(header=header, rows=rows, tensors=len(cache), shape=shape, answers=said, versus=versus,
                             machine=machine(), invocation=invocation(), exported=exported.name, new=NEW_TOKENS)
    write_section(path, "trainium-deploy", checked.splitlines())
    write_section(path, "trainium-deploy-commands", ["```", *commands, "```"])


CHECKED = """\
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

Machine: {machine}. Regenerate with `{invocation}`."""


if __name__ == "__main__":
    raise SystemExit(main())
