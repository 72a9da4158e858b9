"""At full rank the rewrite is exact: the rewritten model reproduces the original's logits."""

import pytest
from rewriting import assert_logits_close, rewrite_file, run_both

from onnx_nmm import RankOptions, Selection

ARCHITECTURES = ["llama", "qwen3", "mistral", "gpt2", "llama-tied"]
EXPORTERS = ["dynamo", "dynamo-noopt", "torchscript"]


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_full_rank_rewrite_reproduces_the_original(export, tmp_path, architecture, exporter):
    source = export(architecture, exporter)
    rewritten = tmp_path / "full.onnx"
    report = rewrite_file(source, rewritten, RankOptions(rank="full"), Selection(targets="all", lm_head=True))
    assert len(report.factorized) == len(report.layers)  # every linear layer, lm_head included
    for batch, seq_len, seed in [(1, 1, 0), (2, 7, 1), (3, 33, 2)]:
        expected, actual = run_both(source, rewritten, batch, seq_len, seed)
        assert_logits_close(expected, actual)
