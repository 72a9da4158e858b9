"""`onnx-nmm compile MODEL --target trn2 --batch B --trace-tokens S -o DIR`: lower a rewritten model for Trainium
(onnx_nmm.compile); with `--max-context N [--buckets 128,512]`, a model that generates: prefill graphs per bucket
and a decode step over a KV cache of N positions."""

from __future__ import annotations

import shlex
from pathlib import Path

import onnx_nmm
from onnx_nmm.cli import _common, _parsing


def register(subparsers) -> None:
    C = onnx_nmm.CompileOptions
    parser = subparsers.add_parser("compile", help="lower a model for Trainium: fused NKI kernels for its MLPs "
                                                   "(narrowed, factorized or dense) and SvdMatMul ops, torch-neuronx "
                                                   "for the rest")
    parser.add_argument("model", help="a rewritten .onnx model (see `onnx-nmm rewrite`)")
    parser.add_argument("--target", choices=("trn1", "trn2"),
                        help=_common.target_help(f"to compile for (default {_common.default(C, 'target')})"))
    parser.add_argument("--batch", type=int, help=f"static batch size (default {_common.default(C, 'batch')})")
    tokens = parser.add_argument("--trace-tokens", dest="seq_len", type=int, metavar="N",
                                 help="tokens per sequence of the one static graph traced without --max-context "
                                      f"(default {_common.default(C, 'seq_len')}, a prompt bucket Neuron often uses; "
                                      "with --max-context, --buckets instead; formerly --seq-len)")
    _parsing.add_former_name(parser, "--seq-len", tokens)
    parser.add_argument("--max-context", type=int, metavar="N",
                        help="compile a model that generates: prefill graphs per prompt bucket and one decode step "
                             "over a KV cache of N positions (the model needs a KV cache); `onnx-nmm generate DIR` "
                             "runs the folder")
    parser.add_argument("--buckets", type=_common.token_counts, metavar="N,N",
                        help="prompt lengths a prefill is compiled for (default: 128, 512, 2048 below "
                             "--max-context, and --max-context)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="with --max-context: split the model over N NeuronCores as NxD Inference splits it "
                             "(q/k/v, gate/up column-parallel; o, down row-parallel then an all-reduce; heads and KV "
                             "cache by head): N rank programs per graph, joined by collectives, traced with "
                             "neuronx-distributed for `generate DIR --backend neuron`; with --dry-run, not traced "
                             "(`generate DIR --backend torch` runs them on the CPU either way) (default 1)")
    parser.add_argument("-o", "--output", metavar="DIR", help="output folder (default: MODEL.neuron/)")
    parser.add_argument("--no-fuse-mlp", action="store_true", help="keep MLPs as one SvdMatMul kernel per projection")
    parser.add_argument("--dry-run", action="store_true", help="stop before the trace: write the manifest only")
    parser.add_argument("--force", action="store_true",
                        help=_common.force_help("-o folder (a file there is refused even so)"))
    parser.set_defaults(handler=run, flags={"seq_len": "--trace-tokens"})


def run(args) -> int:
    options = onnx_nmm.CompileOptions(**_common.given(target=args.target, batch=args.batch, seq_len=args.seq_len,
                                                      fuse_mlp=False if args.no_fuse_mlp else None,
                                                      dry_run=args.dry_run or None, max_context=args.max_context,
                                                      buckets=args.buckets, tp=args.tp))
    source = Path(args.model)
    output = Path(args.output) if args.output else source.with_name(source.stem + ".neuron")
    with _common.progress() as progress:
        compilation = onnx_nmm.compile(source, output, options, overwrite=args.force, progress=progress)
    _print_summary(compilation)
    return 0


def _print_summary(compilation: onnx_nmm.Compilation) -> None:
    if compilation.graphs:
        _print_graphs(compilation)
        return
    manifest, kernels = compilation.manifest, compilation.kernels
    table = _common.Table(title=f"Kernels for {manifest['target']} at {manifest['batch']}×{manifest['seq_len']} tokens"
                  + (" (times modelled)" if kernels.modelled else ""), title_justify="left")
    for column in ("kernel", "nodes", "dims", "plan", "modelled µs", "best dense µs (modelled)"):
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
    if kernels.entries:
        _common.stdout.print(table)
    else:
        _common.stdout.print("no ai.onnx_nmm op, so nothing for the NKI kernels: rewrite the model first (a "
                             "quantized one with --factor-dtype float16: quantized factors stay onnxruntime ops)")
    totals = manifest.get("modelled_us"), manifest.get("modelled_dense_us")
    if totals[0] is not None:
        _common.stdout.print(f"modelled on {manifest['target']}: the kernels {totals[0]:,.1f} µs vs the same layers "
                             f"on their fastest dense path {totals[1]:,.1f} µs ({totals[1] / totals[0]:.2f}×)")
    if manifest["first_step_only"]:
        _common.stdout.print("a merged decoder: its first-step branch (the prefill over an empty cache) is what was "
                             "lowered")
    chosen = manifest["mlp_kernels"] if isinstance(manifest["mlp_kernels"], list) else []
    separate = sum(1 for choice in chosen if not choice["fused"])
    _common.stdout.print(f"lowering check against onnxruntime: max |Δ| {manifest['lowering_check']['max_abs']:.2e}; "
                         f"{len(manifest['fused_mlps'])} MLPs fused"
                         + (f", {separate} left as their projections, faster at this shape (modelled)" if separate
                            else "") + ". "
                         + ("Dry run: no trace. " if manifest["dry_run"] else f"NEFF: {', '.join(manifest['neff'])}. ")
                         + f"Wrote {compilation.folder}/")


def _print_graphs(compilation: onnx_nmm.Compilation) -> None:
    """A model that generates: one row per graph, its MLP kernels and modelled times."""
    manifest = compilation.manifest
    tp = manifest.get("tp", 1)
    split = f", split over {tp} NeuronCores ({manifest['sharding']['note']})" if tp > 1 else ""
    table = _common.Table(title=f"Graphs for {manifest['target']}, batch {manifest['batch']}, a cache of "
                                f"{manifest['max_context']} positions{split}", title_justify="left")
    for column in ("graph", "tokens", "custom ops", "MLPs fused", "MLPs as projections", "modelled µs",
                   "best dense µs (modelled)", *(("rank programs", "collectives") if tp > 1 else ())):
        table.add_column(column)
    for graph in manifest["graphs"]:
        chosen = graph["mlp_kernels"] if isinstance(graph["mlp_kernels"], list) else []
        times = graph.get("modelled_us"), graph.get("modelled_dense_us")
        table.add_row(graph["name"], str(graph["tokens"]), str(len(graph["kernels"])), str(len(graph["fused_mlps"])),
                      str(sum(1 for choice in chosen if not choice["fused"])),
                      *(f"{time:,.1f}" if time is not None else "—" for time in times),
                      *((str(len(graph["ranks"])), _collectives(graph["collectives"])) if tp > 1 else ()))
    _common.stdout.print(table)
    worst = max(graph["lowering_check"]["max_abs"] for graph in manifest["graphs"])
    _common.stdout.print(f"lowering check against onnxruntime: max |Δ| {worst:.2e} over every graph. "
                         + ("Traced: " + ", ".join(dict.fromkeys(graph["torchscript"] for graph in manifest["graphs"]))
                            + ". "
                            if manifest["traced"] else "Dry run: no trace. ")
                         + f"Wrote {compilation.folder}/; run it with: "
                         + _generate_command(compilation.folder, manifest),
                         soft_wrap=True)


def _collectives(joins: list[dict]) -> str:
    """"60 AllReduce, 2 AllGather": the collectives joining a graph's rank programs."""
    counts: dict[str, int] = {}
    for join in joins:
        counts[join["op"]] = counts.get(join["op"], 0) + 1
    return ", ".join(f"{count} {op}" for op, count in counts.items())


def _generate_command(folder: Path, manifest: dict) -> str:
    """`generate` on the compiled folder as it can be typed; with --tokenizer to fill in when the folder holds no
    tokenizer (none was beside the model to copy). Rank programs (a tp above 1) run on the NeuronCores once traced,
    on the CPU lowered to PyTorch before (onnxruntime cannot run their collectives)."""
    prompt = shlex.quote("Why is the sky blue?")
    backend = (f" --backend {'neuron' if manifest['traced'] else 'torch'}" if manifest.get("tp", 1) > 1 else "")
    if onnx_nmm.is_tokenizer_folder(folder):
        return f"onnx-nmm generate {shlex.quote(str(folder))} --prompt {prompt}{backend}"
    return (f"onnx-nmm generate {shlex.quote(str(folder))} --tokenizer TOKENIZER --prompt {prompt}{backend}, "
            "TOKENIZER being the model's tokenizer folder or .gguf file (none was beside the model to copy into the "
            "folder)")
