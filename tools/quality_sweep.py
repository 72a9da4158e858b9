"""Perplexity of SmolLM2-135M after rewriting its MLPs: plain SVD vs whitened vs whitened + global budget.

    python tools/quality_sweep.py [--keeps 0.9 0.8 0.7 0.6] [--aligns 32 128] [--out docs/quality.md]

Calibration: the Old Testament of the KJV. Every model is scored on two texts (tools/assets.py): the held-out
New Testament, which shares no text with the calibration, and modern English news from another source (the Lee
corpus). Every number in the written page comes from an `onnx-nmm` command the page lists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import DOMAINS, CommandLog, invocation, write_section  # noqa: E402

from onnx_nmm import external_data_path  # noqa: E402

METHODS = {  # column → rewrite flags
    "plain SVD": ["--method", "svd"],
    "whitened": ["--method", "whiten"],
    "whitened, global budget": ["--method", "whiten", "--budget", "global"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6])
    parser.add_argument("--aligns", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--work", default="out/quality")
    parser.add_argument("--out", default="docs/quality.md")
    args = parser.parse_args()
    work = Path(args.work)
    model, tokenizer, calibration, _ = assets.smollm2_study(work)
    run = CommandLog()
    dense = run.two_domain_scores(model, tokenizer, args.eval_windows)
    stats = work / "smollm2-stats.npz"
    if not stats.exists():
        run.run("rewrite", model, "-o", work / "calibrated.onnx", "--calib", calibration, "--tokenizer", tokenizer,
                     "--calib-samples", args.calib_samples, "--seq-len", 512, "--save-calib-stats", stats, "--quiet")
    rows = []
    for align in args.aligns:
        for keep in args.keeps:
            row = {"keep": keep, "align": align}
            for column, flags in METHODS.items():
                name = f"{column.replace(' ', '-').replace(',', '')}-k{keep}-a{align}"
                out, report = work / f"{name}.onnx", work / f"{name}.json"
                run.run("rewrite", model, "-o", out, "--keep", keep, "--align", align, *flags, "--calib", stats,
                             "--report", report, "--quiet")
                totals = json.loads(report.read_text())["totals"]
                row[column] = run.two_domain_scores(out, tokenizer, args.eval_windows)
                row[f"{column} kept"] = totals["kept_fraction"]
                out.unlink()
                external_data_path(out).unlink(missing_ok=True)
            rows.append(row)
            print(row, flush=True)
    write_page(Path(args.out), dense, rows, run.lines, args)
    return 0


def write_page(path: Path, dense: dict[str, float], rows: list[dict], commands: list[str], args) -> None:
    lines = [
        "## Uniform compression of every MLP: plain SVD, whitened, whitened with a global budget",
        "",
        "SmolLM2-135M-Instruct ([models.md](models.md): a LlamaForCausalLM, hidden 576, intermediate 1536, 30 layers),",
        "exported with the dynamo exporter. Only the MLPs are rewritten (gate, up, down: 90 matrices, 79.6M of its",
        "134.5M parameters), as in the paper. Perplexity is token-level, in onnxruntime on CPU, over the first",
        f"{args.eval_windows} disjoint windows of 512 tokens of each of two texts no step saw: **KJV NT**, the",
        "held-out **New Testament** of the King James Bible, and **modern**, English news prose of 2001 from another",
        f"source (the Lee corpus, 300 ABC news articles; tools/assets.py). Calibration uses {args.calib_samples}",
        "windows of 512 tokens of the **Old Testament**: calibration and evaluation share no text.",
        "",
        f"**Dense: KJV NT {dense['kjv']:.3f}, modern {dense['modern']:.3f}.** Each cell: perplexity, then its ratio",
        "to dense on the same text. *kept* is the fraction of the MLP parameters the rewrite keeps (block alignment",
        "rounds the rank, so it differs from `--keep`; the global budget keeps the same total as uniform).",
        "",
        "| align | --keep | kept | " + " | ".join(f"{column}, {heading}" for column in METHODS
                                               for heading in DOMAINS.values())
        + " | whitened beats plain (" + ", ".join(DOMAINS.values()) + ") |",
        "|---:|---:|---:|" + "---:|" * (len(METHODS) * len(DOMAINS)) + ":---:|",
    ]
    for row in rows:
        cells = [f"{row[column][d]:,.2f} ({row[column][d] / dense[d]:,.1f}×)" for column in METHODS for d in DOMAINS]
        beats = ", ".join("yes" if row["whitened"][d] < row["plain SVD"][d]
                          and row["whitened, global budget"][d] < row["plain SVD"][d] else "**no**" for d in DOMAINS)
        lines.append(f"| {row['align']} | {row['keep']} | {row['whitened kept']:.3f} | " + " | ".join(cells)
                     + f" | {beats} |")
    lines += [
        "",
        f"Measured on: {machine()}.",
        "",
        "### What this shows",
        "",
        "- Plain SVD of the weights destroys the model at every point, on both texts (perplexity in the hundreds",
        "  of thousands): SmolLM2's MLP weights are not low-rank (models.md: a quarter of the singular values",
        "  leaves a 0.33–0.72 relative error per matrix). Whitening beats it at every point by three to four",
        "  orders of magnitude.",
        "- Whitening alone still costs a factor of about 2 on the New Testament at keep 0.9 and 5 at keep 0.6,",
        "  and far more on modern prose: 8 at keep 0.9, 95 at keep 0.6. The whitening is fitted to the Old",
        "  Testament's activations, so it keeps what Bible text uses and drops what modern prose needs.",
        "  Compressing *every* MLP uniformly is not usable, least of all off the calibration text; the sections",
        "  above choose where to compress and calibrate on mixed text.",
        "- The global budget (ranks moved to the layers whose whitened truncation loses the most) helps at",
        "  keep 0.9 on both texts, but from keep 0.8 on it hurts on the New Testament, and on modern prose it",
        "  helps at 0.8 and 0.6, not at 0.7: a layer's own truncation loss does not measure what it costs the",
        "  whole model. `--max-ppl-increase` measures that instead.",
        "- With 128-aligned ranks (`--aligns 128`) the 576×1536 matrices only have ranks 128, 256 and 384 to",
        "  choose from, so keep 0.9 and 0.8 (and 0.7 and 0.6) land on the same rank.",
        "",
        "### Commands",
        "",
        f"Generated by `{invocation()}` (it prints every command as it runs it):",
        "",
        "```",
        *commands,
        "```",
    ]
    write_section(path, "uniform-sweep", lines)


if __name__ == "__main__":
    sys.exit(main())
