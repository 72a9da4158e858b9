from pathlib import Path

import numpy as np
import pytest

from onnx_nmm.generation.decoding import Decoder

FORMATS = Path(__file__).resolve().parent / "data" / "formats"


def _model(name: str, export) -> Path:
    if name in ("dynamo", "dynamo-no-cache"):
        return export("llama", "dynamo", cache=name == "dynamo")
    return FORMATS / name / "model.onnx"


@pytest.mark.parametrize("name", ["dynamo", "dynamo-no-cache", "optimum-past", "optimum-merged", "genai-fp32"])
def test_stepping_with_the_cache_gives_the_logits_of_reading_the_whole_sequence(export, name):
    decoder = Decoder(_model(name, export))
    ids = np.random.default_rng(0).integers(0, 300, (2, 12))
    stepped = [decoder.prefill(ids[:, :7])] + [decoder.step(ids[:, i]) for i in range(7, 12)]
    whole = [Decoder(_model(name, export)).prefill(ids[:, :end]) for end in range(7, 13)]
    np.testing.assert_allclose(np.stack(stepped), np.stack(whole), atol=1e-4)
    assert decoder.tokens.shape == (2, 12) and (decoder.cache is None) == (name == "dynamo-no-cache")
