"""The static-cache graphs (passes/static_cache.py, runtime/static_cache.py): a prefill per bucket and one decode
step over a cache of fixed length give the greedy tokens of the exported model's own dynamic cache."""

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from onnx_nmm import DataError, ModelError, OptionError, RankOptions, RewriteOptions, rewrite
from onnx_nmm.generation.decoding import Decoder
from onnx_nmm.model_source import ModelSource
from onnx_nmm.passes.static_cache import CacheLayout, static_decode_graph
from onnx_nmm.runtime.static_cache import default_buckets, static_cache
from onnx_nmm.trainium.generation_check import check_generation

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
PROMPT = np.random.default_rng(0).integers(0, 300, (1, 11))


def _greedy(model, ids: np.ndarray, new_tokens: int) -> list[int]:
    """The exported model's own greedy continuation, its dynamic cache on onnxruntime."""
    decoder = Decoder(model)
    logits, tokens = decoder.prefill(ids), []
    for _ in range(new_tokens):
        token = logits.argmax(-1)
        tokens.append(int(token[0]))
        logits = decoder.step(token)
    return tokens


WITHOUT_POSITIONS = "-without-positions"  # the graph derives positions and masks from the cache's length
# Every KV form, each for two architectures: onnx-nmm's exports (dynamo and TorchScript, with position_ids and
# without, as torch.onnx.export writes a model called with a DynamicCache alone), optimum's (with past, merged),
# onnxruntime-genai's (fp32, int4), and a rewritten model.
FORMS = [f"{architecture}-{exporter}{positions}" for architecture in ("llama", "qwen2")
         for exporter in ("dynamo", "torchscript") for positions in ("", WITHOUT_POSITIONS)] + [
    "optimum-past", "optimum-past-qwen2", "optimum-merged", "optimum-merged-qwen2", "genai-fp32", "genai-fp32-qwen2",
    "genai-int4", "genai-int4-qwen2", "rewritten", "rewritten" + WITHOUT_POSITIONS]


def _kv_model(name: str, export, tmp_path) -> Path:
    positions = not name.endswith(WITHOUT_POSITIONS)
    if name.startswith("rewritten"):  # the custom ops run as their function bodies
        path = tmp_path / "rewritten.onnx"
        rewrite(export("llama", "dynamo", cache=True, positions=positions),
                RewriteOptions(ranks=RankOptions(keep=0.9, align=32))).save(path)
        return path
    if name.startswith(("llama-", "qwen2-")):
        architecture, exporter = name.removesuffix(WITHOUT_POSITIONS).split("-")
        return export(architecture, exporter, cache=True, positions=positions)
    return FORMATS / name / "model.onnx"


@pytest.mark.parametrize("name", FORMS)
def test_static_graphs_generate_the_tokens_of_the_dynamic_cache(export, tmp_path, name):
    model = _kv_model(name, export, tmp_path)
    graphs = static_cache(model, max_context=64, buckets=(16, 64))
    assert graphs.generate_greedy(PROMPT, 12) == _greedy(model, PROMPT, 12)


@pytest.mark.parametrize("name", FORMS)
def test_static_graphs_lowered_to_pytorch_give_the_logits_of_the_dynamic_cache_step_by_step(export, tmp_path, name):
    """compile's check against the model as given (trainium/generation_check.py), on every form: each graph
    lowered to PyTorch as the Neuron trace takes it (the custom ops as torch math, onnxruntime-genai's
    GroupQueryAttention writing its one cache buffer in place), the prefill and decode steps past the first
    bucket, each step's logits within 1e-3 of their range."""
    model = _kv_model(name, export, tmp_path)
    check = check_generation(ModelSource.of(model), static_cache(model, max_context=32, buckets=(8, 32)))
    assert check.prompt_tokens == 6 and len(check.max_abs) == 5
    assert max(check.max_abs) <= check.tolerance and check.reference_tokens == check.compiled_tokens


def test_the_cache_is_one_buffer_in_and_out(export):
    graphs = static_cache(export("llama", "dynamo", cache=True), max_context=32)
    for graph in (*graphs.prefill.values(), graphs.decode):
        aliases = dict(pair.split("=") for pair in graph.metadata_props["onnx_nmm.cache_aliases"].split(","))
        inputs = {value.name: value for value in graph.graph.inputs}
        outputs = {value.name: value for value in graph.graph.outputs}
        assert len(aliases) == 4  # two layers, keys and values
        for present, past in aliases.items():
            assert list(outputs[present].shape)[1:] == list(inputs[past].shape)[1:] == [2, 32, 64]
    assert [value.name for value in graphs.decode.graph.inputs][-1] == "cache_position"


def test_a_prompt_takes_the_smallest_bucket_that_holds_it_and_too_long_is_an_error(export):
    graphs = static_cache(export("llama", "dynamo", cache=True), max_context=64, buckets=(16, 32))
    assert default_buckets(256) == (128, 256) and default_buckets(4096) == (128, 512, 2048, 4096)
    assert [graphs.bucket_for(n) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]
    with pytest.raises(DataError, match="a prompt of 33 tokens is longer than the largest prefill bucket, 32"):
        graphs.bucket_for(33)
    with pytest.raises(DataError, match="11 prompt tokens and 54 new ones do not fit the cache of 64 positions"):
        graphs.generate_greedy(PROMPT, 54)
    with pytest.raises(OptionError, match="buckets"):
        static_cache(export("llama", "dynamo", cache=True), max_context=64, buckets=(128,))


def test_an_onnxruntime_genai_cache_is_written_by_its_attention_without_a_position_input():
    """GroupQueryAttention takes the cache as one buffer and writes where the mask ends: the graphs only get
    static shapes, the cache [B, 2, 32, head size] in and out, and the decode step no cache_position."""
    graphs = static_cache(FORMATS / "genai-fp32" / "model.onnx", max_context=32, buckets=(8,))
    assert graphs.layout.write_position is None
    for graph in (graphs.prefill[8], graphs.decode):
        inputs = {value.name: value for value in graph.graph.inputs}
        outputs = {value.name: value for value in graph.graph.outputs}
        for past, present in graphs.layout.cache:
            assert list(inputs[past].shape) == list(outputs[present].shape)
            assert list(inputs[past].shape)[1:3] == [2, 32] and graphs.cache_shapes[past] == (1, 2, 32, 16)
    assert "cache_position" not in {value.name for value in graphs.decode.graph.inputs}
    assert list(graphs.decode.graph.inputs[1].shape)[1:] == [32]  # the mask over the whole cache


def test_a_model_a_static_cache_cannot_be_made_from_says_why(export):
    with pytest.raises(ModelError, match="has no KV cache"):
        static_cache(export("llama", "dynamo"), max_context=32)


def test_the_pass_takes_the_branch_a_merged_decoder_appends_in_from_its_caller():
    """passes/static_cache.py works on one graph; runtime/static_cache.py inlines a merged decoder's with-past
    branch first, and the pass alone says so when given the If."""
    model = ir.load(FORMATS / "optimum-merged" / "model.onnx")
    layout = CacheLayout("input_ids", "attention_mask", "position_ids",
                         tuple((f"past_key_values.{i}.{kind}", f"present.{i}.{kind}") for i in range(2)
                               for kind in ("key", "value")))
    with pytest.raises(ValueError, match="appended to inside a subgraph"):
        static_decode_graph(model, layout, max_context=32)
