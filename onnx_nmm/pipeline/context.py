"""What the rewrite passes share: the options, the original model, the calibration data, and what each
pass hands on to the next (statistics → plan → factorization → report)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx_ir as ir

from onnx_nmm.calibration.activation_stats import GramStatistics
from onnx_nmm.calibration.calibration_data import CalibrationData
from onnx_nmm.calibration.tokens import TokenWindows
from onnx_nmm.decomposition.nystrom import MlpNarrowing, reference_width
from onnx_nmm.errors import DataError, ModelError
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.passes import LinearLayer, find_linear_layers, find_unread_layers, select_layers
from onnx_nmm.passes.mlp_modules import Mlp, find_mlps
from onnx_nmm.pipeline.factorizer import Factorizer
from onnx_nmm.pipeline.report import LayerOutcome, RewriteReport
from onnx_nmm.progress import Progress
from onnx_nmm.ranks.rank_plan import RankPlan


@dataclass
class RewriteContext:
    options: RewriteOptions
    source: ModelSource  # the original model, for what runs it (onnxruntime, the PyTorch lowering)
    progress: Progress = field(default_factory=Progress)
    statistics: GramStatistics | None = None  # GatherStatistics
    held_out_statistics: GramStatistics | None = None  # GatherStatistics, nystrom: h's Gram on held-out windows
    plan: RankPlan | None = None  # PlanRanks
    factorizer: Factorizer | None = None  # PlanRanks, so that FactorizeLayers reuses what it decomposed
    report: RewriteReport = field(init=False)  # every pass adds to it
    narrowed: dict[str, LayerOutcome] = field(default_factory=dict)  # NarrowMlps: the narrowed layers' rows
    not_narrowed: dict[str, str] = field(default_factory=dict)  # mlps(): an MLP's module path → why it is not one
    _calibration: CalibrationData | None = field(default=None, repr=False)  # calibration_data()
    _narrowings: dict[str, MlpNarrowing] = field(default_factory=dict, repr=False)  # narrowing()

    def __post_init__(self):
        o = self.options
        if o.calibration is not None:
            self.calibration_data()  # refuse a bad source before any work
        self.report = RewriteReport(rule=o.ranks.describe(), selection=o.selection.describe(),
                                    method=o.factorization.describe() + f", {o.ranks.budget} budget")

    def make_factorizer(self) -> Factorizer:
        if self.factorizer is None:
            self.factorizer = Factorizer(self.options.factorization, self.statistics, self.options.ranks.align)
        return self.factorizer

    def mlps(self, layers: list[LinearLayer]) -> list[Mlp]:
        """The MLPs a nystrom rewrite narrows: those whose every projection is a target (every site)."""
        if not self.options.strategy.narrows_mlps:
            return []
        chosen = {layer.name for layer in select_layers(layers, self.options.selection)[0]}
        mlps, unmatched = find_mlps(layers)
        by_name = {layer.name: layer for layer in layers}
        self.not_narrowed = {by_name[down].module_path.rsplit(".", 1)[0]: why for down, why in unmatched.items()}
        return [mlp for mlp in mlps if all(layer.name in chosen for layer in mlp.layers)]

    def narrowing(self, mlp: Mlp) -> MlpNarrowing:
        """The MLP's Nyström compression from the calibration statistics, made once (the plan and the narrowing
        share it)."""
        if mlp.down.name not in self._narrowings:
            gram = self.statistics.gram(mlp.down.x.name)
            narrowing = MlpNarrowing(gram, mlp.down.weight_matrix(), self.options.factorization.neuron_score)
            if self.held_out_statistics is not None:  # its Gram serves this choice alone: freed after (GBs on 0.5B)
                held_out = self.held_out_statistics.gram(mlp.down.x.name)
                del self.held_out_statistics.grams[mlp.down.x.name]
                narrowing.choose_ridge(held_out, reference_width(mlp.width))
            self._narrowings[mlp.down.name] = narrowing
        return self._narrowings[mlp.down.name]

    def calibration_data(self) -> CalibrationData:
        """The calibration data, made once; a quality budget holds its measurement windows out of it."""
        if self._calibration is None:
            ranks = self.options.ranks
            held_out = (ranks.sensitivity_windows if ranks.measures_damage or self.options.strategy.narrows_mlps
                        else 0)
            self._calibration = CalibrationData(self.options.calibration, self.source.model.graph, self.source,
                                                held_out, self.progress)
        return self._calibration

    def calibration_windows(self, samples: int | None = None) -> TokenWindows:
        """Windows of the calibration tokens (statistics, sequential calibration), never a held-out one."""
        return self.calibration_data().windows(samples)

    def budget_windows(self) -> TokenWindows:
        """The windows the quality budgets are measured on: held out of the calibration windows, and of the
        windows loaded statistics came from (when their file names them)."""
        data = self.calibration_data()
        held_out = data.held_out_windows()
        shared = sorted(set(held_out.ids) & set(self.statistics.windows if self.statistics else ()))
        if shared:
            raise DataError(f"the statistics in {data.statistics_file} came from {len(shared)} of the windows the "
                            f"quality budget is measured on ({', '.join(shared[:3])}{', …' if len(shared) > 3 else ''}"
                            "): give {samples} the window count they were gathered with, or gather them again",
                            samples="calibration.samples")
        return held_out


def targets(model: ir.Model, options: RewriteOptions) -> tuple[list[LinearLayer], list[LinearLayer], dict[str, str]]:
    """(every linear layer, the targets, why each other layer is left alone); refused when there is nothing
    to target. A target that sits in several subgraphs (a merged decoder's branches) is listed once, by its
    first site; `sites` gives them all."""
    layers = find_linear_layers(model)
    _refuse_unread_targets(model, layers, options)
    if not layers:
        raise ModelError("no linear layer found: looked for MatMul/Gemm nodes whose second input is a constant weight "
                         "(an initializer or a Constant, possibly behind Identity/Transpose/Cast), and MatMulNBits, "
                         "DequantizeLinear → MatMul and MatMulInteger")
    chosen, skipped = select_layers(layers, options.selection)
    if not chosen:
        raise ModelError(f"none of the {len(layers)} linear layers matches {options.selection.describe()}; "
                         "inspect lists their names and roles")
    first_sites: dict[str, LinearLayer] = {}
    for layer in chosen:
        first_sites.setdefault(layer.name, layer)
    return layers, list(first_sites.values()), skipped


def _refuse_unread_targets(model: ir.Model, layers: list[LinearLayer], options: RewriteOptions) -> None:
    """Quantized layers in a form onnx-nmm does not read, where the rewrite would target them: name the op."""
    unread = [layer for layer in find_unread_layers(model)
              if not layers or options.selection.targets in ("all", layer.group) or layer.group == "other"]
    if unread:
        ops = sorted({layer.op for layer in unread})
        raise ModelError(f"{len(unread)} of the targeted linear layers are quantized as {', '.join(ops)} (e.g. "
                         f"{unread[0].module_path or unread[0].node.name}), a form onnx-nmm does not read; rewrite the "
                         "float model and quantize the result, or quantize with MatMulNBits, QDQ or dynamic int8")


def sites(layers: list[LinearLayer], chosen: list[LinearLayer]) -> list[LinearLayer]:
    """Every node of the targets, in graph order: a target in several subgraphs has a site in each."""
    names = {layer.name for layer in chosen}
    return [layer for layer in layers if layer.name in names]


class RewritePass(ir.passes.InPlacePass):
    """A step of the rewrite over the shared context: changes the model in place, or only reads it, and
    records its wall time in the report under `label`."""

    label = ""

    def __init__(self, context: RewriteContext):
        super().__init__()
        self.context = context

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        start = time.perf_counter()
        modified = self.run(model)
        self.context.report.seconds[self.label] = time.perf_counter() - start
        return ir.passes.PassResult(model, modified=modified)

    def run(self, model: ir.Model) -> bool:
        """Do the step; whether the model changed."""
        raise NotImplementedError
