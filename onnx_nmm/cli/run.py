"""`onnx-nmm run MODEL --backend ort|torch|emulator`: one forward pass, on the backend of your choice
(onnx_nmm.run_model)."""

from __future__ import annotations

from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common, _parsing
from onnx_nmm.model_io import check_new_output


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run a model once on onnxruntime, its PyTorch lowering, or the "
                                               "NKI kernels on the emulator")
    parser.add_argument("model", help="an .onnx model (original or rewritten)")
    parser.add_argument("--backend", choices=onnx_nmm.RUN_BACKENDS, default="ort",
                        help="ort: onnxruntime; torch: the PyTorch lowering, custom ops as torch math; emulator: the "
                             "lowering with the custom ops on the NKI kernels, emulated in bfloat16")
    parser.add_argument("--target", choices=("trn1", "trn2"), default="trn2", help=_common.EMULATED_TARGET)
    parser.add_argument("--inputs", metavar="FILE.npz", help="inputs (keys = input names); default: random token ids")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the random token ids (default 1)")
    tokens = parser.add_argument("--tokens", dest="seq_len", type=int, default=16, metavar="N",
                                 help="tokens per sequence of the random token ids (default %(default)s: one quick "
                                      "forward pass; formerly --seq-len)")
    _parsing.add_former_name(parser, "--seq-len", tokens)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    parser.add_argument("-o", "--output", metavar="FILE.npz", help="save the outputs")
    parser.add_argument("--force", action="store_true", help=_common.force_help("-o file"))
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run, flags={"seq_len": "--tokens"})


def run(args) -> int:
    if args.output:
        _refuse_output(Path(args.output), args.force)  # before the run, not after
    result = onnx_nmm.run_model(args.model, args.inputs, args.backend, args.target, args.batch, args.seq_len,
                                args.seed)
    if args.output:
        result.save(args.output)
    summary = {name: {"shape": list(array.shape), "dtype": str(array.dtype),
                      "min": float(array.min()), "max": float(array.max()), "mean": float(array.mean())}
               for name, array in result.outputs.items()}
    calls = [{"node": call.node, "kernel": call.kernel, "shapes": [list(s) for s in call.shapes]}
             for call in result.kernel_calls]
    if args.json:
        _common.print_json({"model": args.model, "backend": args.backend, "outputs": summary, "kernel_calls": calls})
        return 0
    table = _common.Table(title=f"{args.model} on {args.backend}", title_justify="left")
    for column in ("output", "shape", "dtype", "min", "max", "mean"):
        table.add_column(column)
    for name, info in summary.items():
        table.add_row(name, str(info["shape"]), str(info["dtype"]), f"{info['min']:.4g}", f"{info['max']:.4g}",
                      f"{info['mean']:.4g}")
    _common.stdout.print(table)
    if calls:
        kernels = sorted({call["kernel"] for call in calls})
        _common.stdout.print(f"{len(calls)} kernel launches on the emulator ({', '.join(kernels)})")
    return 0


def _refuse_output(output: Path, force: bool) -> None:
    """-o names a file: a folder is refused, and a file that exists unless --force."""
    if output.is_dir():
        raise onnx_nmm.OutputError(f"{output} is a folder: give {{output}} a file name in it, e.g. "
                                   f"{output / 'outputs.npz'}", output="output")
    check_new_output(output, force)
