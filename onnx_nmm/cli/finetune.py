"""`onnx-nmm finetune REWRITTEN --text FILE --tokenizer T -o OUT`: train the SVD factors and narrowed MLP
weights, write them back (onnx_nmm.finetune)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common, _parsing
from onnx_nmm.model_io import check_new_output
from onnx_nmm.training.finetuning import too_large_to_finetune_whole  # what finetune decides by, said first
from onnx_nmm.training.schedule import LOSSES


def register(subparsers) -> None:
    T, D = onnx_nmm.TrainingOptions, onnx_nmm.TrainingData
    default = _common.default
    parser = subparsers.add_parser("finetune", help="train a rewritten model's SVD factors and narrowed MLP weights "
                                                    "(CPU, PyTorch) and write them back into the ONNX model")
    parser.add_argument("model", help="a model written by `onnx-nmm rewrite` (float32)")
    parser.add_argument("-o", "--output", help="where to write the tuned model (default: MODEL.tuned.onnx)")
    parser.add_argument("--force", action="store_true",
                        help=_common.force_help("-o file (even the input model itself), --report or --plot file"))
    data = parser.add_argument_group("training data (rewrite's --calib, --calib-generator, --calib-samples and "
                                     "--calib-window spellings work too)")
    data.add_argument("--text", "--calib", dest="text", metavar="SOURCE", action="append",
                      help="a UTF-8 text file (with --tokenizer), an .npz with input_ids [samples, seq_len], or "
                           "'generated[:N]' (N windows sampled from the dense model, default 64); repeat to mix "
                           f"(default {D.text}: text the model writes itself teaches no corpus's style)")
    data.add_argument("--prompts", metavar="FILE",
                      help="a text whose passages the dense model continues into --prompted more generated windows "
                           "(default: the calibration text the rewrite recorded, when no --text is given)")
    data.add_argument("--prompted", type=int, metavar="N",
                      help=f"windows continuing passages of --prompts (default {default(D, 'prompted')}; 0: none)")
    data.add_argument("--generator", "--calib-generator", dest="generator", metavar="MODEL.onnx",
                      help="sample generated windows from this export of the dense model (e.g. one with a KV cache, "
                           "much faster) instead of the teacher")
    data.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or a .gguf file, for text")
    window = data.add_argument("--train-window", "--calib-window", dest="seq_len", type=int, metavar="TOKENS",
                               help="tokens per training window, cut from the text (default "
                                    f"{default(D, 'seq_len')}; an .npz sets its own; formerly --seq-len)")
    _parsing.add_former_name(data, "--seq-len", window)
    data.add_argument("--samples", "--calib-samples", dest="samples", type=int,
                      help="use only the first N windows (default: all of them)")
    _common.add_bos_option(data)
    training = parser.add_argument_group("training")
    training.add_argument("--loss", choices=LOSSES,
                          help="distill (default): KL(teacher ‖ student) of the next-token distributions, which keeps "
                               "the dense model's general behaviour; next-token: cross-entropy on the text, which "
                               "also learns the text's style")
    training.add_argument("--teacher", metavar="ORIGINAL.onnx",
                          help="the dense model to distil from, run in onnxruntime (default: the one the rewrite "
                               "recorded in the model)")
    temperature = training.add_argument("--distill-temperature", dest="temperature", type=float, metavar="T",
                                        help="temperature of the teacher's and the student's softmax in the "
                                             f"distillation loss (default {default(T, 'temperature')}; formerly "
                                             "--temperature, which in generate means sampling)")
    _parsing.add_former_name(training, "--temperature", temperature)
    training.add_argument("--steps", type=int, help=f"optimizer steps at most (default {default(T, 'steps')})")
    budget = training.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, metavar="M",
                        help="stop training before it would run longer than M minutes (sampling, lowering, "
                             "evaluation and writing come on top); the first of --steps and --minutes ends training")
    budget.add_argument("--time-budget", type=float, metavar="SECONDS", help="--minutes, in seconds")
    training.add_argument("--lr", type=float,
                          help="peak AdamW learning rate, cosine-decayed to a tenth over the budget (default "
                               f"{default(T, 'learning_rate'):g}; adapters want more, e.g. 1e-3)")
    training.add_argument("--batch", type=int, help=f"windows per step (default {default(T, 'batch')})")
    training.add_argument("--adapters", type=int, metavar="RANK",
                          help="train LoRA adapters of this rank on every U and V (merged back before writing) "
                               "instead of U and V themselves")
    training.add_argument("--max-grad-norm", type=float,
                          help=f"clip the gradient to this global norm (default {default(T, 'max_grad_norm')})")
    training.add_argument("--seed", type=int, help="seed of the window order and the adapters (default "
                                                   f"{default(T, 'seed')})")
    whole = training.add_mutually_exclusive_group()
    whole.add_argument("--layer-by-layer", action="store_true",
                       help="tune one decoder layer at a time to the dense layer's outputs (the cut of the layer-wise "
                            "rewrite), never holding the model twice: --steps per layer, --minutes shared by the "
                            "layers; resumable from OUT.partial/ after a kill (default: when the whole model would "
                            "not fit in memory, which is said in one line)")
    whole.add_argument("--whole-model", action="store_true",
                       help="train the whole model on its logits even when it looks too large for memory")
    training.add_argument("--device", metavar="DEVICE",
                          help="the torch device to train on: cpu (default), cuda, cuda:N, mps; the trained weights "
                               "come back to the CPU to be written")
    training.add_argument("--threads", type=int,
                          help="PyTorch CPU threads (default: PyTorch's, one per core); 1 is much faster on a "
                               "machine whose cores other jobs keep busy")
    evaluation = parser.add_argument_group("evaluation (held-out text, onnxruntime)")
    evaluation.add_argument("--eval-text", metavar="FILE",
                            help="perplexity of the model before and after, on this text (with --tokenizer) or "
                                 "the input_ids of this .npz read as one sequence")
    evaluation.add_argument("--eval-window", type=int, help="tokens per perplexity window (default: --train-window)")
    evaluation.add_argument("--eval-windows", type=int, default=16, help="disjoint windows to score (default 16)")
    parser.add_argument("--save-at", metavar="STEP,STEP", type=_steps,
                        help="also write the model trained so far at these steps, as OUT.stepN.onnx beside -o (a "
                             "curve of quality against steps from one run)")
    parser.add_argument("--report", metavar="FILE.json", help="write the loss curve and the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the loss curve")
    parser.add_argument("--quiet", action="store_true", help=_common.quiet_help("summary"))
    parser.set_defaults(handler=run, flags={"window": "--eval-window", "max_windows": "--eval-windows",
                                            "data.seq_len": "--train-window", "data.samples": "--samples",
                                            "training.temperature": "--distill-temperature",
                                            "checkpoints": "--save-at"})


def run(args) -> int:
    text = _common.calibration_sources(args.text or [onnx_nmm.TrainingData.text], args.generator,
                                        ("--text", "--generator"))
    data = onnx_nmm.TrainingData(**_common.given(text=text, tokenizer=args.tokenizer, seq_len=args.seq_len,
                                                 samples=args.samples, bos=False if args.no_bos else None,
                                                 prompts=args.prompts, prompted=args.prompted))
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".tuned.onnx")
    options = finetune_options(args, checkpoint_paths(output, args.save_at or ()), output)
    if options.layer_by_layer is None:  # decided here to say so in one line, as the rewrite does
        data.check()  # a bad text or tokenizer is said before the model loads to be weighed
        if options.evaluation is not None:
            options.evaluation.check()
        reason = too_large_to_finetune_whole(source) if source.is_file() else None
        if reason is not None:
            _common.stderr.print(reason, soft_wrap=True)
        options = replace(options, layer_by_layer=reason is not None)
    for checkpoint in options.checkpoints.values():
        check_new_output(Path(checkpoint), args.force)
    onnx_nmm.check_output_path(source, output, args.force)  # before the long work, not after
    check_new_output(output, args.force)
    _common.refuse_existing(args, "--report", "--plot")
    with _common.progress(args.quiet) as progress:
        result = onnx_nmm.finetune(source, data, options, progress)
        with progress.phase("writing"):
            result.save(output, overwrite_input=args.force)
    if result.loss_rose:  # said even with --quiet
        training = result.training
        _common.stderr.print(f"warning: the {result.loss} loss rose during training "
                             f"({training.mean_loss(first=True):.4f} → {training.mean_loss(first=False):.4f}); the "
                             f"tuned model is likely worse than its input: try a lower --lr (this run: "
                             f"{options.training.learning_rate:g})")
    if args.plot:
        from onnx_nmm.plots.finetune import plot_loss_curve

        assert result.loss is not None, "finetune decides the loss before it trains"
        plot_loss_curve(result.training, args.plot, _plot_title(source, options, result, args.eval_text),
                        result.loss)
    if args.report:
        _common.write_json(args.report, {"input": str(source), "output": str(output),
                                         "eval_text": args.eval_text, **result.to_dict(options)})
    if not args.quiet:
        _print_summary(result, options, output)
    return 0


def checkpoint_paths(output: Path, steps) -> dict[int, Path]:
    """Where --save-at writes each step's model: OUT.stepN.onnx beside OUT."""
    return {step: output.with_name(f"{output.stem}.step{step}{output.suffix}") for step in steps}


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(step) for step in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give steps as STEP,STEP,... (e.g. 50,100,200)") from None
    if any(step < 1 for step in steps):
        raise argparse.ArgumentTypeError(f"{text}: steps are positive")
    return steps


def finetune_options(args, checkpoints: dict[int, Path] | None = None,
                     output: Path | None = None) -> onnx_nmm.FinetuneOptions:
    if args.minutes is not None and not args.minutes > 0:
        raise onnx_nmm.OptionError(f"--minutes must be positive, got {args.minutes:g}")
    training = onnx_nmm.TrainingOptions(**_common.given(
        steps=args.steps, time_budget=args.minutes * 60 if args.minutes is not None else args.time_budget,
        learning_rate=args.lr, batch=args.batch, loss=args.loss,
        temperature=args.temperature, adapter_rank=args.adapters, max_grad_norm=args.max_grad_norm, seed=args.seed))
    evaluation = None
    if args.eval_text:
        evaluation = onnx_nmm.TextOptions(args.eval_text, args.tokenizer, window=args.eval_window,
                                          max_windows=args.eval_windows, bos=not args.no_bos)
    layer_by_layer = True if args.layer_by_layer else False if args.whole_model else None
    return onnx_nmm.FinetuneOptions(training, args.teacher, evaluation, args.threads, dict(checkpoints or {}),
                                    **_common.given(device=args.device), layer_by_layer=layer_by_layer, output=output)


def _plot_title(source: Path, options: onnx_nmm.FinetuneOptions, result: onnx_nmm.FinetuneResult,
                eval_text: str | None) -> str:
    training, records = options.training, result.training.records
    title = (f"{source.name}: {result.loss} loss, {records[-1].step} steps of {result.data}, lr "
             f"{training.learning_rate:g}"
             + (f", adapters of rank {training.adapter_rank}" if training.adapter_rank else ""))
    if result.before and result.after:
        assert eval_text is not None, "the perplexities are measured on the eval text"
        title += (f"\nperplexity {result.before.perplexity:.3f} → {result.after.perplexity:.3f} on "
                  f"{Path(eval_text).name} (held out)")
    return title


def _print_summary(result: onnx_nmm.FinetuneResult, options: onnx_nmm.FinetuneOptions, output: Path) -> None:
    training, last = options.training, result.training.records[-1]
    stopped = "the time budget" if result.training.stopped_by == "time" else "the step budget"
    trainable = result.training.trainable_parameters / 1e6
    trained = (f"adapters of rank {training.adapter_rank} ({trainable:.2f}M parameters) on the factors"
               if training.adapter_rank else f"{trainable:.2f}M parameters (SVD factors and narrowed weights)")
    if result.layers:
        tuned = [layer for layer in result.layers if layer.steps]
        before = sum(layer.error_before for layer in tuned) / len(tuned)
        after = sum(layer.error_after for layer in tuned) / len(tuned)
        _common.stdout.print(
            f"tuned {len(tuned)} layers one at a time, {trained}, {last.step} steps in all (a step: one layer on "
            f"{training.batch} windows of {result.data}) in {last.seconds:.1f} s; {_loss_words(result)} "
            f"{before:.4g} → {after:.4g} (mean over the layers)")
    else:
        _common.stdout.print(
            f"trained {trained} for {last.step} steps ({last.tokens} tokens of {result.data}) in {last.seconds:.1f} "
            f"s, stopped by {stopped}; {_loss_words(result)} {result.training.mean_loss(first=True):.4f} → "
            f"{result.training.mean_loss(first=False):.4f} (mean of the first and last tenth of the steps)")
    if result.before and result.after:
        _common.stdout.print(
            f"perplexity {result.before.perplexity:.4f} → {result.after.perplexity:.4f} in onnxruntime on "
            f"{result.after.tokens_scored} held-out tokens ({result.after.windows} windows of {result.after.window})")
    _common.stdout.print(f"wrote {output} ({sum(result.seconds.values()):.1f} s in all)")


def _loss_words(result: onnx_nmm.FinetuneResult) -> str:
    if result.layers:
        return f"relative error of each layer's output to the dense {result.teacher}'s"
    if result.loss == "distill":
        return f"distillation loss (KL to the dense {result.teacher})"
    return "next-token loss (learns the training text, its style included)"
