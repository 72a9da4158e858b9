"""`compile --max-context --tp N` without --dry-run: every graph's rank programs traced with neuronx-distributed
(ModelBuilderV2's trace and compile, one NxDModel), which `generate DIR --backend neuron` loads with each rank's
weights and runs. The SDK is not installed here: a stand-in of its API, run on the CPU, takes its place. It
keeps what the real one does that the result depends on: one program traced per graph (rank 0's) and run by every
rank with the weights set_weights gives that rank (the traced copy's own are NaN), the cache as a state shared by
name between the graphs and zero at first, the collectives computed across the ranks by the tensor-parallel
mappings (a sum, and a gather along the last axis in rank order). What it cannot run, the NKI kernels compiled
into the NEFF, it computes as the lowering's torch math."""

import copy
import importlib.machinery
import inspect
import json
import sys
import threading
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
import torch
from exported_models import exported_model
from onnx import TensorProto, helper

import onnx_nmm
from onnx_nmm import CompileOptions, ModelError, compile
from onnx_nmm.cli import main
from onnx_nmm.lowering import NeuronKernels, TorchMath, set_backend
from onnx_nmm.lowering.collective_converters import _CollectiveModule, nxd_join
from onnx_nmm.lowering.svd_converters import _KernelOp
from onnx_nmm.runtime.collective_ops import ALL_GATHER, ALL_REDUCE
from onnx_nmm.runtime.rank_programs import RankPrograms, SimulatedGroup
from onnx_nmm.trainium import neuron
from onnx_nmm.trainium.rank_tracing import check_same_program

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
TOKENIZER = FORMATS / "genai-fp32"  # a 300-token BPE, below every test model's vocabulary
PROMPT = "the quick brown fox jumps over the lazy dog"
TP = 4


class FakeNxd:
    """What the stand-in recorded, and its state: the parallel state open, the calls, the saved models."""

    def __init__(self):
        self.tp: int | None = None
        self.traces: list[dict] = []
        self.compiles: list[dict] = []
        self.saved: dict[str, object] = {}
        self.collectives = {ALL_REDUCE: 0, ALL_GATHER: 0}
        self.rank = threading.local()


def _fake_modules(fake: FakeNxd) -> dict[str, types.ModuleType]:
    class NxDParallelState:
        def __init__(self, world_size=1, rank=0, tensor_model_parallel_size=1, **_):
            self.tp = tensor_model_parallel_size

        def __enter__(self):
            fake.tp = self.tp

        def __exit__(self, *_):
            fake.tp = None

    def trace(model, args=None, kwargs=None, spmd=True, preserve_parameters=True):
        signature = inspect.signature(model.forward).parameters.values()
        assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature), "NxD refuses *args"
        assert fake.tp is not None, "traced outside NxDParallelState"
        traced = copy.deepcopy(model)
        with torch.no_grad():  # the trace keeps the program, not rank 0's weights: each rank's come from set_weights
            for tensor in traced.state_dict().values():
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
        fake.traces.append({"module": model, "tp": fake.tp, "inputs": {k: tuple(v.shape) for k, v in kwargs.items()}})
        return SimpleNamespace(hlo=f"hlo of {model.graph}", metaneff=None, module=traced,
                               weight_names=set(model.state_dict()))

    def compile(hlo_module, metaneff, compiler_workdir=None, compiler_args=None, key=None):
        neff = Path(compiler_workdir) / key / "graph.neff"
        neff.parent.mkdir(parents=True)
        neff.write_bytes(hlo_module.encode())
        fake.compiles.append({"key": key, "compiler_args": compiler_args})
        return SimpleNamespace(neff_filepath=str(neff))

    class NxDModel:
        def __init__(self, world_size, start_rank=None, local_ranks_size=None, state_initializer=None):
            self.world_size, self.graphs, self.ranks, self.states = world_size, {}, {}, None

        def add(self, key, trace_artifacts, compilation_artifacts):
            self.graphs[key] = trace_artifacts
            return self

        def save(self, path_to_save, save_weights=False):
            token = str(uuid.uuid4())
            Path(path_to_save).write_text(token)
            fake.saved[token] = self

        @classmethod
        def load(cls, path_to_model, start_rank=None, local_ranks_size=None):
            return fake.saved[Path(path_to_model).read_text()]

        def set_weights(self, sharded_checkpoint):
            assert len(sharded_checkpoint) == self.world_size
            used = set().union(*(graph.weight_names for graph in self.graphs.values()))
            assert all(set(weights) == used for weights in sharded_checkpoint), "a weight no graph reads, or missing"
            self.weights = sharded_checkpoint
            for key, graph in self.graphs.items():
                self.ranks[key] = []
                for weights in sharded_checkpoint:
                    module = copy.deepcopy(graph.module)
                    module.load_state_dict({name: weights[name] for name in graph.weight_names}, strict=True)
                    set_backend(module, TorchMath())  # the NKI kernels, which only a NeuronCore runs
                    self.ranks[key].append(module)

        def to_neuron(self):  # every state zero, one set per rank, shared by name by every graph
            states = {name: torch.zeros_like(buffer) for graph in self.ranks.values()  # a buffer not in the weights
                      for name, buffer in graph[0].named_buffers(recurse=False) if name not in graph[0].state_dict()}
            self.states = [{name: tensor.clone() for name, tensor in states.items()} for _ in range(self.world_size)]

        def __call__(self, *args, model_name=None, **kwargs):
            assert self.states is not None, "Model not initialized. Call set_weights() followed by to_neuron()"
            group = SimulatedGroup(self.world_size)

            def run(rank):
                fake.rank.value, fake.rank.group = rank, group
                module = self.ranks[model_name][rank]
                for name, tensor in self.states[rank].items():
                    setattr(module, name, tensor)
                output = module(*args, **kwargs)  # the same inputs on every rank
                self.states[rank] = {name: getattr(module, name) for name in self.states[rank]}
                return output

            with ThreadPoolExecutor(self.world_size) as pool:
                outputs = list(pool.map(run, range(self.world_size)))
            return outputs[0]

    def reduce_from_tensor_model_parallel_region(input_, process_group=None):
        fake.collectives[ALL_REDUCE] += 1
        return fake.rank.group.join_for(fake.rank.value)(ALL_REDUCE, input_, -1)

    def gather_from_tensor_model_parallel_region(input_, process_group=None):
        fake.collectives[ALL_GATHER] += 1
        return fake.rank.group.join_for(fake.rank.value)(ALL_GATHER, input_, input_.dim() - 1)

    modules = {}
    for name in ("neuronx_distributed", "neuronx_distributed.trace", "neuronx_distributed.trace.model_builder",
                 "neuronx_distributed.parallel_layers", "neuronx_distributed.parallel_layers.mappings"):
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    root, mappings = modules["neuronx_distributed"], modules["neuronx_distributed.parallel_layers.mappings"]
    root.NxDModel, root.NxDParallelState = NxDModel, NxDParallelState
    modules["neuronx_distributed.trace.model_builder"].trace = trace
    modules["neuronx_distributed.trace.model_builder"].compile = compile
    mappings.reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region
    mappings.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
    root.parallel_layers = modules["neuronx_distributed.parallel_layers"]
    root.parallel_layers.mappings = mappings
    return modules


@pytest.fixture(scope="module")
def fake():
    fake = FakeNxd()
    with pytest.MonkeyPatch.context() as patch:
        for name, module in _fake_modules(fake).items():
            patch.setitem(sys.modules, name, module)
        patch.setattr(neuron, "missing_neuron_packages", lambda tp=1: [])  # torch-neuronx, neuronx-cc: not needed
        yield fake


@pytest.fixture(scope="module")
def model() -> Path:
    return exported_model("llama", "dynamo", cache=True)  # 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def traced(fake, model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("traced") / "model.neuron"
    compile(model, folder, CompileOptions(target="trn1", max_context=96, buckets=(16, 64), tp=TP))
    return folder


def _greedy(**changes):
    return onnx_nmm.GenerateOptions(**{"max_new_tokens": 12, "chat": False, **changes})


def test_each_graph_is_traced_once_over_the_tp_ranks_its_collectives_on_nxds_mappings(fake, traced):
    manifest = json.loads((traced / "manifest.json").read_text())
    assert manifest["traced"] and not manifest["dry_run"]
    assert [trace["module"].graph for trace in fake.traces] == ["prefill_16", "prefill_64", "decode"]
    assert all(trace["tp"] == TP for trace in fake.traces)
    assert fake.traces[0]["inputs"] == {"tokens": (1, 16), "mask": (1, 16), "positions": (1, 16)}
    assert fake.traces[2]["inputs"] == {"tokens": (1, 1), "mask": (1, 96), "positions": (1, 1),
                                        "write_position": (1,)}
    assert [(call["key"], call["compiler_args"]) for call in fake.compiles] == [
        (name, "--target trn1") for name in ("prefill_16", "prefill_64", "decode")]
    for trace, graph in zip(fake.traces, manifest["graphs"]):
        collectives = [m for m in trace["module"].modules() if isinstance(m, _CollectiveModule)]
        assert len(collectives) == len(graph["collectives"]) and all(m.join is nxd_join for m in collectives)
        kernels = [m for m in trace["module"].modules() if isinstance(m, _KernelOp)]  # the fused MLPs
        assert kernels and all(m.backend == NeuronKernels(target="trn1") for m in kernels)
        assert graph["torchscript"] == "nxd/model.pt" and graph["nxd_key"] == graph["name"]
        assert (traced / graph["neff"][0]).is_file()
        # rank 0's program: the cache is one rank's KV head, held as the state, not a weight
        assert trace["module"].cache_0.shape == (1, 1, 96, 64) and "cache_0" not in trace["module"].state_dict()


def test_generate_on_the_neuron_backend_runs_the_traced_ranks_with_the_tokens_of_the_cpu(fake, traced, model):
    expected = onnx_nmm.generate(model, PROMPT, TOKENIZER, _greedy())
    on_cpu = onnx_nmm.generate(traced, PROMPT, TOKENIZER, _greedy(backend="torch"))
    before = dict(fake.collectives)
    result = onnx_nmm.generate(traced, PROMPT, TOKENIZER, _greedy(backend="neuron"))
    assert result.tokens == on_cpu.tokens == expected.tokens
    # the prefill, then a decode step per further token: each 4 all-reduces and 2 gathers on every rank, by NxD's
    # mappings
    runs = len(result.tokens) + (result.stopped_by == "eos")
    calls = {kind: fake.collectives[kind] - before[kind] for kind in before}
    assert calls == {ALL_REDUCE: runs * TP * 4, ALL_GATHER: runs * TP * 2}
    nxd_model = next(iter(fake.saved.values()))
    weights = nxd_model.weights  # each rank its own, read from its rank programs
    assert all(any(not torch.equal(weights[0][name], weights[rank][name]) for name in weights[0])
               for rank in range(1, TP))
    assert all(state["cache_0"].abs().sum() > 0 for state in nxd_model.states)  # the cache stayed on each rank


def test_generate_dir_on_the_neuron_backend_from_the_command_line_prints_the_cpus_text(fake, traced, capsys):
    arguments = ["generate", str(traced), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--max-new-tokens", "6", "--json", "--backend"]
    assert main([*arguments, "torch"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    assert main([*arguments, "neuron"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected


def test_a_traced_folder_without_neuronx_distributed_is_refused_in_one_line(fake, traced, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "neuronx_distributed")
    assert main(["generate", str(traced), "--prompt", PROMPT, "--tokenizer", str(TOKENIZER), "--no-chat",
                 "--backend", "neuron"]) == 3
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "neuronx-distributed" in error and "the torch --backend" in error


def test_a_gather_along_another_axis_than_the_last_is_moved_last_for_nxd_and_back(fake):
    group, parts = SimulatedGroup(3), [torch.randn(2, 3, 4) for _ in range(3)]

    def rank(index):
        fake.rank.value, fake.rank.group = index, group
        return nxd_join(ALL_GATHER, parts[index], 1), nxd_join(ALL_REDUCE, parts[index], -1)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rank, range(3)))
    for gathered, summed in results:
        assert torch.equal(gathered, torch.cat(parts, dim=1))
        assert torch.equal(summed, (parts[0] + parts[1]) + parts[2])


def test_ranks_whose_programs_differ_in_shape_are_refused_before_any_trace(tmp_path):
    paths = []
    for rank, width in enumerate((3, 2)):  # a width of 5 split unevenly: the first rank one wider
        weight = helper.make_tensor(f"w{rank}", TensorProto.FLOAT, (4, width), [0.0] * 4 * width)
        graph = helper.make_graph([helper.make_node("MatMul", ["x", f"w{rank}"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 4))],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, width))], [weight])
        paths.append(tmp_path / f"decode.rank{rank}.onnx")
        onnx.save(helper.make_model(graph), paths[-1])
    with pytest.raises(ModelError, match=r"decode: rank 1's program differs from rank 0's \(w1 \[4, 2\] against w0 "
                                         r"\[4, 3\]\)"):
        check_same_program(RankPrograms(tuple(paths)), "decode")


def test_compile_prints_the_generate_command_that_runs_a_tp_folder(traced):
    """Rank programs run on the NeuronCores once traced, lowered to PyTorch on the CPU before: onnxruntime, the
    default backend, cannot run their collectives."""
    from onnx_nmm.cli.compile import _generate_command

    manifest = json.loads((traced / "manifest.json").read_text())
    assert _generate_command(traced, manifest).endswith("--backend neuron, TOKENIZER being the model's tokenizer "
                                                        "folder or .gguf file (none was beside the model to copy into "
                                                        "the folder)")
    assert "--backend torch" in _generate_command(traced, {**manifest, "traced": False})
    assert "--backend" not in _generate_command(traced, {**manifest, "tp": 1})


@pytest.mark.slow
def test_smollm2_traced_over_three_neuroncores_generates_onnxruntimes_tokens(fake, tmp_path):
    """SmolLM2's KV export (9 query heads, 3 KV heads) compiled with --tp 3 --max-context 256 and traced with the
    stand-in: generate DIR --backend neuron prints onnxruntime's greedy tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import assets

    model, gguf = assets.smollm2_kv_onnx(), assets.smollm2_gguf()
    folder = tmp_path / "smollm2.tp3"
    assert main(["compile", str(model), "--target", "trn1", "--max-context", "256", "--tp", "3", "-o",
                 str(folder)]) == 0
    assert json.loads((folder / "manifest.json").read_text())["traced"]
    options = dict(max_new_tokens=24)
    expected = onnx_nmm.generate(model, "What is the capital of France?", gguf, onnx_nmm.GenerateOptions(**options))
    result = onnx_nmm.generate(folder, "What is the capital of France?", gguf,
                               onnx_nmm.GenerateOptions(backend="neuron", **options))
    assert result.tokens == expected.tokens
