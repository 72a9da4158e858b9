"""`onnx-nmm finetune REWRITTEN --text FILE --tokenizer T -o OUT`: train the SVD factors, write them back.

Lower the rewritten model to PyTorch, train only its factors (onnx_nmm.finetune) on CPU within a step and
a time budget, write the tuned factors into a copy of the model (same graph, only the factor initializers
changed, each in its dtype), and measure perplexity on held-out text in onnxruntime before and after.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from onnx_nmm import calibration_data
from onnx_nmm.backend_runner import ModelRunner
from onnx_nmm.cli import _common
from onnx_nmm.errors import UserError
from onnx_nmm.model_io import (PROTOBUF_LIMIT, check_model_file, check_output_path, load_model, save_model,
                               uses_external_data, weight_bytes)
from onnx_nmm.perplexity import Windows, perplexity, window_count
from onnx_nmm.svd_ops import DOMAIN

LOSSES = ("next-token", "distill")  # onnx_nmm.finetune.LOSSES, named here so `onnx-nmm --help` needs no torch


def register(subparsers) -> None:
    parser = subparsers.add_parser("finetune", help="train the SVD factors of a rewritten model (CPU, PyTorch) "
                                                    "and write them back into the ONNX model")
    parser.add_argument("model", help="a model written by `onnx-nmm rewrite` (float32)")
    parser.add_argument("-o", "--output", help="where to write the tuned model (default: MODEL.tuned.onnx)")
    parser.add_argument("--force", action="store_true", help="allow the output to replace the input model")
    data = parser.add_argument_group("training data")
    data.add_argument("--text", metavar="FILE", required=True,
                      help="a UTF-8 text file (with --tokenizer), or an .npz with input_ids [samples, seq_len]")
    data.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or a .gguf file, for text")
    data.add_argument("--seq-len", type=int, default=256,
                      help="tokens per training window, cut from the text (default 256; an .npz sets its own)")
    data.add_argument("--samples", type=int, help="use only the first N windows (default: all of them)")
    training = parser.add_argument_group("training")
    training.add_argument("--loss", choices=LOSSES,
                          help="next-token: cross-entropy on the text; distill: KL(teacher ‖ student) of the "
                               "next-token distributions (default: distill with --teacher, else next-token)")
    training.add_argument("--teacher", metavar="ORIGINAL.onnx",
                          help="the dense model the rewrite started from, run in onnxruntime (for --loss distill)")
    training.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    training.add_argument("--steps", type=int, default=200, help="optimizer steps at most (default 200)")
    training.add_argument("--time-budget", type=float, metavar="SECONDS",
                          help="stop training before it would run longer than this (lowering, evaluation and "
                               "writing come on top); the first of --steps and --time-budget ends training")
    training.add_argument("--lr", type=float, default=1e-4,
                          help="peak AdamW learning rate, cosine-decayed to a tenth over the budget (default 1e-4; "
                               "adapters want more, e.g. 1e-3)")
    training.add_argument("--batch", type=int, default=2, help="windows per step (default 2)")
    training.add_argument("--adapters", type=int, metavar="RANK",
                          help="train LoRA adapters of this rank on every U and V (merged back before writing) "
                               "instead of U and V themselves")
    training.add_argument("--max-grad-norm", type=float, default=1.0,
                          help="clip the gradient to this global norm (default 1)")
    training.add_argument("--seed", type=int, default=0, help="seed of the window order and the adapters")
    training.add_argument("--threads", type=int,
                          help="PyTorch CPU threads (default: PyTorch's, one per core); 1 is much faster on a "
                               "machine whose cores other jobs keep busy")
    evaluation = parser.add_argument_group("evaluation (held-out text, onnxruntime)")
    evaluation.add_argument("--eval-text", metavar="FILE",
                            help="perplexity of the model before and after, on this text (with --tokenizer) or "
                                 "the input_ids of this .npz read as one sequence")
    evaluation.add_argument("--eval-window", type=int, help="tokens per perplexity window (default: --seq-len)")
    evaluation.add_argument("--eval-windows", type=int, default=16, help="disjoint windows to score (default 16)")
    parser.add_argument("--report", metavar="FILE.json", help="write the loss curve and the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the loss curve")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    parser.set_defaults(handler=run)


def run(args) -> int:
    options = _options_from(args)
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".tuned.onnx")
    check_output_path(source, output, args.force)
    model = load_model(source)
    if not any(node.domain == DOMAIN for node in model.graph):
        raise UserError(f"{source} has no {DOMAIN} SVD ops, so no factors to fine-tune; rewrite it first with "
                        "`onnx-nmm rewrite`")
    vocabulary = _logits_width(model)
    if options.loss == "distill":
        _check_teacher(args.teacher, vocabulary)
    phases = _Phases()
    with phases("reading data"):
        windows = _training_windows(args, vocabulary, options)
        eval_tokens = _evaluation_tokens(args, vocabulary) if args.eval_text else None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    before = after = None
    window = args.eval_window or windows.tokens.shape[1]
    eval_windows = Windows(window=window, stride=window, max_windows=args.eval_windows)
    with _progress(args.quiet) as progress:
        if args.eval_text:
            with phases("perplexity before"):
                before = _perplexity(source, eval_tokens, eval_windows, progress, "perplexity before")
        result = _train_and_write(args, options, model, windows, output, progress, phases)
        _warn_if_the_loss_rose(result, options)
        if args.eval_text:
            with phases("perplexity after"):
                after = _perplexity(output, eval_tokens, eval_windows, progress, "perplexity after")

    if args.plot:
        from onnx_nmm.finetune_plot import plot_loss_curve

        title = _plot_title(source, options, result, windows, before, after, args.eval_text)
        plot_loss_curve(result, args.plot, title, options.loss)
    if args.report:
        _common.write_json(args.report, {
            "input": str(source), "output": str(output), "loss": options.loss,
            "teacher": args.teacher if options.loss == "distill" else None,
            "training_data": windows.description, "options": asdict(options) | {"warmup_steps": options.warmup_steps},
            **result.to_dict(), "seconds_by_phase": phases.seconds, "eval_text": args.eval_text,
            "perplexity_before": before.to_dict() if before else None,
            "perplexity_after": after.to_dict() if after else None,
        })
    if not args.quiet:
        _print_summary(result, options, windows.description, before, after, output, phases.seconds)
    return 0


def _train_and_write(args, options, model, windows, output: Path, progress: Progress, phases: "_Phases"):
    """Lower, train the factors, write them into `model` and save it to `output`; the TrainingResult."""
    from onnx_nmm.finetune import CausalLmInputs, finetune, replace_factors
    from onnx_nmm.lowering import factor_parameters, lower

    task = progress.add_task("lowering to PyTorch", total=None)
    with phases("lowering"):
        module = lower(args.model)
        teacher = ModelRunner(args.teacher).logits if options.loss == "distill" else None
    progress.update(task, total=options.steps, description=_step_description(options.loss, None))

    def on_step(record):
        progress.update(task, completed=record.step, description=_step_description(options.loss, record.loss))

    with phases("training"):
        result = finetune(module, windows.tokens, CausalLmInputs(model.graph), options, teacher, on_step)
    del teacher  # its onnxruntime session
    progress.update(task, description="writing")
    with phases("writing"):
        replace_factors(model, factor_parameters(module))
        del module
        external = uses_external_data(model) or weight_bytes(model) > PROTOBUF_LIMIT
        save_model(model, output, external_data=external, validate=check_model_file)
    progress.update(task, visible=False)
    return result


def _options_from(args):
    from onnx_nmm.finetune import FinetuneOptions

    loss = args.loss or ("distill" if args.teacher else "next-token")
    if loss == "distill" and args.teacher is None:
        raise UserError("--loss distill needs the dense model: give --teacher ORIGINAL.onnx")
    for flag, value, least in (("--seq-len", args.seq_len, 2), ("--samples", args.samples, 1),
                               ("--threads", args.threads, 1), ("--eval-window", args.eval_window, 2),
                               ("--eval-windows", args.eval_windows, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    return FinetuneOptions(steps=args.steps, time_budget=args.time_budget, learning_rate=args.lr, batch=args.batch,
                           loss=loss, temperature=args.temperature, adapter_rank=args.adapters,
                           max_grad_norm=args.max_grad_norm, seed=args.seed)


class _Phases:
    """Wall seconds of each named phase of the command, in order."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def _check_teacher(path: str, vocabulary: int | None) -> None:
    teacher_vocabulary = _logits_width(load_model(path))
    if None not in (vocabulary, teacher_vocabulary) and vocabulary != teacher_vocabulary:
        raise UserError(f"the teacher {path} predicts {teacher_vocabulary} tokens, the model {vocabulary}: "
                        "give the dense model this one was rewritten from")


def _training_windows(args, vocabulary: int | None, options) -> calibration_data.TokenWindows:
    from onnx_nmm.finetune import check_windows

    if args.text.endswith(".npz"):
        windows = calibration_data.windows_from_npz(args.text, args.samples)
    else:
        if args.tokenizer is None:
            raise UserError(f"--text {args.text} is text: give its tokenizer with --tokenizer (a folder or a .gguf "
                            "file)")
        windows = calibration_data.windows_from_text(args.text, calibration_data.load_tokenizer(args.tokenizer),
                                                     args.samples, args.seq_len)
    check_windows(windows.tokens, options)
    _check_token_ids(windows.tokens, vocabulary, args.text)
    return windows


def _evaluation_tokens(args, vocabulary: int | None) -> np.ndarray:
    if args.eval_text.endswith(".npz"):
        tokens = calibration_data.windows_from_npz(args.eval_text, None).tokens.reshape(-1)
    else:
        if args.tokenizer is None:
            raise UserError(f"--eval-text {args.eval_text} is text: give its tokenizer with --tokenizer")
        tokens = calibration_data.text_tokens(args.eval_text, calibration_data.load_tokenizer(args.tokenizer))
    _check_token_ids(tokens, vocabulary, args.eval_text)
    return tokens


def _check_token_ids(tokens: np.ndarray, vocabulary: int | None, source: str) -> None:
    if tokens.size and (tokens.min() < 0 or (vocabulary is not None and tokens.max() >= vocabulary)):
        raise UserError(f"{source} holds token ids in [{tokens.min()}, {tokens.max()}], outside the model's "
                        f"vocabulary of {vocabulary}: use the model's own tokenizer")


def _logits_width(model) -> int | None:
    """The vocabulary, when the first output (the logits) has a fixed last dimension."""
    shape = model.graph.outputs[0].shape
    width = shape[-1] if shape is not None and len(shape) else None
    return width if isinstance(width, int) else None


def _perplexity(path: Path, tokens: np.ndarray, windows: Windows, progress: Progress, label: str):
    runner = ModelRunner(path)
    task = progress.add_task(label, total=window_count(len(tokens), windows))
    result = perplexity(runner.logits, tokens, windows, on_window=lambda: progress.update(task, advance=1))
    progress.update(task, visible=False)
    return result


def _step_description(loss: str, value: float | None) -> str:
    return f"training ({loss} loss {value:.4f})" if value is not None else f"training ({loss} loss)"


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=_common.stderr, disable=quiet, transient=True)


def _plot_title(source: Path, options, result, windows, before, after, eval_text: str | None) -> str:
    title = (f"{source.name}: {options.loss} loss, {result.records[-1].step} steps of "
             f"{options.batch}×{windows.tokens.shape[1]} tokens, lr {options.learning_rate:g}"
             + (f", adapters of rank {options.adapter_rank}" if options.adapter_rank else ""))
    if before and after:
        title += f"\nperplexity {before.perplexity:.3f} → {after.perplexity:.3f} on {Path(eval_text).name} (held out)"
    return title


RISEN = 1.5  # the last tenth's mean loss over the first tenth's that is taken as divergence


def _warn_if_the_loss_rose(result, options) -> None:
    """Too high a learning rate shows as a loss that ends above where it began (on Qwen2.5-0.5B, lr 1e-4
    took the distillation loss from 0.39 to 1.3 in eight steps): say so even with --quiet."""
    first, last = result.mean_loss(first=True), result.mean_loss(first=False)
    if last > RISEN * first:  # a margin, because single batches differ in difficulty
        _common.stderr.print(f"warning: the {options.loss} loss rose during training ({first:.4f} → {last:.4f}); "
                             f"the tuned model is likely worse than its input: try a lower --lr "
                             f"(this run: {options.learning_rate:g})")


def _print_summary(result, options, data: str, before, after, output: Path, seconds: dict) -> None:
    last = result.records[-1]
    stopped = "the time budget" if result.stopped_by == "time" else "the step budget"
    trained = (f"adapters of rank {options.adapter_rank} ({result.trainable_parameters / 1e6:.2f}M parameters) on "
               "the factors" if options.adapter_rank else f"{result.trainable_parameters / 1e6:.2f}M factor parameters")
    _common.stdout.print(
        f"trained {trained} for {last.step} steps ({last.tokens} tokens of {data}) in {last.seconds:.1f} s, "
        f"stopped by {stopped}; {options.loss} loss {result.mean_loss(first=True):.4f} → "
        f"{result.mean_loss(first=False):.4f} (mean of the first and last tenth of the steps)")
    if before and after:
        _common.stdout.print(
            f"perplexity {before.perplexity:.4f} → {after.perplexity:.4f} in onnxruntime on {after.tokens_scored} "
            f"held-out tokens ({after.windows} windows of {after.window})")
    _common.stdout.print(f"wrote {output} ({sum(seconds.values()):.1f} s in all)")
