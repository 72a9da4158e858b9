"""Quality on text unlike the calibration text: SmolLM2's MLPs narrowed at one --keep, calibrated on the Old
Testament alone or mixed with windows the model writes (the default), scored on four held-out domains —
modern news, Usenet discussion, code comments, programmer quips (tools/assets.held_out_texts) — and on the
New Testament, before and after `finetune`, with the steps it took to get there.

    python tools/held_out_study.py [--keep 0.9] [--calibrations mixed kjv] [--finetune mixed]
                                   [--save-at 50 100] [--steps 200]

Every rewrite is `--keep K --budget sensitivity --align 32` on --calib-samples Old Testament windows of
--calib-window tokens (`mixed`: with the default mix of 32 generated windows, spelled out so that they are
sampled from the KV-cache export; `kjv`: `--calib-mix 0`). The --finetune calibrations' rewrites are
fine-tuned with finetune's defaults but for the flags printed (the generated windows sampled from the
KV-cache export, the calibration text's passages as prompts), the model saved at every --save-at step too: the
curve of held-out gain against steps from one run. Each model is scored on --eval-windows windows of 512
tokens of each text; the tuned one also answers the rewrite's check prompts. Models and scores already in
--work are kept, so an interrupted study resumes. The tables go to docs/quality.md (section held-out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx_nmm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, invocation, write_section  # noqa: E402

CALIBRATIONS = ("mixed", "kjv")


class Study:
    def __init__(self, args):
        self.args, self.log = args, CommandLog()
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.model, self.kv, self.tokenizer = assets.smollm2_onnx(), assets.smollm2_kv_onnx(), assets.smollm2_gguf()
        self.calibration_text = assets.kjv_text("calibration")
        self.texts = {"NT": assets.kjv_text("evaluation"), **assets.held_out_texts()}

    def scores(self, model: Path) -> dict[str, float]:
        return {name: self.log.perplexity(model, text, self.tokenizer, self.args.eval_windows)["perplexity"]
                for name, text in self.texts.items()}

    def rewrite(self, calibration: str) -> tuple[Path, float]:
        """The model narrowed at --keep on this calibration, and the share of the MLP parameters it removed."""
        tag = f"{calibration}-keep{self.args.keep:g}"
        out, report = self.work / f"{tag}.onnx", self.work / f"{tag}.json"
        mix = (["--calib", "generated:32", "--calib-generator", self.kv] if calibration == "mixed"
               else ["--calib-mix", 0])
        self.log.produce([out, report], "rewrite", self.model, "-o", out, "--calib", self.calibration_text,
                         "--calib-samples", self.args.calib_samples, *mix, "--calib-window", self.args.calib_window,
                         "--tokenizer", self.tokenizer, "--keep", self.args.keep, "--budget", "sensitivity",
                         "--align", 32, "--report", report)
        return out, 1 - json.loads(report.read_text())["totals"]["kept_fraction"]

    def finetune(self, rewritten: Path) -> dict[int, Path]:
        """The tuned model at each --save-at step and at the end (under the key --steps)."""
        tuned = rewritten.with_name(f"{rewritten.stem}-tuned.onnx")
        steps = {step: tuned.with_name(f"{tuned.stem}.step{step}.onnx") for step in self.args.save_at}
        steps[self.args.steps] = tuned
        # its defaults but for the generator (the KV-cache export samples far faster) and the prompts, which a
        # rewrite made since finetune reads them records itself
        self.log.produce(list(steps.values()), "finetune", rewritten, "--tokenizer", self.tokenizer, "--generator",
                         self.kv, "--prompts", self.calibration_text, "--steps", self.args.steps,
                         *(["--minutes", self.args.minutes] if self.args.minutes else []),
                         *(["--save-at", ",".join(map(str, self.args.save_at))] if self.args.save_at else []),
                         "-o", tuned, "--report", tuned.with_suffix(".json"))
        return dict(sorted(steps.items()))

    def run(self) -> None:
        dense = self.scores(self.model)
        rows, curves, answers = [], {}, {}
        for calibration in self.args.calibrations:
            rewritten, removed = self.rewrite(calibration)
            before = self.scores(rewritten)
            rows.append((calibration, "rewritten", removed, before))
            if calibration in self.args.finetune:
                tuned = self.finetune(rewritten)
                after = self.scores(tuned[self.args.steps])  # the result first, the curve's other points after it
                rows.append((calibration, f"after `finetune` ({self.trained(tuned[self.args.steps])})", removed,
                             after))
                answers[calibration] = self.answers(tuned[self.args.steps])
                stopped = json.loads(tuned[self.args.steps].with_suffix(".json").read_text())["steps"]
                curves[calibration] = {0: before} | {step: self.scores(path) for step, path in tuned.items()
                                                     if step != self.args.steps} | {stopped: after}
        self.write(dense, rows, curves, answers)

    def trained(self, tuned: Path) -> str:
        """How long finetune trained, from its report."""
        report = json.loads(tuned.with_suffix(".json").read_text())
        return f"{report['steps']} steps, {report['seconds'] / 60:.0f} min, stopped by {report['stopped_by']}"

    def answers(self, tuned: Path):
        return onnx_nmm.check_answers(self.model, tuned, onnx_nmm.load_tokenizer(self.tokenizer))

    def increases(self, dense: dict, scores: dict) -> list[str]:
        rises = {name: scores[name] / dense[name] - 1 for name in self.texts}
        held_out = [rises[name] for name in self.texts if name != "NT"]
        return [f"{rises[name]:+.1%}" for name in self.texts] + [f"{sum(held_out) / len(held_out):+.1%}",
                                                                  f"{max(held_out):+.1%}"]

    def write(self, dense: dict, rows: list, curves: dict, answers: dict) -> None:
        names = list(self.texts)
        head = "| " + " | ".join(names) + " | mean of the four held out | worst held out |"
        lines = ["## Text unlike the calibration text: four held-out domains", "",
                 f"Generated by `{invocation()}` on {machine()}. SmolLM2-135M-Instruct, its MLPs narrowed at "
                 f"`--keep {self.args.keep:g} --budget sensitivity --align 32`, calibrated on "
                 f"{self.args.calib_samples} Old Testament windows of {self.args.calib_window} tokens (`mixed`: "
                 "with the 32 windows the model writes that a text is now mixed with by default; `kjv`: "
                 f"`--calib-mix 0`). Perplexity on the first {self.args.eval_windows} windows of 512 tokens of "
                 "each text, none of which any calibration or training saw: NT the King James New Testament (the "
                 "calibration corpus's other half), news the Lee corpus, usenet gensim's 20 Newsgroups sample, "
                 "code the comments and docstrings of Python's standard library, quips pyjokes "
                 "(tools/assets.py).", "",
                 "| calibration | model | MLP removed |" + head[1:],
                 "|---|---|---:|" + "---:|" * (len(names) + 2),
                 "| | dense | | " + " | ".join(f"{dense[name]:.2f}" for name in names) + " | | |"]
        for calibration, model, removed, scores in rows:
            lines.append(f"| {calibration} | {model} | {removed:.1%} | " + " | ".join(self.increases(dense, scores))
                         + " |")
        for calibration, curve in curves.items():
            lines += ["", f"Held-out gain against fine-tuning steps ({calibration}; one run, its cosine schedule, "
                          "the model saved on the way with `--save-at`; the last row is where it stopped):", "",
                      "| steps " + head, "|---:|" + "---:|" * (len(names) + 2)]
            lines += [f"| {step} | " + " | ".join(self.increases(dense, scores)) + " |"
                      for step, scores in curve.items()]
        for calibration, check in answers.items():
            lines += ["", f"The check prompts after `finetune` ({calibration}): mean drop {check.mean_drop:.2f} nats "
                          "per token of the dense answers' likelihood (the rewrite warns past 1.0).", "",
                      "| prompt | dense | after `finetune` |", "|---|---|---|"]
            lines += [f"| {prompt} | {dense_answer!r} | {tuned!r} |"
                      for prompt, dense_answer, tuned in zip(check.prompts, check.dense, check.rewritten)]
        lines += ["", "<details><summary>The commands</summary>", "", "```", *self.log.lines, "```", "", "</details>"]
        write_section(self.args.quality, "held-out", lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=float, default=0.9)
    parser.add_argument("--calibrations", nargs="*", choices=CALIBRATIONS, default=list(CALIBRATIONS))
    parser.add_argument("--finetune", nargs="*", choices=CALIBRATIONS, default=["mixed"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--minutes", type=float, help="finetune's time budget (default: none, --steps alone)")
    parser.add_argument("--save-at", nargs="*", type=int, default=[50, 100], metavar="STEP",
                        help="the steps the curve also scores (none: no curve)")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-window", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--work", default="out/held-out")
    parser.add_argument("--quality", default="docs/quality.md")
    Study(parser.parse_args()).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
