"""Choosing layers and ranks within a quality budget."""

import json
import math

import numpy as np
import pytest

from onnx_nmm.cli import main
from onnx_nmm.sensitivity import DENSE, Candidate, greedy_moves, select_within_budget


class _Spectrum:
    """Stands in for a WhitenedDecomposition: loss² = Σ_{i>r} σ_i² / Σ σ_i²."""

    def __init__(self, sigma):
        self.sigma = np.asarray(sigma, dtype=np.float64)

    def whitened_loss(self, rank):
        return math.sqrt(np.sum(self.sigma[rank:] ** 2) / np.sum(self.sigma**2))


def _candidates():
    decaying = _Spectrum(np.exp(-np.arange(64) / 8))  # compresses well
    flat = _Spectrum(np.ones(64))  # does not
    return [Candidate("robust", ("a.u", "a.v"), 64, 192, decaying, reference_rank=16, reference_damage=0.01),
            Candidate("fragile", ("b.u", "b.v"), 64, 192, flat, reference_rank=16, reference_damage=0.5)]


def test_moves_go_from_dense_down_in_aligned_steps_cheapest_damage_first():
    moves = greedy_moves(_candidates(), align=16)
    robust = [rank for name, rank in moves if name == "robust"]
    assert robust == [32, 16] and all(rank % 16 == 0 for _, rank in moves)  # break-even of 64×192 is 48
    assert moves[0][0] == "robust" and moves.index(("robust", 16)) < moves.index(("fragile", 32))


def test_the_longest_prefix_within_the_budget_is_chosen():
    candidates = _candidates()

    def true_damage(ranks):  # additive, as the predictions assume
        return sum(c.predicted_damage(ranks[c.name]) for c in candidates)

    chosen = select_within_budget(candidates, 16, budget=0.05, metric="ppl", damage_of=true_damage)
    assert chosen.ranks == {"robust": 16, "fragile": DENSE} and chosen.damage <= 0.05
    everything = select_within_budget(candidates, 16, budget=10.0, metric="ppl", damage_of=true_damage)
    assert everything.ranks == {"robust": 16, "fragile": 16}
    nothing = select_within_budget(candidates, 16, budget=1e-9, metric="ppl", damage_of=true_damage)
    assert set(nothing.ranks.values()) == {DENSE} and nothing.moves_applied == 0


def test_rewrite_within_a_perplexity_budget(capsys, export, tmp_path):
    report = tmp_path / "r.json"  # external data: the sensitivity pass must read the weights from beside the input
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo", external_data=True), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--calib-samples", "8", "--seq-len", "48", "--align", "32", "--max-ppl-increase", "0.02",
                                  "--report", report, "--quiet")])
    assert code == 0, capsys.readouterr().err
    data = json.loads(report.read_text())
    budget = data["quality_budget"]
    assert budget["metric"] == "ppl" and budget["measured"] <= budget["budget"] == pytest.approx(math.log(1.02))
    kept_dense = [layer for layer in data["layers"] if layer["status"] == "dense"]
    assert all("perplexity budget" in layer["reason"] for layer in kept_dense)
    assert all(layer["rank"] % 32 == 0 for layer in data["layers"] if layer["status"] == "factorized")


def test_both_budgets_at_once_is_an_error(capsys, export, tmp_path):
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--max-ppl-increase", "0.1", "--max-kl", "0.1")])
    assert code == 2 and "one of --max-ppl-increase and --max-kl" in capsys.readouterr().err
