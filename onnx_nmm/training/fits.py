"""Whether the whole-model fine-tuning fits this machine's memory; when it does not, `finetune` tunes one layer
at a time (layer_by_layer.py), as the rewrite does (onnx_nmm.layerwise.memory). The whole-model path holds the
rewritten model lowered to PyTorch (its proto and its module, briefly both), the gradients and AdamW's two
moments of the trained weights, the activations and vocabulary-wide logits of a batch, and the dense teacher in
onnxruntime beside it: SmolLM2-135M narrowed to 0.44 GiB of float32 weights peaked at 4.98 GiB (windows of 256
tokens, batch 2), so it is taken to need WHOLE_MODEL_FACTOR × the rewritten model's weights in float32 (the
same peak tuned layer by layer: 2.49 GiB, most of it the held-out perplexity's whole-model onnxruntime runs)."""

from __future__ import annotations

from onnx_nmm.layerwise.memory import GB, float32_weight_bytes, memory_shortfall
from onnx_nmm.model_source import ModelSource

WHOLE_MODEL_FACTOR = 12


def too_large_to_finetune_whole(model) -> str | None:
    """Why fine-tuning the whole rewritten `model` (a path or a ModelSource) at once would not fit in memory (one
    line), or None if it fits."""
    source = ModelSource.of(model)
    weights = float32_weight_bytes(source.model)
    shortfall = memory_shortfall(WHOLE_MODEL_FACTOR * weights)
    if shortfall is None:
        return None
    needed, available = shortfall
    return (f"{source.label} holds {weights / GB:.1f} GB of weights in float32; fine-tuning it whole beside its "
            f"dense teacher needs about {needed / GB:.0f} GB and this machine has {available / GB:.0f} GB "
            "available: tuning it one layer at a time")
