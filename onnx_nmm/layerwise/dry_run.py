"""A layer-wise rewrite's cost before it runs, on this machine: one layer run on one window, its narrowing's
maths, the head on one window with its damage's maths, all timed now; the sweeps' time and the peak memory
modelled from them.

    analysis sweep    (L·(W + 2P) + 2P·Σ_c (L − c))·t_layer + (3L + 2M)·t_session + L·t_maths + (1 + 2M)·P·t_head
                      (through every layer: the calibration windows W, the held-out windows P for their
                      activation and on the dense path; at each of the M calibration layers c
                      (damage_proxy.calibration_layers), two reference paths of P windows from it to the last
                      layer, Σ_c (L − c) ≈ M·(L + 1)/2: linear in L for a fixed M, L(L + 1)/2 when every layer is
                      one; a layer's sessions: its Gram's, its activation's, the dense one, and at a calibration
                      layer the two narrowed ones)
    narrowing sweeps  N·(L·(2P·t_layer + 2·t_session + t_refit) + 2P·t_head), N = MAX_SWEEPS for a budget of
                      damage (the search's most probes), else 1; t_refit a sweep's maths for one MLP: its
                      narrowing at the chosen ridge, the kept neurons at one width and their refit
    peak memory       the larger of what the timing itself held at most (its layer's maths among it) and,
                      over what the process held before, the largest segment's weights in float32 with a
                      window's logits and the narrowing's float64 matrices of the widest MLP (GRAM_COPIES of
                      I×I, DOWN_COPIES of I×H)

Sampling generated calibration windows and writing the output are not included.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnx_nmm.calibration.sources import GeneratedText
from onnx_nmm.decomposition.nystrom import MlpNarrowing, reference_width
from onnx_nmm.layerwise.budget_search import MAX_SWEEPS
from onnx_nmm.layerwise.damage_proxy import calibration_layers
from onnx_nmm.layerwise.memory import float32_weight_bytes
from onnx_nmm.layerwise.segments import LayerSegments
from onnx_nmm.model_source import ModelSource
from onnx_nmm.options import RewriteOptions
from onnx_nmm.pipeline import find_targets
from onnx_nmm.ranks.rank_plan import aligned_widths
from onnx_nmm.ranks.sensitivity import log_loss_and_kl_by_positions, next_token_nll_by_positions

# Float64 matrices the narrowing holds at once: I×I (the Gram, and one working copy for the refit's solve or the
# Cholesky factor) and I×H (the output weight, C·W_d, and relative_errors' ordered rows, right-hand side and fit)
GRAM_COPIES = 2
DOWN_COPIES = 5


@dataclass
class LayerwisePlan:
    layers: int
    windows: int  # calibration windows
    held_out: int  # windows the budget is measured on
    seq_len: int
    layer_seconds: float  # one layer on one window (measured)
    session_seconds: float  # one layer's onnxruntime session made, its weights read (measured)
    maths_seconds: float  # one MLP's narrowing maths (measured)
    refit_seconds: float  # one MLP's narrowing at its ridge, kept neurons and refit: a sweep's maths (measured)
    head_seconds: float  # the head on one window, and a path's damage from its logits (measured)
    analysis_seconds: float  # modelled
    narrowing_seconds: float  # modelled, every sweep
    peak_bytes: int  # modelled
    sample_layer: int
    narrowing_sweeps: int
    reference_layers: int  # the option: calibration layers M (0: every layer)

    @property
    def seconds(self) -> float:
        return self.analysis_seconds + self.narrowing_seconds

    def seconds_for(self, layers: int) -> float:
        """The same model's sweeps with `layers` layers of this width (modelled)."""
        return _sweeps(layers, self.windows, self.held_out, self.reference_layers, self.layer_seconds,
                       self.session_seconds, self.maths_seconds, self.refit_seconds, self.head_seconds,
                       self.narrowing_sweeps)


def plan_layerwise(model: str | os.PathLike, options: RewriteOptions) -> LayerwisePlan:
    """Time one layer, its maths and the head of the model at `model` on one window; model the rest."""
    before = _resident_bytes()
    source = ModelSource(Path(model))
    segments = LayerSegments.of(source, find_targets(source.model, options), options)
    assert options.calibration is not None, "narrowing MLPs is calibrated"
    seq_len, layers = options.calibration.seq_len, segments.layers
    tokens = segments.causal_lm.random_tokens(1, seq_len, seed=0)
    sample = min(1, layers - 1)  # the layer timed: the second (the first also embeds the tokens)
    carried: dict[str, np.ndarray] = {}
    for segment in segments.cut.segments[:sample]:  # the layers before it give it real inputs
        outputs = segments.session(segment).run(segment.outputs, segments.feeds(segment, tokens, carried))
        carried |= dict(zip(segment.outputs, outputs))
    segment, mlp = segments.cut.segments[sample], segments.mlps[sample]
    start = time.perf_counter()
    session, plan = segments.gram_session(sample)
    session_seconds = time.perf_counter() - start
    feeds = segments.feeds(segment, tokens, carried)
    layer_seconds, outputs = _timed(session, None, feeds)
    carried |= dict(zip(segment.outputs, outputs[plan.block_count + 1:]))
    gram = plan.assemble(outputs[:plan.block_count])[mlp.down.x.name or ""]
    del session, outputs  # as in the sweep: the maths runs without the layer's weights beside it
    rows = segments.activation_session(sample).run(None, feeds)[0]  # the MLP's activation, as held out
    start = time.perf_counter()
    narrowing = MlpNarrowing(gram, mlp.down.weight_matrix(), options.factorization.neuron_score)
    held_rows = np.tile(rows, (options.ranks.sensitivity_windows, 1))  # as many rows as the held-out windows
    ridge = narrowing.choose_ridge_on_rows(held_rows, reference_width(mlp.width))
    narrowing.relative_errors(aligned_widths(mlp.width, options.ranks.align))
    maths_seconds = time.perf_counter() - start
    del narrowing, held_rows
    start = time.perf_counter()  # a narrowing sweep's maths: the narrowing made again at its ridge
    narrowing = MlpNarrowing(gram, mlp.down.weight_matrix(), options.factorization.neuron_score, ridge=ridge,
                             ridge_chosen=True)
    narrowing.refit(narrowing.kept(reference_width(mlp.width)))
    refit_seconds = time.perf_counter() - start
    del narrowing, gram  # as in the sweep: the head runs without the maths's matrices beside it
    head = segments.cut.head
    stream = carried[segment.boundary]  # the residual stream of any layer has the head's input's shape
    head_feeds = segments.feeds(head, tokens, {name: carried.get(name, stream) for name in head.carried_inputs})
    head_seconds, (logits,) = _timed(segments.session(head), head.outputs[:1], head_feeds)
    head_seconds += _damage_seconds(logits, tokens, options.ranks.damage_metric)
    windows = options.calibration.samples + sum(source.samples for source in options.calibration.sources
                                                if isinstance(source, GeneratedText))
    held_out = options.ranks.sensitivity_windows
    ranks = options.ranks
    sweeps = MAX_SWEEPS if ranks.measures_damage and ranks.budget != "sensitivity" else 1
    analysis, narrowing_sweeps = _sweeps(layers, windows, held_out, ranks.reference_layers, layer_seconds,
                                         session_seconds, maths_seconds, refit_seconds, head_seconds, sweeps,
                                         apart=True)
    weights = max(float32_weight_bytes(ir.serde.deserialize_model(segment.model)) for segment in segments.cut.segments)
    widest = max(segments.mlps, key=lambda mlp: mlp.width)
    gram_bytes = (GRAM_COPIES * widest.width + DOWN_COPIES * widest.down.n) * widest.width * 8
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # sessions, the maths timed, torch
    peak = max(held, before + weights + 3 * logits.nbytes + gram_bytes)
    return LayerwisePlan(layers, windows, held_out, seq_len, layer_seconds, session_seconds, maths_seconds,
                         refit_seconds, head_seconds, analysis, narrowing_sweeps, int(peak), sample, sweeps,
                         ranks.reference_layers)


def _sweeps(layers: int, windows: int, held_out: int, reference_layers: int, layer: float, session: float,
            maths: float, refit: float, head: float, sweeps: int, apart: bool = False):
    """The analysis sweep's and the narrowing sweeps' seconds (the module's formulas); their sum unless `apart`."""
    measured = calibration_layers(layers, reference_layers)
    reference_runs = 2 * held_out * sum(layers - c for c in measured)
    analysis = ((layers * (windows + 2 * held_out) + reference_runs) * layer
                + (3 * layers + 2 * len(measured)) * session + layers * maths
                + (1 + 2 * len(measured)) * held_out * head)
    narrowing = sweeps * (layers * (2 * held_out * layer + 2 * session + refit) + 2 * held_out * head)
    return (analysis, narrowing) if apart else analysis + narrowing


def _damage_seconds(logits: np.ndarray, tokens: np.ndarray, metric: str) -> float:
    """The time a path's damage on one window takes from its logits (probe.damage_of_paths' maths)."""
    start = time.perf_counter()
    if metric == "ppl":
        next_token_nll_by_positions(logits, tokens)
    else:
        log_loss_and_kl_by_positions(logits, tokens, logits)
    return time.perf_counter() - start


def _timed(session, names, feeds, runs: int = 3) -> tuple[float, list[np.ndarray]]:
    """The median wall time of `runs` runs, after a first run that sets onnxruntime up; their outputs."""
    session.run(names, feeds)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = session.run(names, feeds)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)), outputs


def _resident_bytes() -> int:
    """What the process holds now (its resident set)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


