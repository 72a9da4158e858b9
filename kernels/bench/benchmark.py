"""Modelled benchmark of the kernels on the MLPs of four small LLMs: dense vs low-rank.

For each model, token count and target, five ways to run one gated MLP
y = (silu(x·Wg) * (x·Wu)) · Wd, each W of K×N replaced by U [K, r] · V [r, N] in the low-rank ones:

  dense      dense_matmul for gate and up, silu_mul between, dense_matmul for down (4 launches); above 128
             tokens silu_mul_transposed and dense_matmul_lhsT instead (gated_activation.leaves_transposed)
  dense_mlp  dense_gated_mlp, the dense weights in one fused kernel (1 launch)
  unfused    lowrank_unfused (2 dense launches) per projection, silu_mul between (7 launches)
  fused_xuv  fused_xuv per projection, silu_mul between (4 launches)
  fused_mlp  fused_svd_mlp (1 launch)

The low-rank variants are set against the best dense path: the faster of the two dense ones. Every time and
byte count is the cost model's (modelled), from trace-only emulation: nothing is computed.
Each time is also set against its roofline, the physical limit of the launches: per launch the larger of
its HBM bytes at the NeuronCore's memory bandwidth and its FLOPs at TensorE's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from onnx_nmm.kernels.emulator import Placeholder, emulation
from onnx_nmm.kernels.nki_kernels.dense_matmul import dense_matmul, dense_matmul_lhsT
from onnx_nmm.kernels.nki_kernels.dense_mlp import dense_gated_mlp
from onnx_nmm.kernels.nki_kernels.fused_mlp import fused_svd_mlp
from onnx_nmm.kernels.nki_kernels.fused_xuv import fused_xuv
from onnx_nmm.kernels.nki_kernels.gated_activation import leaves_transposed, silu_mul, silu_mul_transposed
from onnx_nmm.kernels.nki_kernels.lowrank_unfused import lowrank_unfused
from onnx_nmm.kernels.pricing.cost_model import KernelCost, model_trace
from onnx_nmm.kernels.pricing.hardware import TRAINIUM_TARGETS


@dataclass(frozen=True)
class MlpShape:
    model: str
    hidden: int
    intermediate: int
    rank: int  # of gate, up and down alike

    @property
    def parameter_ratio(self) -> float:
        """Dense parameters over low-rank parameters of the MLP."""
        return self.hidden * self.intermediate / (self.rank * (self.hidden + self.intermediate))


MODELS = (
    MlpShape("Llama-3.2-1B", 2048, 8192, 1280),
    MlpShape("Llama-3.2-3B", 3072, 8192, 1792),
    MlpShape("Qwen3-1.7B", 2048, 6144, 1280),
    MlpShape("Qwen3-4B", 2560, 9728, 1664),
)
TOKENS = (1, 32, 128, 512, 2048, 8192)
VARIANTS = ("dense", "dense_mlp", "unfused", "fused_xuv", "fused_mlp")
DENSE_PATHS = ("dense", "dense_mlp")
PROJECTIONS = ("gate", "up", "down")
XUV_BAR = 1.35  # NeuronMM's kernel-level average speed-up
ROOFLINE_GOAL = 1.25  # fused XUV and fused MLP within this factor of their roofline at every grid point
DENSE_ROOFLINE_GOAL = 1.10  # the best dense path, so that no speed-up leans on a slow baseline


def dense_mlp(x, wg, wu, wd):
    gate = dense_matmul(x, wg)
    up = dense_matmul(x, wu)
    if leaves_transposed(x.shape[0]):
        return dense_matmul_lhsT(silu_mul_transposed(gate, up), wd)
    return dense_matmul(silu_mul(gate, up), wd)


def unfused_mlp(x, ug, vg, uu, vu, ud, vd):
    gate = lowrank_unfused(x, ug, vg)
    up = lowrank_unfused(x, uu, vu)
    return lowrank_unfused(silu_mul(gate, up), ud, vd)


def xuv_mlp(x, ug, vg, uu, vu, ud, vd):
    gate = fused_xuv(x, ug, vg)
    up = fused_xuv(x, uu, vu)
    return fused_xuv(silu_mul(gate, up), ud, vd)


PROGRAMS = {"dense": dense_mlp, "dense_mlp": dense_gated_mlp, "unfused": unfused_mlp, "fused_xuv": xuv_mlp,
            "fused_mlp": fused_svd_mlp}
# Which launches of the unfused and fused-XUV programs compute each projection (in launch order).
PROJECTION_LAUNCHES = {
    "unfused": {"gate": (0, 1), "up": (2, 3), "down": (5, 6)},
    "fused_xuv": {"gate": (0,), "up": (1,), "down": (3,)},
}


@dataclass
class BenchmarkRow:
    shape: MlpShape
    tokens: int
    target: str
    costs: dict[str, KernelCost]  # per variant, all launches
    launches: dict[str, list[KernelCost]] = field(repr=False)  # per variant, one cost per launch

    def seconds(self, variant: str) -> float:
        return self.costs[variant].total_s

    def speedup(self, baseline: str, variant: str) -> float:
        return self.seconds(baseline) / self.seconds(variant)

    @property
    def best_dense(self) -> str:
        """The faster dense path: every low-rank variant's speed-up is against it."""
        return min(DENSE_PATHS, key=self.seconds)

    def projection_seconds(self, variant: str, projection: str) -> float:
        return sum(self.launches[variant][i].total_s for i in PROJECTION_LAUNCHES[variant][projection])

    def over_roofline(self, variant: str) -> float:
        """The variant's modelled time over its roofline (all launches)."""
        return self.costs[variant].over_roofline

    def xuv_kernels_over_roofline(self) -> list[float]:
        """Each fused_xuv launch (one per projection) over its own roofline."""
        return [self.launches["fused_xuv"][i].over_roofline
                for p in PROJECTIONS for i in PROJECTION_LAUNCHES["fused_xuv"][p]]

    def dense_kernels_over_roofline(self) -> list[tuple[str, float]]:
        """(kernel, time / roofline) of every dense kernel launch of the dense paths (silu_mul aside)."""
        return [(kernel, ratio) for _, _, kernel, ratio in self.dense_launches()]

    def dense_launches(self) -> list[tuple[str, int, str, float]]:
        """(variant, launch index, kernel, time / roofline) of every dense kernel launch of the dense paths."""
        return [(variant, i, cost.kernels[0], cost.over_roofline) for variant in DENSE_PATHS
                for i, cost in enumerate(self.launches[variant]) if cost.kernels[0].startswith("dense_")]

    def fused_kernels_over_roofline(self) -> float:
        """The worst of the fused kernels' launches (fused_xuv and fused_svd_mlp) against the roofline."""
        return max(self.xuv_kernels_over_roofline() + [self.over_roofline("fused_mlp")])

    def xuv_kernel_speedups(self) -> list[float]:
        """fused_xuv over lowrank_unfused for each projection: the kernel-level comparison."""
        return [self.projection_seconds("unfused", p) / self.projection_seconds("fused_xuv", p) for p in PROJECTIONS]

    def xuv_vs_dense_kernel_speedups(self) -> list[float]:
        """fused_xuv over dense_matmul for each projection (launches 0, 1 and 3 of the dense program)."""
        dense = [self.launches["dense"][i].total_s for i in (0, 1, 3)]
        return [d / self.projection_seconds("fused_xuv", p) for d, p in zip(dense, PROJECTIONS)]


def mlp_shapes(shape: MlpShape, tokens: int, variant: str) -> list[tuple[int, int]]:
    H, I, r = shape.hidden, shape.intermediate, shape.rank
    if variant in DENSE_PATHS:
        return [(tokens, H), (H, I), (H, I), (I, H)]
    return [(tokens, H), (H, r), (r, I), (H, r), (r, I), (I, r), (r, H)]


def launch_costs(variant: str, shape: MlpShape, tokens: int, target: str, dtype: str) -> list[KernelCost]:
    """Modelled cost of each kernel launch of one variant, in launch order (trace-only emulation)."""
    with emulation(target, trace_only=True) as session:
        PROGRAMS[variant](*(Placeholder(s, dtype) for s in mlp_shapes(shape, tokens, variant)))
    return [model_trace(trace, target) for trace in session.traces]


def run_benchmark(models=MODELS, tokens=TOKENS, targets=TRAINIUM_TARGETS, dtype="bfloat16",
                  on_row=None) -> list[BenchmarkRow]:
    """Every (model, tokens, target) of the grid; `on_row(row)` is called as each one is done."""
    rows = []
    for target in targets:
        for shape in models:
            for count in tokens:
                launches = {v: launch_costs(v, shape, count, target, dtype) for v in VARIANTS}
                costs = {v: _sequence(launches[v]) for v in VARIANTS}
                row = BenchmarkRow(shape, count, target, costs, launches)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def summarize(rows: list[BenchmarkRow]) -> dict:
    """The two bars and the averages behind them."""
    kernel = [s for row in rows for s in row.xuv_kernel_speedups()]
    versus_dense = [s for row in rows for s in row.xuv_vs_dense_kernel_speedups()]
    mlp = [row.speedup("unfused", "fused_xuv") for row in rows]
    decode = [
        {
            "model": row.shape.model,
            "target": row.target,
            "fused_mlp_vs_dense": row.speedup(row.best_dense, "fused_mlp"),
            "parameter_ratio": row.shape.parameter_ratio,
            "met": row.speedup(row.best_dense, "fused_mlp") >= row.shape.parameter_ratio,
        }
        for row in rows
        if row.tokens == 1
    ]
    fused = [row.fused_kernels_over_roofline() for row in rows]
    dense_kernels = [launch for row in rows for launch in row.dense_kernels_over_roofline()]
    return {
        "dense_kernels_over_roofline_max": {kernel: max(r for k, r in dense_kernels if k == kernel)
                                            for kernel in sorted({k for k, _ in dense_kernels})},
        "dense_kernels_within_goal": [sum(r <= DENSE_ROOFLINE_GOAL for _, r in dense_kernels), len(dense_kernels)],
        "dense_kernels_over_goal": [
            {"target": row.target, "model": row.shape.model, "tokens": row.tokens, "variant": variant,
             "launch": i, "kernel": kernel, "over_roofline": ratio}
            for row in rows for variant, i, kernel, ratio in row.dense_launches() if ratio > DENSE_ROOFLINE_GOAL
        ],
        "roofline_goal": ROOFLINE_GOAL,
        "over_roofline_max": {v: max(row.over_roofline(v) for row in rows) for v in VARIANTS},
        "best_dense_over_roofline_max": max(row.over_roofline(row.best_dense) for row in rows),
        "dense_roofline_goal": DENSE_ROOFLINE_GOAL,
        "fused_kernels_over_roofline_max": max(fused),
        "roofline_goal_met": max(fused) <= ROOFLINE_GOAL,
        "xuv_vs_unfused_kernel_mean": _mean(kernel),
        "xuv_vs_unfused_kernel_geomean": _geomean(kernel),
        "xuv_vs_unfused_kernel_range": [min(kernel), max(kernel)] if kernel else [],
        "xuv_vs_unfused_mlp_mean": _mean(mlp),
        "xuv_vs_dense_kernel_mean": _mean(versus_dense),
        "xuv_bar": XUV_BAR,
        "xuv_bar_met": _mean(kernel) >= XUV_BAR,
        "decode": decode,
        "decode_bar_met": bool(decode) and all(item["met"] for item in decode),
    }


def to_json(rows: list[BenchmarkRow], command: str, dtype: str) -> dict:
    return {
        "note": "all times and bytes are modelled by onnx-nmm's Trainium cost model, not measured",
        "command": command,
        "dtype": dtype,
        "rows": [
            {
                "model": row.shape.model,
                "hidden": row.shape.hidden,
                "intermediate": row.shape.intermediate,
                "rank": row.shape.rank,
                "tokens": row.tokens,
                "target": row.target,
                "parameter_ratio": row.shape.parameter_ratio,
                "modelled_us": {v: row.seconds(v) * 1e6 for v in VARIANTS},
                "roofline_us": {v: row.costs[v].roofline_s * 1e6 for v in VARIANTS},
                "over_roofline": {v: row.over_roofline(v) for v in VARIANTS},
                "fused_xuv_kernels_over_roofline": dict(zip(PROJECTIONS, row.xuv_kernels_over_roofline())),
                "hbm_mb": {v: row.costs[v].hbm_bytes / 1e6 for v in VARIANTS},
                "pe_utilization": {v: row.costs[v].pe_utilization for v in VARIANTS},
                "xuv_vs_unfused_per_projection": dict(zip(PROJECTIONS, row.xuv_kernel_speedups())),
                "best_dense": row.best_dense,
            }
            for row in rows
        ],
        "summary": summarize(rows),
    }


def markdown(rows: list[BenchmarkRow], command: str, dtype: str) -> str:
    """The table and the bars as Markdown (times in µs, HBM traffic in MB, both modelled)."""
    lines = [
        f"Modelled on onnx-nmm's Trainium cost model ({dtype}); produced by `{command}`.",
        "",
        "| target | model | tokens | dense µs | dense MLP µs | unfused µs | fused XUV µs | fused MLP µs "
        "| XUV vs unfused | fused MLP vs best dense | params dense/low-rank "
        "| HBM MB dense / dense MLP / unfused / XUV / fused MLP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        times = " | ".join(f"{row.seconds(v) * 1e6:,.1f}" for v in VARIANTS)
        megabytes = " / ".join(f"{row.costs[v].hbm_bytes / 1e6:,.1f}" for v in VARIANTS)
        lines.append(
            f"| {row.target} | {row.shape.model} | {row.tokens} | {times} | {row.speedup('unfused', 'fused_xuv'):.2f}× "
            f"| {row.speedup(row.best_dense, 'fused_mlp'):.2f}× | {row.shape.parameter_ratio:.2f}× | {megabytes} |"
        )
    lines += ["", *roofline_table(rows), "", *summary_lines(summarize(rows))]
    return "\n".join(lines) + "\n"


def roofline_table(rows: list[BenchmarkRow]) -> list[str]:
    """Modelled time over roofline per variant, the fused_xuv launches on their own, and what bounds each."""
    lines = [
        "Modelled time / roofline (1.00× is the physical limit; the roofline is per launch the larger of HBM "
        "bytes / memory bandwidth and FLOPs / TensorE peak):",
        "",
        "| target | model | tokens | bound | dense | dense MLP | unfused | fused XUV (MLP) | fused_xuv kernels "
        "| fused MLP |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        cost = row.costs["fused_mlp"]
        bound = "memory" if cost.roofline_s > cost.pe_ideal_s else "TensorE"
        xuv = " / ".join(f"{r:.2f}" for r in row.xuv_kernels_over_roofline())
        ratio = {v: f"{row.over_roofline(v):.2f}×" for v in VARIANTS}
        lines.append(f"| {row.target} | {row.shape.model} | {row.tokens} | {bound} | {ratio['dense']} "
                     f"| {ratio['dense_mlp']} | {ratio['unfused']} | {ratio['fused_xuv']} | {xuv} "
                     f"| {ratio['fused_mlp']} |")
    return lines


def summary_lines(summary: dict) -> list[str]:
    low, high = summary["xuv_vs_unfused_kernel_range"]
    worst = ", ".join(f"{v.replace('_', ' ')} {r:.2f}×" for v, r in summary["over_roofline_max"].items())
    lines = [
        f"- fused kernels (each fused_xuv and fused_svd_mlp launch) at worst "
        f"{summary['fused_kernels_over_roofline_max']:.2f}× "
        f"their roofline; goal {summary['roofline_goal']}×: "
        f"{'met' if summary['roofline_goal_met'] else 'NOT met'} (modelled)",
        f"- worst time / roofline over the grid, whole MLP: {worst} (modelled)",
        f"- the best dense path (the faster of dense and dense MLP) at worst "
        f"{summary['best_dense_over_roofline_max']:.2f}× its roofline; goal {summary['dense_roofline_goal']}×: "
        f"{'met' if summary['best_dense_over_roofline_max'] <= summary['dense_roofline_goal'] else 'NOT met'} "
        "(modelled)",
        "- every dense kernel launch: "
        + ", ".join(f"{kernel} at worst {r:.2f}×" for kernel, r in summary["dense_kernels_over_roofline_max"].items())
        + f" its roofline; {summary['dense_kernels_within_goal'][0]} of {summary['dense_kernels_within_goal'][1]} "
        f"launches within the goal {summary['dense_roofline_goal']}× (modelled)",
        f"- fused XUV vs unfused, per projection (kernel level), mean over the grid: "
        f"{summary['xuv_vs_unfused_kernel_mean']:.3f}× (geometric {summary['xuv_vs_unfused_kernel_geomean']:.3f}×, "
        f"range {low:.2f}–{high:.2f}×); bar {summary['xuv_bar']}×: "
        f"{'met' if summary['xuv_bar_met'] else 'NOT met'} (modelled)",
        f"- fused XUV vs unfused, whole MLP (silu_mul in both), mean: "
        f"{summary['xuv_vs_unfused_mlp_mean']:.3f}× (modelled)",
        f"- fused XUV vs dense matmul of the full weight, per projection, mean: "
        f"{summary['xuv_vs_dense_kernel_mean']:.3f}× (modelled)",
    ]
    for item in summary["decode"]:
        lines.append(
            f"- 1 token, {item['target']}, {item['model']}: fused MLP vs best dense {item['fused_mlp_vs_dense']:.2f}× "
            f"against parameter ratio {item['parameter_ratio']:.2f}×: {'met' if item['met'] else 'NOT met'} (modelled)"
        )
    return lines


def plot(rows: list[BenchmarkRow], path, dtype: str) -> None:
    """Speed-up of each low-rank variant over the best dense path, per target, as grouped bars (needs
    matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({row.target for row in rows})
    figure, axes = plt.subplots(len(targets), 1, figsize=(14, 4.2 * len(targets)), squeeze=False)
    for ax, target in zip(axes[:, 0], targets):
        selected = [row for row in rows if row.target == target]
        width = 0.27
        for offset, variant in enumerate(("unfused", "fused_xuv", "fused_mlp")):
            ax.bar([i + (offset - 1) * width for i in range(len(selected))],
                   [row.speedup(row.best_dense, variant) for row in selected], width,
                   label=variant.replace("_", " "))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(selected)))
        ax.set_xticklabels([f"{row.shape.model}\n{row.tokens} tok" for row in selected], fontsize=7)
        ax.set_ylabel("speed-up over the best dense path (modelled)")
        ax.set_title(f"{target}, {dtype}: modelled MLP time, best dense / variant")
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_roofline(rows: list[BenchmarkRow], path, dtype: str) -> None:
    """Modelled time over roofline against tokens, one line per variant and model, per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({row.target for row in rows})
    figure, axes = plt.subplots(1, len(targets), figsize=(7 * len(targets), 4.5), squeeze=False, sharey=True)
    styles = {"dense": ":", "dense_mlp": (0, (1, 3)), "unfused": "-.", "fused_xuv": "--", "fused_mlp": "-"}
    for ax, target in zip(axes[0], targets):
        for index, shape in enumerate(sorted({row.shape for row in rows}, key=lambda s: s.model)):
            selected = sorted((row for row in rows if row.target == target and row.shape == shape),
                              key=lambda r: r.tokens)
            for variant, style in styles.items():
                ax.plot([row.tokens for row in selected], [row.over_roofline(variant) for row in selected],
                        linestyle=style, color=f"C{index}", label=f"{shape.model} {variant.replace('_', ' ')}")
        ax.axhline(ROOFLINE_GOAL, color="black", linewidth=0.8)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("modelled time / roofline")
        ax.set_title(f"{target}, {dtype}: MLP time over its roofline (modelled)")
    axes[0][-1].legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _sequence(costs: list[KernelCost]) -> KernelCost:
    total = costs[0]
    for cost in costs[1:]:
        total = total.then(cost)
    return total


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
