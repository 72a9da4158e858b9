"""`compile --tp` checked end to end on a real model's KV export: docs/trainium.md's section `tp-compile` for
SmolLM2-135M (9 query heads, 3 KV heads; tp 3), `tp-compile-qwen` for Qwen2.5-Coder-0.5B-Instruct (14 query heads,
2 KV heads, q/k/v with biases, a vocabulary of 151,936; tp 2).

    python tools/tp_compile_check.py [--model smollm2|qwen] [--out docs/trainium.md] [--tp N]

1. the model's KV export (`onnx-nmm export`'s default form) and its rewrite at keep 0.9, weight-only SVD (no
   calibration, so its answers may be poor: the point is that the rank programs give the same ones; a calibrated
   rewrite of SmolLM2 takes 40 minutes on 2 shared cores);
2. each compiled with `--target trn1 --max-context 256 --tp N --dry-run`: N rank programs per graph, timed, its
   peak memory measured (a process of its own; kept beside the folder, so a run stopped in a later step resumes
   without compiling again);
3. `generate DIR --backend torch` (the rank programs in lock-step, the collectives simulated) against
   `generate MODEL` on onnxruntime, and `diff MODEL DIR --backend torch`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, invocation, run_measured, write_section  # noqa: E402

PROMPTS = ("What is the capital of France?", "Why is the sky blue?")
NEW_TOKENS = 24


@dataclass(frozen=True)
class Checked:
    """A model the check runs on: its KV export and tokenizer, its files' stem under --work, the tp that splits
    its heads, the docs section it writes."""

    exported: Callable[[], Path]
    gguf: Callable[[], Path]
    stem: str
    tp: int
    section: str
    prompts: tuple[str, ...]


MODELS = {
    "smollm2": Checked(assets.smollm2_kv_onnx, assets.smollm2_gguf, "smollm2-kv", 3, "tp-compile", PROMPTS),
    # a compile and a generate take several times SmolLM2's at 4x the weights: one prompt
    "qwen": Checked(assets.qwen25_kv_onnx, assets.qwen25_gguf, "qwen-kv", 2, "tp-compile-qwen", PROMPTS[:1]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--out", default="docs/trainium.md")
    parser.add_argument("--work", default="out/tp-compile")
    parser.add_argument("--tp", type=int, help="the NeuronCores to split over (default: 3 for smollm2, 2 for qwen)")
    args = parser.parse_args()
    checked = MODELS[args.model]
    tp = args.tp or checked.tp
    work, gguf, exported = Path(args.work), checked.gguf(), checked.exported()
    rewritten = work / f"{checked.stem}-keep0.9.onnx"
    log = CommandLog()
    log.produce([rewritten], "rewrite", exported, "-o", rewritten, "--keep", "0.9", "--quiet")
    rows, answers = [], []
    for label, model in (("dense", exported), ("keep 0.9", rewritten)):
        folder = work / f"{model.stem if model != exported else checked.stem}.tp{tp}"
        measured = measured_compile(log, model, folder, tp)
        manifest = json.loads((folder / "manifest.json").read_text())
        differences = log.json("diff", model, folder, "--backend", "torch", "--tokens", 64, "--json")["outputs"]
        for graph in manifest["graphs"]:
            rows.append((label, graph, manifest, measured, differences))
        for prompt in checked.prompts:
            common = ["--prompt", prompt, "--tokenizer", gguf, "--max-new-tokens", NEW_TOKENS, "--json"]
            answers.append((label, prompt, log.json("generate", model, *common),
                            log.json("generate", folder, *common, "--backend", "torch")))
    write_page(Path(args.out), checked.section, tp, rows, answers, log.lines)
    return 0 if all(reference["tokens"] == split["tokens"] for _, _, reference, split in answers) else 1


def measured_compile(log: CommandLog, model: Path, folder: Path, tp: int) -> dict:
    """`compile --tp` of `model` into `folder`, in a process of its own (run_measured): its wall time and peak RSS,
    kept in FOLDER.measured.json and reused while that is newer than the model."""
    argv = ["compile", model, "--target", "trn1", "--max-context", 256, "--tp", tp, "--dry-run", "-o", folder,
            "--force"]
    log.kept(*argv)
    kept = folder.with_name(f"{folder.name}.measured.json")
    if not (kept.exists() and kept.stat().st_mtime >= model.stat().st_mtime and (folder / "manifest.json").exists()):
        kept.unlink(missing_ok=True)
        kept.write_text(json.dumps(run_measured([sys.executable, "-m", "onnx_nmm", *map(str, argv)])))
    return json.loads(kept.read_text())


def write_page(path: Path, section: str, tp: int, rows: list, answers: list, commands: list[str]) -> None:
    header = ("| model | graph | rank programs | collectives | rank programs together vs onnxruntime, max abs | "
              "compile: wall, peak memory |\n|---|---|---:|---|---:|---:|")
    lines = []
    for label, graph, _manifest, measured, _ in rows:
        counts: dict[str, int] = {}
        for join in graph["collectives"]:
            counts[join["op"]] = counts.get(join["op"], 0) + 1
        lines.append(f"| {label} | {graph['name']} | {len(graph['ranks'])} | "
                     f"{', '.join(f'{count} {op}' for op, count in counts.items())} | "
                     f"{graph['lowering_check']['max_abs']:.1e} | {measured['wall_s']:.0f} s, "
                     f"{measured['peak_rss_bytes'] / 2**30:.1f} GiB |")
    checks = sorted({(label, manifest["generation_check"]["max_abs"], manifest["generation_check"]["tolerance"],
                      tuple(f"{d['name']}: max abs {d['max_abs']:.1e}, top-1 {d['top1_agreement']:.0%}"
                            for d in differences))
                     for label, _, manifest, _, differences in rows})
    said = "\n".join(f"| {label} | {prompt} | {reference['text']!r} | {split['text']!r} | "
                     f"{'yes' if reference['tokens'] == split['tokens'] else 'NO'} |"
                     for label, prompt, reference, split in answers)
    sharding = rows[0][2]["sharding"]["note"]
    text = [f"{sharding}. Generated by `{invocation()}` on {machine()}.", "", header, *lines, "",
            *(f"- {label}: against the model as given, the largest step difference {worst:.1e} (refused above "
              f"{tolerance:.1e}); `diff`: {'; '.join(diff)}" for label, worst, tolerance, diff in checks), "",
            f"Greedy answers, {NEW_TOKENS} new tokens at most, `generate MODEL` (onnxruntime) against "
            f"`generate DIR --backend torch` (the {tp} rank programs); the rewrite is weight-only SVD at keep 0.9, "
            "without calibration, so its answers may be poor — the rank programs give the same ones:", "",
            "| model | prompt | onnxruntime | rank programs | same tokens |", "|---|---|---|---|---|", said, "",
            "```", *commands, "```"]
    write_section(path, section, text)


if __name__ == "__main__":
    raise SystemExit(main())
