"""A Llama-shaped decoder written straight to disk, layer by layer: random bf16 (or fp16/fp32) weights in
external data, never the whole model in memory. The graph reads like a TorchScript export
(`/model/layers.0/mlp/gate_proj/MatMul`, weights behind a Cast to float32), so linear-layer detection finds
q/k/v/o and gate/up/down; its attention is a stand-in (q scaled by the mean of k + v), not softmax attention.

    python tools/scale_model.py OUT_FOLDER [--hidden 4096 --intermediate 14336 --kv 1024 --layers 24]
                                           [--vocab 128256: token ids in, logits out]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

DTYPES = {"bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16), "float16": (np.float16, TensorProto.FLOAT16),
          "float32": (np.float32, TensorProto.FLOAT)}
LLAMA_3_8B = {"hidden": 4096, "intermediate": 14336, "kv": 1024}
ALIGNMENT = 4096


def write_llama_shaped(folder: str | Path, hidden: int, intermediate: int, kv: int, layers: int,
                       dtype: str = "bfloat16", seed: int = 0, vocab: int | None = None) -> Path:
    """Write `folder`/model.onnx and model.onnx.data; the model's path. With `vocab`, a causal LM: token ids
    `input_ids` in through an embedding, logits out of an lm_head (what the layer-wise rewrite runs)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    numpy_dtype, onnx_dtype = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    data = folder / "model.onnx.data"
    with data.open("wb") as out:
        def weight(name: str, k: int, n: int) -> str:
            out.write(b"\0" * (-out.tell() % ALIGNMENT))
            offset = out.tell()
            for rows in np.array_split(np.arange(k), max(1, k // 512)):  # ≤ 512 rows in memory at a time
                block = rng.standard_normal((len(rows), n), dtype=np.float32) / np.float32(np.sqrt(k))
                out.write(block.astype(numpy_dtype).tobytes())
            tensor = TensorProto(name=name, data_type=onnx_dtype, dims=[k, n], data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(out.tell() - offset))):
                tensor.external_data.add(key=key, value=value)
            initializers.append(tensor)
            return name

        h = "hidden_states.0"
        if vocab is not None:
            table = weight("model.embed_tokens.weight", vocab, hidden)
            nodes.append(helper.make_node("Gather", [table, "input_ids"], ["/model/embed_tokens/Gather_output_0"],
                                          name="/model/embed_tokens/Gather"))
            nodes.append(helper.make_node("Cast", ["/model/embed_tokens/Gather_output_0"], [h], to=TensorProto.FLOAT,
                                          name="/model/embed_tokens/Cast"))
        for i in range(layers):
            scope = f"/model/layers.{i}"

            def linear(x: str, module: str, k: int, n: int) -> str:
                w = weight(f"model.layers.{i}.{module}.weight", k, n)
                path = f"{scope}/{module.replace('.', '/')}"
                nodes.append(helper.make_node("Cast", [w], [f"{path}/Cast_output_0"], to=TensorProto.FLOAT,
                                              name=f"{path}/Cast"))
                nodes.append(helper.make_node("MatMul", [x, f"{path}/Cast_output_0"], [f"{path}/MatMul_output_0"],
                                              name=f"{path}/MatMul"))
                return f"{path}/MatMul_output_0"

            def node(op: str, inputs: list[str], name: str, **attributes) -> str:
                nodes.append(helper.make_node(op, inputs, [f"{scope}/{name}_output_0"], name=f"{scope}/{name}",
                                              **attributes))
                return f"{scope}/{name}_output_0"

            q = linear(h, "self_attn.q_proj", hidden, hidden)
            k = linear(h, "self_attn.k_proj", hidden, kv)
            v = linear(h, "self_attn.v_proj", hidden, kv)
            mean = node("ReduceMean", [node("Add", [k, v], "self_attn/Add")], "self_attn/ReduceMean", axes=[-1])
            attention = linear(node("Mul", [q, mean], "self_attn/Mul"), "self_attn.o_proj", hidden, hidden)
            h = node("Add", [h, attention], "Add")
            gate = linear(h, "mlp.gate_proj", hidden, intermediate)
            up = linear(h, "mlp.up_proj", hidden, intermediate)
            silu = node("Mul", [gate, node("Sigmoid", [gate], "mlp/act_fn/Sigmoid")], "mlp/act_fn/Mul")
            down = linear(node("Mul", [silu, up], "mlp/Mul"), "mlp.down_proj", intermediate, hidden)
            h = node("Add", [h, down], "Add_1")
        head = weight("lm_head.weight", hidden, vocab) if vocab is not None else None
    inputs = [helper.make_tensor_value_info("hidden_states.0", TensorProto.FLOAT, ["batch", "seq", hidden])]
    outputs = [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["batch", "seq", hidden])]
    if head is not None:
        nodes.append(helper.make_node("Cast", [head], ["/lm_head/Cast_output_0"], to=TensorProto.FLOAT,
                                      name="/lm_head/Cast"))
        nodes.append(helper.make_node("MatMul", [h, "/lm_head/Cast_output_0"], ["logits"], name="/lm_head/MatMul"))
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])]
    graph = helper.make_graph(nodes, "llama_shaped", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    for name, value in LLAMA_3_8B.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--vocab", type=int, help="a causal LM with this vocabulary (token ids in, logits out)")
    args = parser.parse_args()
    print(write_llama_shaped(args.folder, args.hidden, args.intermediate, args.kv, args.layers, args.dtype,
                             vocab=args.vocab))


if __name__ == "__main__":
    main()
