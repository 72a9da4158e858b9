"""Choosing layers and ranks within a quality budget."""

import json
import math

import numpy as np
import pytest

from onnx_nmm import Dense, OptionError
from onnx_nmm.cli import main
from onnx_nmm.decomposition.lowrank import Spectrum
from onnx_nmm.ranks.sensitivity import (
    Candidate,
    describe_measurement,
    greedy_moves,
    held_out_damage,
    select_for_parameters,
    select_within_budget,
    spread_over_windows,
)

DENSE = Dense("kept dense by the test")


def _spectrum(sigma):
    """Stands in for a whitened decomposition: loss² = Σ_{i>r} σ_i² / Σ σ_i²."""
    sigma = np.asarray(sigma, dtype=np.float64)
    return Spectrum(sigma, float(np.sum(sigma**2)))


def _candidates():
    decaying = _spectrum(np.exp(-np.arange(64) / 8))  # compresses well
    flat = _spectrum(np.ones(64))  # does not
    return [Candidate("robust", 64, 192, decaying, references=[(16, 0.01)]),
            Candidate("fragile", 64, 192, flat, references=[(16, 0.5)])]


def test_moves_go_from_dense_down_aligned_ranks_cheapest_damage_first():
    moves = greedy_moves(_candidates(), align=16)
    robust = [rank for name, rank in moves if name == "robust"]
    assert robust == [32, 16] and all(rank % 16 == 0 for _, rank in moves)  # break-even of 64×192 is 48
    assert moves[0][0] == "robust" and moves.index(("robust", 16)) < moves.index(("fragile", 16))


def test_a_move_jumps_over_a_rank_whose_saving_is_not_worth_its_damage():
    # flat spectrum, damage linear in L(r)² = 1 − r/64: rank 32 costs 2/3 of rank 16's damage for half its
    # saving, so the layer goes from dense straight to 16 (one aligned step at a time would stop at 32)
    moves = greedy_moves(_candidates(), align=16)
    assert [rank for name, rank in moves if name == "fragile"] == [16]


def test_damage_between_references_is_interpolated_in_the_truncation_loss():
    flat = _spectrum(np.ones(64))  # L(r)² = 1 − r/64
    layer = Candidate("layer", 64, 192, flat, references=[(32, 0.1), (16, 0.5)])
    assert layer.reference_ranks(16) == [32, 16]  # break-even 48: ranks 32 and 16 save parameters
    assert layer.predicted_damage(48) == pytest.approx(0.1 * 0.25 / 0.5)  # on the segment from (0, 0)
    assert layer.predicted_damage(24) == pytest.approx(0.3)  # between the two references
    assert layer.predicted_damage(8) == pytest.approx(0.5 + 0.4 / 0.25 * 0.125)  # the last slope goes on
    convex = Candidate("c", 64, 192, flat, references=[(32, 0.1), (16, 0.5)])
    linear = Candidate("l", 64, 192, flat, references=[(32, 0.1)])
    # with the measured low-rank damage, taking one layer to the bottom costs more than two halfway
    assert convex.predicted_damage(16) > 2 * convex.predicted_damage(32)
    assert linear.predicted_damage(16) < 2 * linear.predicted_damage(32)


def test_the_longest_prefix_within_the_budget_is_chosen():
    candidates = _candidates()

    def true_damage(ranks):  # additive, as the predictions assume
        return sum(c.predicted_damage(ranks[c.name]) for c in candidates)

    chosen = select_within_budget(candidates, 16, 0.05, "ppl", true_damage, DENSE)
    assert chosen.plan == {"robust": 16, "fragile": DENSE} and chosen.damage <= 0.05
    everything = select_within_budget(candidates, 16, 10.0, "ppl", true_damage, DENSE)
    assert everything.plan == {"robust": 16, "fragile": 16}
    nothing = select_within_budget(candidates, 16, 1e-9, "ppl", true_damage, DENSE)
    assert set(nothing.plan.values()) == {DENSE} and nothing.moves_applied == 0


def test_a_parameter_target_takes_the_shortest_prefix_that_reaches_it():
    candidates = _candidates()
    measured = []

    def damage_of(ranks):
        measured.append(dict(ranks))
        return 0.125

    robust_at_32 = 64 * 192 - 32 * (64 + 192)  # the first move
    chosen = select_for_parameters(candidates, 16, robust_at_32 + 1, "ppl", damage_of, DENSE)
    assert chosen.plan == {"robust": 16, "fragile": DENSE} and chosen.moves_applied == 2
    assert chosen.damage == 0.125 and measured == [chosen.plan] and chosen.budget is None
    with pytest.raises(OptionError, match="raise ranks.keep or lower ranks.align"):
        select_for_parameters(candidates, 16, 2 * 64 * 192, "ppl", damage_of, DENSE)


def test_rewrite_within_a_perplexity_budget(capsys, export, tmp_path):
    report = tmp_path / "r.json"  # external data: the sensitivity pass must read the weights from beside the input
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo", external_data=True), "-o", tmp_path / "o.onnx",
                                  "--calib", "random", "--calib-samples", "8", "--seq-len", "48", "--align", "32",
                                  "--max-ppl-increase", "0.02", "--report", report, "--quiet")])
    assert code == 0, capsys.readouterr().err
    data = json.loads(report.read_text())
    budget = data["quality_budget"]
    assert budget["metric"] == "ppl" and budget["measured"] <= budget["budget"] == pytest.approx(math.log(1.02))
    kept_dense = [layer for layer in data["layers"] if layer["status"] == "dense"]
    assert all("perplexity budget" in layer["reason"] for layer in kept_dense)
    assert all(layer["rank"] % 32 == 0 for layer in data["layers"] if layer["status"] == "factorized")
    measured = budget["sensitivity"]  # (rank, damage) at the middle and the lowest rank of every candidate
    assert measured and all(len(references) in (1, 2) for references in measured.values())
    assert all(rank % 32 == 0 for references in measured.values() for rank, _ in references)


def test_both_budgets_at_once_is_an_error(capsys, export, tmp_path):
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--max-ppl-increase", "0.1", "--max-kl", "0.1")])
    assert code == 2 and "give one of --max-ppl-increase, --max-kl, not several" in capsys.readouterr().err


def test_rewrite_keeping_a_fraction_where_it_costs_least(capsys, export, tmp_path):
    report = tmp_path / "r.json"
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--calib-samples", "8", "--seq-len", "48", "--align", "16", "--keep", "0.9",
                                  "--budget", "sensitivity", "--report", report, "--quiet")])
    assert code == 0, capsys.readouterr().err
    data = json.loads(report.read_text())
    targets = [layer for layer in data["layers"] if layer["status"] != "skipped"]
    removed = 1 - (sum(layer["parameters_after"] for layer in targets)
                   / sum(layer["parameters_before"] for layer in targets))
    assert 0.1 <= removed < 0.5, removed
    assert data["quality_budget"]["keep"] == 0.9 and data["quality_budget"]["budget"] is None
    assert "sensitivity budget keeping 90.0%" in data["rule"]


def test_a_sensitivity_budget_spends_keep_not_another_rule(capsys, export, tmp_path):
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--budget", "sensitivity", "--rank", "32")])
    assert code == 2 and "spends the parameters --keep would keep: give --keep, not --rank" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_ranks_from_a_report_reproduce_its_choice_with_another_calibration(capsys, export, tmp_path):
    model, first, second = export("llama", "dynamo"), tmp_path / "first.json", tmp_path / "second.json"
    calib = ["--calib", "random", "--calib-samples", "4", "--seq-len", "32", "--align", "16", "--quiet"]
    assert main([str(a) for a in ("rewrite", model, "-o", tmp_path / "a.onnx", *calib, "--keep", "0.9",
                                  "--method", "whiten", "--budget", "sensitivity", "--report", first)]) == 0
    assert main([str(a) for a in ("rewrite", model, "-o", tmp_path / "b.onnx", *calib, "--ranks-from", first,
                                  "--calib-mode", "sequential", "--report", second)]) == 0, capsys.readouterr().err

    def ranks(report):
        return {layer["name"]: (layer["status"], layer["rank"]) for layer in json.loads(report.read_text())["layers"]}

    assert ranks(second) == ranks(first) and any(status == "dense" for status, _ in ranks(first).values())


def test_ranks_from_with_a_quality_budget_is_an_error(capsys, export, tmp_path):
    code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx", "--calib", "random",
                                  "--ranks-from", tmp_path / "r.json", "--max-ppl-increase", "0.1")])
    assert code == 2 and "give one of --max-ppl-increase, --ranks-from, not several" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_ranks_from_something_else_is_an_error(capsys, export, tmp_path):
    not_a_report, other_model = tmp_path / "x.json", tmp_path / "other.json"
    not_a_report.write_text('{"rule": "?"}')
    assert main([str(a) for a in ("rewrite", export("gpt2", "dynamo"), "-o", tmp_path / "g.onnx", "--keep", "0.5",
                                  "--report", other_model, "--quiet")]) == 0
    for report, message in ((not_a_report, "is not a rewrite report"), (other_model, "does not have")):
        code = main([str(a) for a in ("rewrite", export("llama", "dynamo"), "-o", tmp_path / "o.onnx",
                                      "--ranks-from", report, "--quiet")])
        assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "o.onnx").exists()


def test_the_damage_by_chunks_of_positions_is_the_damage_of_the_whole_window():
    from onnx_nmm.quality.metrics import log_softmax
    from onnx_nmm.ranks.sensitivity import log_loss_and_kl_by_positions, log_loss_and_kl_per_window

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (2, 23))
    reference, logits = rng.normal(size=(2, 23, 50)).astype(np.float32), rng.normal(size=(2, 23, 50)).astype(
        np.float32)
    whole = log_loss_and_kl_per_window(logits, tokens, log_softmax(reference[:, :-1].astype(np.float64)))
    by_chunks = log_loss_and_kl_by_positions(logits, tokens, reference, positions=5)  # 22 = 4 × 5 + 2
    np.testing.assert_allclose(by_chunks, whole, rtol=1e-12)


def test_held_out_damage_is_the_worst_source_mean():
    per_window = np.array([0.01, 0.03, 0.10, 0.20, 0.00])
    ids = ["kjv.txt#128", "kjv.txt#129", "generated#32", "generated#33", "news.txt#7"]
    assert held_out_damage(per_window, ids) == pytest.approx(0.15)
    assert held_out_damage(per_window[:2], ids[:2]) == pytest.approx(0.02)  # one source: its mean


def test_the_budget_line_gives_each_sources_mean_beside_the_worst():
    per_window = np.array([0.01, 0.03, 0.10, 0.20])
    ids = ["kjv.txt#1", "kjv.txt#2", "generated#3", "generated#4"]
    spread = spread_over_windows("ppl", per_window, ids)
    assert spread["by_source"] == pytest.approx({"kjv.txt": math.expm1(0.02), "generated": math.expm1(0.15)})
    line = describe_measurement({"spread": spread, "measured": held_out_damage(per_window, ids), "budget": 0.2})
    assert "4 calibration windows held out of the statistics: +16.2% (the worst source's mean; kjv.txt +2.0%, " \
           "generated +16.2%) (budget +22.1%)" in line


def test_the_log_loss_alone_is_the_log_loss_with_the_kl():
    from onnx_nmm.ranks.sensitivity import log_loss_and_kl_by_positions, next_token_nll_by_positions

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, (2, 23))
    reference, logits = (rng.normal(size=(2, 23, 50)).astype(np.float32) for _ in range(2))
    nll, _ = log_loss_and_kl_by_positions(logits, tokens, reference)
    np.testing.assert_allclose(next_token_nll_by_positions(logits, tokens, positions=5), nll, rtol=1e-12)
