"""Which calibration text makes a rewrite hold on text it never saw: the King James Old Testament, text the
model generates itself, or both mixed — scored on two domains.

    python tools/calibration_study.py [--model smollm2|qwen] [--ppl-budget 0.1 0.05] [--keeps 0.97 0.9:sensitivity]
                                      [--align 32] [--calib-samples 16] [--finetune mixed:keep-0.9:900]

For each calibration (`--calib kjv.txt`, `--calib generated:N`, `--calib kjv.txt --calib generated:N/2`
with N/2 Old Testament windows), with everything on (Fisher-weighted SVD, ranks where they cost least,
distillation fine-tuning), the model's MLPs are rewritten:

    --max-ppl-increase P     the budgets (--ppl-budget P [P ...]; 0 skips them), measured on calibration windows
                             held out of the statistics: what each promises (its measured mean and spread over
                             those windows) against what it delivers
    --keep K --budget B      fixed reductions, KEEP[:BUDGET] in --keeps (global unless named): `global` spends
                             them where the predicted KL is least (no measurement), `sensitivity` measures that
                             choice once more on held-out windows and moves it where the measured damage is least
    + distillation           the rewrites named in --finetune (CALIBRATION:TAG[:SECONDS], the tag as in the
                             file names: ppl-0.1, keep-0.9, keep-0.9-sensitivity, ending -alignN when --align is
                             not 32) fine-tuned by `finetune` with its default loss (distillation from the
                             dense model) on --train-samples windows of the calibration's own kind of text

Every model is scored on two texts neither step saw: the held-out part of the calibration corpus (the KJV
New Testament) and modern English news (the Lee corpus, tools/assets.modern_text). The page reports, per
calibration, the largest share of the MLP parameters removed within +10 % on the modern text.

Generated windows are sampled from an export of the same model with a KV cache (`--calib-generator`), which
is much faster than re-reading each sequence; they are cached (onnx_nmm.calibration.generated_text), so the rewrites and
the fine-tuning of one calibration share them. The statistics are saved by a calibration's first rewrite
when a later one reuses them; a study of one rewrite per calibration, or one given --reuse-stats, reuses the
statistics an earlier study left in --work. Models already in --work are kept: an interrupted study
resumes; delete the folder to start afresh. Every command is recorded in the page (docs/quality.md, one section per
model).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assets  # noqa: E402
from bench_models import machine  # noqa: E402
from commands import CommandLog, invocation, write_section  # noqa: E402

TOLERANCE = 0.10  # perplexity increase allowed on the modern text
BAR = 0.10  # share of the MLP parameters to remove within it (issue 17)


@dataclass(frozen=True)
class StudiedModel:
    title: str
    model: Callable[[], Path]
    tokenizer: Callable[[], Path]
    generator: Callable[[], Path]  # the same model with a KV cache, to sample generated windows fast
    work: str
    section: str  # of docs/quality.md


MODELS = {
    "smollm2": StudiedModel("SmolLM2-135M-Instruct", assets.smollm2_onnx, assets.smollm2_gguf,
                            assets.smollm2_kv_onnx, "out/calibration", "calibration-study"),
    "qwen": StudiedModel("Qwen2.5-Coder-0.5B-Instruct", assets.qwen25_onnx, assets.qwen25_gguf,
                         assets.qwen25_kv_onnx, "out/calibration-qwen", "calibration-study-qwen"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--calibrations", nargs="*", default=["kjv", "generated", "mixed"])
    parser.add_argument("--calib-samples", type=int, default=16, help="windows of 512 tokens for the statistics")
    parser.add_argument("--ppl-budget", type=float, nargs="*", default=[0.1],
                        help="the --max-ppl-increase rows (0: none)")
    parser.add_argument("--align", type=int, default=32, help="rank alignment of every rewrite")
    parser.add_argument("--sensitivity-windows", type=int, default=4,
                        help="held-out windows a budget is measured on")
    parser.add_argument("--keeps", nargs="*", type=keep_spec, default=[(0.95, "global"), (0.9, "global")],
                        metavar="KEEP[:BUDGET]",
                        help="fixed reductions, each spent by its --budget (global, the default, or sensitivity)")
    parser.add_argument("--finetune", nargs="*", type=finetune_spec, default=[], metavar="CALIBRATION:TAG[:SECONDS]",
                        help="rewrites to distil, each for SECONDS at most (default --finetune-seconds)")
    parser.add_argument("--finetune-seconds", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, help="at most (default: finetune's)")
    parser.add_argument("--finetune-lr", type=float, help="default: finetune's")
    parser.add_argument("--train-samples", type=int, help="training windows (default: --calib-samples)")
    parser.add_argument("--train-seq-len", type=int, default=512, help="tokens per training window")
    parser.add_argument("--eval-windows", type=int, default=8, help="windows of 512 tokens scored per domain")
    parser.add_argument("--work", help="where the models go (default: out/calibration[-qwen])")
    parser.add_argument("--section", help="the page's section to write (default: the model's)")
    parser.add_argument("--heading", help="that section's heading")
    parser.add_argument("--out", default="docs/quality.md")
    parser.add_argument("--reuse-stats", action="store_true",
                        help="every rewrite reuses the statistics an earlier study saved in --work (run that first)")
    parser.add_argument("--only-kept", action="store_true",
                        help="run nothing new: write the page from the models an earlier run left in --work, and "
                             "say which steps are missing")
    args = parser.parse_args()
    study = Study(args)
    study.run()
    study.write_page(Path(args.out))
    return 0


class Study:
    def __init__(self, args):
        self.args = args
        self.studied = MODELS[args.model]
        self.work = Path(args.work or self.studied.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer, self.generator = (self.studied.model(), self.studied.tokenizer(),
                                                      self.studied.generator())
        self.kjv = assets.kjv_text("calibration")
        self.commands = CommandLog()
        self.rows: list[dict] = []
        self.dense: dict[str, float] = {}
        self.missing: list[str] = []  # steps --only-kept found no model for

    def calibration(self, name: str) -> list:
        return self._sources(name, self.args.calib_samples, "--calib", "--calib-samples", "--calib-generator")

    def training_text(self, name: str) -> list:
        samples = self.args.train_samples or self.args.calib_samples
        return self._sources(name, samples, "--text", "--samples", "--generator")

    def _sources(self, name: str, n: int, source: str, samples: str, generator: str) -> list:
        generated = [generator, self.generator]
        return {"kjv": [source, self.kjv, samples, n],
                "generated": [source, f"generated:{n}", *generated],
                "mixed": [source, self.kjv, samples, n // 2, source, f"generated:{n // 2}", *generated]}[name]

    def scores(self, path) -> dict[str, float]:
        return self.commands.two_domain_scores(path, self.tokenizer, self.args.eval_windows)

    def run(self) -> None:
        self.dense = self.scores(self.model)
        for name in self.args.calibrations:
            self.study(name)

    def study(self, name: str) -> None:
        a = self.args
        stats = self.work / f"{name}-stats.npz"
        common = [*self.calibration(name), "--tokenizer", self.tokenizer, "--seq-len", "512", "--align", a.align,
                  "--method", "fisher", "--sensitivity-windows", a.sensitivity_windows, "--quiet", "--force"]
        aligned = "" if a.align == 32 else f"-align{a.align}"
        steps = [(f"ppl-{budget}{aligned}", ["--max-ppl-increase", budget]) for budget in a.ppl_budget if budget] + [
            (f"keep-{keep}" + ("" if budget == "global" else f"-{budget}") + aligned,
             ["--keep", keep, "--budget", budget]) for keep, budget in a.keeps]
        tuning = {tag: seconds for calibration, tag, seconds in a.finetune if calibration == name}
        for index, (tag, rule) in enumerate(steps):
            # the first rewrite gathers the statistics the later ones reuse; a lone rewrite reuses what another
            # study left in --work, and so does every rewrite with --reuse-stats
            if index > 0 or a.reuse_stats or (len(steps) == 1 and stats.exists()):
                rewritten = self.rewrite(name, tag, common + ["--calib-stats", stats, *rule])
            elif len(steps) > 1:
                rewritten = self.rewrite(name, tag, common + ["--save-calib-stats", stats, *rule], outputs=[stats])
            else:
                rewritten = self.rewrite(name, tag, common + rule)
            if tag in tuning and rewritten is not None:
                self.finetune(name, rewritten, self.rows[-1], tuning[tag] or a.finetune_seconds)
            elif tag in tuning:
                self.missing.append(f"{name}-{tag}-distilled")

    def kept(self, out: Path, report: Path) -> bool:
        """Whether to go on with a step: always, unless --only-kept and it left no model."""
        if self.args.only_kept and not (out.exists() and report.exists()):
            self.missing.append(out.stem)
            return False
        return True

    def rewrite(self, name: str, tag: str, flags: list, outputs: list | None = None) -> Path | None:
        out = self.work / f"{name}-{tag}.onnx"
        report = out.with_suffix(".json")
        if not self.kept(out, report):
            return None
        self.commands.produce([out, report, *(outputs or [])], "rewrite", self.model, "-o", out, *flags,
                              "--report", report)
        written = json.loads(report.read_text())
        chosen_by = " ".join(str(flag) for flag in flags[flags.index("--max-ppl-increase" if "--max-ppl-increase"
                                                                    in flags else "--keep"):])
        self.rows.append({"calibration": name, "chosen_by": chosen_by, "fine-tuned": False,
                          "removed": 1 - written["totals"]["kept_fraction"],
                          "promised": written["quality_budget"].get("spread"),
                          "measured": written["quality_budget"].get("measured"), **self.scores(out)})
        print(self.rows[-1], flush=True)
        return out

    def finetune(self, name: str, rewritten: Path, base: dict, seconds: int) -> Path | None:
        a = self.args
        tuned = rewritten.with_name(f"{rewritten.stem}-distilled.onnx")
        report = tuned.with_suffix(".json")
        if not self.kept(tuned, report):
            return None
        optional = [*(["--steps", a.finetune_steps] if a.finetune_steps else []),
                    *(["--lr", a.finetune_lr] if a.finetune_lr else [])]
        self.commands.produce([tuned, report], "finetune", rewritten, "-o", tuned, *self.training_text(name),
                              "--tokenizer", self.tokenizer, "--seq-len", a.train_seq_len, *optional,
                              "--time-budget", seconds, "--report", report, "--quiet", "--force")
        written = json.loads(report.read_text())
        self.rows.append({**base, "fine-tuned": True, "loss": written["loss"], "steps": written["steps"],
                          "seconds": written["seconds"], "promised": None, "measured": None, **self.scores(tuned)})
        print(self.rows[-1], flush=True)
        return tuned

    def best_within(self) -> dict[str, float | None]:
        limit = self.dense["modern"] * (1 + TOLERANCE)
        return {name: max((row["removed"] for row in self.rows if row["calibration"] == name
                           and row["modern"] <= limit), default=None) for name in self.args.calibrations}

    def write_page(self, path: Path) -> None:
        a, dense = self.args, self.dense
        names = {"kjv": f"KJV Old Testament ({a.calib_samples} windows)",
                 "generated": f"generated ({a.calib_samples} windows)",
                 "mixed": f"mixed ({a.calib_samples // 2} Old Testament + {a.calib_samples // 2} generated)"}
        limits = (f", {a.finetune_steps} steps at most" if a.finetune_steps else "") + (
            f", lr {a.finetune_lr:g}" if a.finetune_lr else "")
        training = (f"{a.train_samples or a.calib_samples} windows of {a.train_seq_len} tokens of the calibration's "
                    f"kind of text (mixed: half and half){limits}")
        tuning = (f" Some are then fine-tuned by `finetune` with its default loss (distillation from the dense "
                  f"model) on {training}; each row says for how long." if a.finetune else " No fine-tuning here.")
        heading = a.heading or ("Calibration that holds off the calibration text: KJV, generated, mixed"
                                if a.model == "smollm2" else f"The same on {self.studied.title}")
        intro = " ".join([
            f"{self.studied.title}, MLPs rewritten with everything on: Fisher-weighted SVD (`--method fisher`),",
            f"ranks aligned to {a.align} and spent where they cost least — by the predicted KL (`--budget global`), or",
            "by that prediction checked on held-out windows (`--budget sensitivity`)." + tuning,
            "Calibration windows are 512 tokens; *generated* windows are sampled from the dense model itself",
            "(`--calib generated:N`: the tokenizer's BOS token, or its end-of-text token when it has none, then",
            "temperature 1, top-p 0.95, one seed per batch of 8).",
            f"Every model is scored on {a.eval_windows} windows of 512 tokens of two texts no step saw: **KJV NT**,",
            "the held-out New Testament (the calibration corpus's other part), and **modern**, English news prose",
            "of 2001 from another source (the Lee corpus, 300 ABC news articles, shipped as test data in the PyPI",
            "package gensim; tools/assets.py). *budget measured*: what `--max-ppl-increase` measured on its",
            f"{a.sensitivity_windows} calibration windows held out of the statistics (mean, and min … max over the",
            "windows)."])
        lines = [
            f"## {heading}",
            "",
            *textwrap.wrap(intro, 110, break_on_hyphens=False),
            "",
            f"**Dense: KJV NT {dense['kjv']:.3f}, modern {dense['modern']:.3f}.**",
            "",
            "| calibration | chosen by | fine-tuned | MLP parameters removed | budget measured | KJV NT | modern |",
            "|---|---|:---:|---:|---|---:|---:|",
        ]
        for row in self.rows:
            promised = row["promised"]
            measured = "—" if not promised else (f"{_expm1(row['measured']):+.1%} ({promised['min']:+.1%} … "
                                                 f"{promised['max']:+.1%})")
            tuned = (f"distilled, {row['steps']} steps ({row['seconds'] / 60:.0f} min)" if row["fine-tuned"]
                     else "no")
            lines.append(f"| {names[row['calibration']]} | `{row['chosen_by']}` | {tuned} | {row['removed']:.2%} | "
                         f"{measured} | {_cell(row['kjv'], dense['kjv'])} | {_cell(row['modern'], dense['modern'])} |")
        best = self.best_within()
        lines += ["", "Largest share of the MLP parameters removed within +10 % on the modern text, of the models "
                      "tried:", ""]
        ran = {row["calibration"] for row in self.rows}
        lines += [f"- {names[name]}: **{removed:.2%}**" if removed is not None else
                  f"- {names[name]}: {'none of the models tried' if name in ran else 'not run'}"
                  for name, removed in best.items()]
        met = [name for name, removed in best.items() if removed is not None and removed >= BAR]
        lines += ["", f"The bar — at least {BAR:.0%} of the MLP parameters removed within +10 % on the modern text, "
                      "calibrated without it — is " + (f"**met** by {', '.join(names[n] for n in met)}." if met
                                                        else "**not met**.")]
        if self.missing:
            lines += ["", "Not run (out of time on a CPU shared with other jobs): " + ", ".join(self.missing) + "."]
        lines += ["", f"Measured on: {machine()}.", "", "### Commands", "",
                  f"Generated by `{invocation()}`:",
                  "", "```", *self.commands.lines, "```"]
        write_section(path, a.section or self.studied.section, lines)


def finetune_spec(text: str) -> tuple[str, str, int | None]:
    """CALIBRATION:TAG[:SECONDS], e.g. mixed:keep-0.9-sensitivity:2700."""
    calibration, _, rest = text.partition(":")
    tag, _, seconds = rest.partition(":")
    if not tag or (seconds and not seconds.isdigit()):
        raise argparse.ArgumentTypeError(f"{text}: give CALIBRATION:TAG[:SECONDS], e.g. mixed:keep-0.9:900")
    return calibration, tag, int(seconds) if seconds else None


def keep_spec(text: str) -> tuple[float, str]:
    """KEEP[:BUDGET], e.g. 0.9 or 0.9:sensitivity."""
    keep, _, budget = text.partition(":")
    if budget not in ("", "global", "sensitivity"):
        raise argparse.ArgumentTypeError(f"{text}: the budget is global or sensitivity")
    return float(keep), budget or "global"


def _expm1(nats: float) -> float:
    import math

    return math.expm1(nats)


def _cell(perplexity: float, dense: float) -> str:
    return f"{perplexity:.3f} ({perplexity / dense - 1:+.1%})"


if __name__ == "__main__":
    raise SystemExit(main())
