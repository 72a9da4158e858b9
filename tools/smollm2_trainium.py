"""SmolLM2-135M through the Trainium path: fused NKI kernels on the emulator, and their modelled speed.

    python tools/smollm2_trainium.py [--out docs/trainium.md]

1. rewrite SmolLM2's MLPs (whitened SVD, keep 0.8, 128-aligned ranks) and fuse each into SvdGatedMLP;
   also an exact full-rank rewrite, which isolates the kernels' own numerics from the compression;
2. run both through the emulator backend (every SvdGatedMLP on the fused_svd_mlp NKI kernel, bf16) and
   compare with onnxruntime on real text, and answer a prompt greedily on each backend;
3. `compile --dry-run` for trn1 and trn2 at 1 and 128 tokens: the modelled time of the fused kernels
   against the same MLPs dense.
Every command is recorded in the page; Trainium times are modelled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog  # noqa: E402

PROMPT = "What is the capital of France?"


def greedy(model, tokenizer, prompt_ids: np.ndarray, steps: int) -> str:
    ids = list(prompt_ids)
    for _ in range(steps):
        next_id = int(model.logits(np.array([ids], np.int64))[0, -1].argmax())
        ids.append(next_id)
        if next_id == tokenizer.eos_token_id:
            break
    return tokenizer.decode(ids[len(prompt_ids):], skip_special_tokens=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="out/trainium")
    parser.add_argument("--stats", default="out/quality/smollm2-stats.npz",
                        help="calibration statistics (tools/quality_sweep.py writes them); gathered if missing")
    parser.add_argument("--out", default="docs/trainium.md")
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    from onnx_nmm import ModelRunner, load_tokenizer

    work = Path(args.work)
    model, gguf, calibration, evaluation = assets.smollm2_study(work)
    onnx_nmm = CommandLog()
    calib = ["--calib", args.stats] if Path(args.stats).exists() else [
        "--calib", calibration, "--tokenizer", gguf, "--calib-samples", "128", "--seq-len", "512"]
    compressed, exact = work / "smollm2-keep0.8.onnx", work / "smollm2-full-rank.onnx"
    onnx_nmm.run("rewrite", model, "-o", compressed, "--keep", "0.8", "--align", "128", *calib, "--fuse-mlp",
                 "--report", work / "keep0.8.json", "--quiet")
    onnx_nmm.run("rewrite", model, "-o", exact, "--rank", "full", "--fuse-mlp", "--quiet")
    totals = json.loads((work / "keep0.8.json").read_text())

    text = ["--text", evaluation, "--tokenizer", gguf, "--window", "256", "--max-windows", args.windows, "--json"]
    emulated = ["--backend", "emulator", *text]
    agreement = {
        "full rank: emulator kernels vs onnxruntime": onnx_nmm.json("diff", exact, exact, *emulated),
        "keep 0.8: emulator kernels vs onnxruntime": onnx_nmm.json("diff", compressed, compressed, *emulated),
        "keep 0.8 on the emulator vs the original": onnx_nmm.json("diff", model, compressed, *emulated),
    }

    tokenizer = load_tokenizer(gguf)
    chat = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = np.asarray(tokenizer(prompt, add_special_tokens=False)["input_ids"], np.int64)
    answers = {}
    for label, path, backend in [("original, onnxruntime", model, "ort"),
                                 ("full-rank rewrite, emulator kernels", exact, "emulator"),
                                 ("keep 0.8, onnxruntime", compressed, "ort"),
                                 ("keep 0.8, emulator kernels", compressed, "emulator")]:
        answers[label] = greedy(ModelRunner(path, backend), tokenizer, prompt_ids, steps=12)
        print(label, "→", repr(answers[label]), flush=True)

    modelled = {}
    for target in ("trn1", "trn2"):
        for tokens in (1, 128):
            onnx_nmm.run("compile", compressed, "--target", target, "--batch", 1, "--seq-len", tokens, "-o",
                     work / f"{target}-{tokens}", "--dry-run", "--force")
            modelled[(target, tokens)] = json.loads((work / f"{target}-{tokens}" / "manifest.json").read_text())
    write_page(Path(args.out), totals, agreement, answers, modelled, onnx_nmm.lines, args)
    return 0


def write_page(path, totals, agreement, answers, modelled, commands, args) -> None:
    kept = totals["totals"]
    rank = next(layer["rank"] for layer in totals["layers"] if layer["status"] == "factorized")
    lines = [
        "# SmolLM2-135M on the Trainium path",
        "",
        "SmolLM2-135M-Instruct ([models.md](models.md)) with its 30 MLPs rewritten and fused: each gate/up/down triple",
        "is one `ai.onnx_nmm::SvdGatedMLP`, which the lowering hands to the `fused_svd_mlp` NKI kernel",
        "(docs/kernels.md). Two rewrites: **keep 0.8** (whitened SVD calibrated on the Old Testament, ranks",
        f"aligned to 128: rank {rank}, {kept['kept_fraction']:.1%} of the MLP parameters kept) "
        "and an exact **full-rank**",
        "rewrite, which isolates what the kernels themselves change: bf16 operands, fp32 accumulation.",
        "",
        "## Agreement with onnxruntime",
        "",
        f"On the New Testament, {args.windows} windows of 256 tokens; the candidate runs on the "
        "**emulator backend** (the",
        "lowered PyTorch module, every SvdGatedMLP executed by the NKI kernel on the NumPy emulator in bf16); the",
        "reference runs in onnxruntime (fp32).",
        "",
        "| comparison | perplexity (reference → candidate) | top-1 agreement | mean KL (nats) |",
        "|---|---|---:|---:|",
    ]
    for label, result in agreement.items():
        a, b = result["reference"]["perplexity"], result["candidate"]["perplexity"]
        lines.append(f"| {label} | {a:.3f} → {b:.3f} | {result['top1_agreement']:.2%} | {result['mean_kl']:.4f} |")
    lines += [
        "",
        f"Greedy answers to “{PROMPT}” (chat template, 12 tokens at most, no KV cache):",
        "",
        "| model and backend | answer |",
        "|---|---|",
        *[f"| {label} | {answer!r} |" for label, answer in answers.items()],
        "",
        "## Modelled Trainium time of the MLPs",
        "",
        "From `onnx-nmm compile --dry-run` (the block sizes come from the kernels' planner; "
        "times from the cost model of",
        "docs/kernels.md — **modelled, not measured**). *Dense* is the same 30 MLPs with their original weights on the",
        "dense NKI matmul (three matmuls and the gated activation per MLP).",
        "",
        "| target | tokens | fused SVD MLP kernels µs | dense MLPs µs | speed-up | HBM MB fused / dense |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for (target, tokens), manifest in modelled.items():
        fused, dense = manifest["modelled_us"], manifest["modelled_dense_us"]
        hbm = sum(k["hbm_mb"] for k in manifest["kernels"]), sum(k["hbm_dense_mb"] for k in manifest["kernels"])
        lines.append(f"| {target} | {tokens} | {fused:,.1f} | {dense:,.1f} | {dense / fused:.2f}× | "
                     f"{hbm[0]:.1f} / {hbm[1]:.1f} |")
    lines += [
        "",
        "How to read these: at keep 0.8 with 128-aligned ranks SmolLM2's MLPs keep most of their weights (rank",
        "384 of 576), so the weight traffic falls only by the last column's first figures. Most of the modelled",
        "gain is the fusion itself: the dense MLP is four kernel launches (three matmuls and the gated",
        "activation), each paying its DMA start-up and pipeline fill and drain and sending its activations",
        "through HBM, where the fused kernel is one launch that keeps actᵀ on chip. That part does not depend",
        "on the compression; docs/kernels.md has the kernel-by-kernel comparison (fused XUV vs unfused vs dense).",
        "",
        f"The emulator runs were made on: {machine()}.",
        "",
        "## Commands",
        "",
        "Generated by `python tools/smollm2_trainium.py`, which ran:",
        "",
        "```",
        *commands,
        "```",
        "",
        "(The greedy answers come from the same script, calling "
        "`onnx_nmm.runtime.backend_runner.ModelRunner` in a loop.)",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
