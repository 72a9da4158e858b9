"""Tiny LLMs in the formats people deploy, made by the exporters that make them, committed for the tests.

    tests/data/formats/optimum-past/      optimum-onnx, text-generation-with-past (a KV cache)
    tests/data/formats/optimum-merged/    optimum's merged decoder: one If choosing the first step or a
                                          later one, both branches reading the same weights
    tests/data/formats/genai-fp32/        onnxruntime-genai's model builder, fp32 and int4 (MatMulNBits):
    tests/data/formats/genai-int4/        GroupQueryAttention, fused qkv, genai_config.json and a tokenizer
    tests/data/formats/*-qwen2/           the same four of a Qwen2 (`--architecture qwen2`), whose q, k and v
                                          projections have biases: optimum-past-qwen2, optimum-merged-qwen2,
                                          genai-fp32-qwen2 and genai-int4-qwen2

Each model is a random-weight Llama or Qwen2 (hidden 64, 2 layers, vocabulary 300, with a byte-level BPE
tokenizer of 300 tokens; small enough to commit), built from a config here so that this script needs nothing
of onnx-nmm. optimum-onnx pins transformers below the project's and the genai builder wants a newer one, so
each part runs in an environment of its own:

    python -m venv .venv-optimum && .venv-optimum/bin/pip install torch==2.13.0 "optimum-onnx[onnxruntime]==0.1.0"
    .venv-optimum/bin/python tools/format_fixtures.py optimum [--architecture qwen2]
    python -m venv .venv-genai && .venv-genai/bin/pip install torch==2.13.0 transformers onnxruntime-genai onnx-ir
    .venv-genai/bin/python tools/format_fixtures.py genai [--architecture qwen2]

`--checkpoint` exports a real model instead (a Hugging Face folder or a .gguf file, which needs `gguf` in
that environment); tools/formats_study.py does so for SmolLM2.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "formats"
ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2"}  # transformers' {prefix}Config and {prefix}ForCausalLM


TOKENIZER_TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
                  "and darkness was upon the face of the deep.")


def folder_suffix(architecture: str) -> str:
    """The fixture folders' names end: nothing for the Llama, "-qwen2" for the Qwen2."""
    return "" if architecture == "llama" else f"-{architecture}"


def tiny_model(folder: Path, architecture: str) -> Path:
    """A random-weight checkpoint of `architecture`, every parameter (biases too) perturbed so that no weight is
    zero or repeated, with a byte-level BPE tokenizer of its vocabulary's size (the genai builder and generator
    want one)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    prefix = ARCHITECTURES[architecture]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape) * 0.02)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TOKENIZER_TEXT] * 20, trainers.BpeTrainer(
        vocab_size=config.vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def checkpoint_folder(source: Path, folder: Path) -> Path:
    """A Hugging Face folder: `source` itself, or a .gguf file's model and tokenizer saved as one."""
    if source.suffix != ".gguf":
        return source
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                              dtype=torch.float32)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(folder)
    return folder


def optimum_export(checkpoint: Path, task: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(checkpoint),
                    "--task", task, str(folder)], check=True, capture_output=True, cwd=folder.parent)
    return folder / "model.onnx"


def first_step_decoder(with_past: Path, target: Path) -> Path:
    """The decoder optimum 1.x exported for the first step (no past inputs, presents out), made from the
    with-past export by feeding it an empty cache: past [batch, heads, 0, head_dim] from input_ids' batch."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(with_past)
    graph = model.graph
    past = {value.name: value for value in graph.input if value.name.startswith("past_key_values")}
    empty = {name: f"{name}.empty" for name in past}
    for node in graph.node:
        node.input[:] = [empty.get(name, name) for name in node.input]
    nodes = [helper.make_node("Shape", ["input_ids"], ["first_step_batch"], start=0, end=1)]
    for name, value in past.items():
        dims = value.type.tensor_type.shape.dim
        graph.initializer.append(numpy_helper.from_array(np.array([dims[1].dim_value, 0, dims[3].dim_value]),
                                                         f"{name}.rest"))
        nodes += [helper.make_node("Concat", ["first_step_batch", f"{name}.rest"], [f"{name}.shape"], axis=0),
                  helper.make_node("ConstantOfShape", [f"{name}.shape"], [empty[name]],
                                   value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))]
        graph.input.remove(value)
    original = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + original)
    onnx.save(model, target)
    return target


def optimum_fixtures(checkpoint: Path, work: Path, out: Path, suffix: str) -> None:
    from optimum.onnx.graph_transformations import merge_decoders

    with_past = optimum_export(checkpoint, "text-generation-with-past", work / "past")
    first_step = first_step_decoder(with_past, work / "first-step.onnx")
    past, merged = out / f"optimum-past{suffix}", out / f"optimum-merged{suffix}"
    for folder in (past, merged):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    shutil.copy(with_past, past / "model.onnx")
    merge_decoders(first_step, with_past, strict=False, save_path=merged / "model.onnx")


def genai_fixtures(checkpoint: Path, work: Path, out: Path, suffix: str) -> None:
    for precision in ("fp32", "int4"):
        target = out / f"genai-{precision}{suffix}"
        shutil.rmtree(target, ignore_errors=True)
        # run away from this repository: `python -m` puts the working folder first on the path, and transformers
        # would take the repository's kernels/ for the PyPI package of that name
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(checkpoint), "-o",
                        str(target.resolve()), "-p", precision, "-e", "cpu", "-c", str(work / "cache")], check=True,
                       capture_output=True, cwd=work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("optimum", "genai"))
    parser.add_argument("--out", type=Path, default=OUT)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--architecture", choices=tuple(ARCHITECTURES), default="llama",
                        help="the tiny random model's; folders other than the Llama's end in -ARCHITECTURE")
    source.add_argument("--checkpoint", type=Path, help="a Hugging Face folder or a .gguf file to export instead "
                                                       "of a tiny random model (docs/formats.md's study)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out.parent if args.checkpoint else None) as work:
        work = Path(work)
        checkpoint = (checkpoint_folder(args.checkpoint.resolve(), work / "checkpoint") if args.checkpoint
                      else tiny_model(work / "checkpoint", args.architecture))
        (optimum_fixtures if args.part == "optimum" else genai_fixtures)(checkpoint, work, args.out,
                                                                         folder_suffix(args.architecture))
    for model in sorted(args.out.glob("*/model.onnx")):
        print(f"wrote {model} ({model.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
