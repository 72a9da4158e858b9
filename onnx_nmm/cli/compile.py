"""`onnx-nmm compile MODEL --target trn2 --batch B --seq-len S -o DIR`: lower a rewritten model for Trainium.

    fuse gated MLPs ─ lower to PyTorch ─ check against onnxruntime ─ plan a kernel per custom op
                    ─ torch_neuronx.trace (custom ops as @nki.jit kernels) ─ DIR: NEFF, TorchScript, manifest

Shapes are static on Neuron, so the batch and sequence length are fixed here. Without the Neuron SDK
every step up to the trace runs, then it stops with EXIT_NO_NEURON_SDK; --dry-run stops there on
purpose and writes the manifest. DIR is written to a temporary folder first and renamed when complete.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from rich.table import Table

from onnx_nmm import metrics, neuron, ort_runner, svd_ops
from onnx_nmm.cli import _common
from onnx_nmm.errors import UserError
from onnx_nmm.model_io import load_model
from onnx_nmm.passes import FuseGatedMlpPass

# A lowering error shows as a logits difference far above fp32 rounding (a 30-layer graph: ~1e-4).
LOWERING_ATOL_SCALE, LOWERING_RTOL = 1e-4, 1e-3


def register(subparsers) -> None:
    parser = subparsers.add_parser("compile", help="lower a rewritten model for Trainium: fused NKI kernels for the "
                                                   "SVD ops, torch-neuronx for the rest")
    parser.add_argument("model", help="a rewritten .onnx model (see `onnx-nmm rewrite`)")
    parser.add_argument("--target", choices=neuron.TARGETS, default="trn2", help="Trainium generation (default trn2)")
    parser.add_argument("--batch", type=int, default=1, help="static batch size (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="static sequence length (default 128)")
    parser.add_argument("-o", "--output", metavar="DIR", help="output folder (default: MODEL.neuron/)")
    parser.add_argument("--no-fuse-mlp", action="store_true", help="keep gated MLPs as three SvdMatMul kernels")
    parser.add_argument("--dry-run", action="store_true", help="stop before the trace: write the manifest only")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    parser.set_defaults(handler=run)


def run(args) -> int:
    if args.batch < 1 or args.seq_len < 1:
        raise UserError("--batch and --seq-len must be positive")
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".neuron")
    if output.exists() and any(output.iterdir()) and not args.force:
        raise UserError(f"{output} exists and is not empty; choose another -o or pass --force to replace it")
    model = load_model(source)
    fused = []
    if not args.no_fuse_mlp:
        fusion = FuseGatedMlpPass()
        fusion(model)
        fused = fusion.fused
    proto = ir.to_proto(model)
    onnx.load_external_data_for_model(proto, str(source.parent))  # untouched weights still live beside the input

    from onnx_nmm.kernels.nki_api import USING_EMULATOR
    from onnx_nmm.lowering import TorchMath, lower

    module = lower(proto, TorchMath())
    reference = ort_runner.create_session(source)
    inputs = ort_runner.random_inputs(reference, source, args.batch, args.seq_len, seed=0)
    check = _check_lowering(module, reference, inputs)
    kernels = neuron.plan_kernels(proto, args.batch * args.seq_len, args.target, model_costs=USING_EMULATOR)
    missing = [] if args.dry_run else neuron.missing_neuron_packages()
    if missing:
        raise UserError(neuron.missing_sdk_message(missing), exit_code=neuron.EXIT_NO_NEURON_SDK)

    manifest = {
        "model": str(source), "target": args.target, "batch": args.batch, "seq_len": args.seq_len,
        "inputs": [{"name": name, "shape": list(array.shape), "dtype": str(array.dtype)} for name, array in inputs.items()],
        "outputs": [{"name": o.name, "shape": check["shapes"][o.name]} for o in reference.get_outputs()],
        "fused_mlps": fused, "lowering_check": {k: v for k, v in check.items() if k != "shapes"},
        **kernels.to_dict(), "dry_run": args.dry_run,
    }
    with _staged_folder(output, args.force) as folder:
        if not args.dry_run:
            manifest.update(_trace(module, inputs, folder, args.target))
        _common.write_json(folder / "manifest.json", manifest)
    _print_summary(output, manifest, kernels)
    return 0


def _check_lowering(module, session, inputs: dict[str, np.ndarray]) -> dict:
    """Run the lowered module (custom ops as torch math) and onnxruntime on the same inputs."""
    import torch

    from onnx_nmm.lowering import call_lowered

    expected = ort_runner.run(session, inputs)
    result = call_lowered(module, *(torch.from_numpy(inputs[spec.name]) for spec in session.get_inputs()))
    actual = dict(zip(expected, result if isinstance(result, (tuple, list)) else (result,)))
    worst = {}
    for name, reference in expected.items():
        candidate = actual[name].numpy()
        comparison = metrics.compare(name, reference, candidate, atol=LOWERING_ATOL_SCALE * float(np.abs(reference).max()),
                                     rtol=LOWERING_RTOL)
        if comparison.mismatched:
            raise UserError(f"the lowered module differs from onnxruntime on output '{name}' (max |Δ| "
                            f"{comparison.max_abs:.3g}): a lowering bug, please report it with the model", exit_code=1)
        worst[name] = comparison.max_abs
    return {"max_abs": max(worst.values()), "against": "onnxruntime CPU",
            "shapes": {name: list(array.shape) for name, array in expected.items()}}


def _trace(module, inputs: dict[str, np.ndarray], folder: Path, target: str) -> dict:
    """The Neuron trace: custom ops on the @nki.jit kernels; NEFF and TorchScript into `folder`."""
    import torch

    from onnx_nmm.lowering import NeuronKernels, set_backend

    set_backend(module, NeuronKernels(target=target))
    example = tuple(torch.from_numpy(array) for array in inputs.values())
    traced = neuron.trace_for_neuron(module, example, folder / "compiler", target)
    torch.jit.save(traced, str(folder / "model.pt"))
    neffs = sorted(str(path.relative_to(folder)) for path in (folder / "compiler").rglob("*.neff"))
    return {"torchscript": "model.pt", "neff": neffs}


class _staged_folder:
    """A temporary sibling folder, renamed to `target` when the block succeeds (removed otherwise)."""

    def __init__(self, target: Path, force: bool):
        self.target, self.force = target, force

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=".onnx-nmm-", dir=self.target.parent))
        return self.folder

    def __exit__(self, kind, error, trace):
        if kind is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            return False
        if self.target.exists():
            shutil.rmtree(self.target)
        self.folder.rename(self.target)
        return False


def _print_summary(output: Path, manifest: dict, kernels: neuron.KernelSummary) -> None:
    table = Table(title=f"Kernels for {manifest['target']} at {manifest['batch']}×{manifest['seq_len']} tokens"
                  + (" (times modelled)" if kernels.modelled else ""), title_justify="left")
    for column in ("kernel", "nodes", "dims", "plan", "modelled µs", "dense µs (modelled)"):
        table.add_column(column)
    groups: dict[tuple, list] = {}
    for entry in kernels.entries:
        groups.setdefault((entry.kernel, tuple(entry.dims.items()), tuple(entry.plan.items())), []).append(entry)
    for (kernel, dims, plan), entries in groups.items():
        first = entries[0]
        table.add_row(kernel, str(len(entries)), " ".join(f"{k}={v}" for k, v in dims),
                      " ".join(f"{k}={v}" for k, v in plan),
                      f"{first.modelled_us:,.1f}" if first.modelled_us is not None else "—",
                      f"{first.modelled_dense_us:,.1f}" if first.modelled_dense_us is not None else "—")
    _common.stdout.print(table)
    totals = manifest.get("modelled_us"), manifest.get("modelled_dense_us")
    if totals[0] is not None:
        _common.stdout.print(f"modelled on {manifest['target']}: SVD kernels {totals[0]:,.1f} µs vs the same layers dense "
                             f"{totals[1]:,.1f} µs ({totals[1] / totals[0]:.2f}×)")
    _common.stdout.print(f"lowering check against onnxruntime: max |Δ| {manifest['lowering_check']['max_abs']:.2e}; "
                         f"{len(manifest['fused_mlps'])} gated MLPs fused. "
                         + ("Dry run: no trace. " if manifest["dry_run"] else f"NEFF: {', '.join(manifest['neff'])}. ")
                         + f"Wrote {output}/")
