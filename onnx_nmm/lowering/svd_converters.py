"""onnx2torch converters for the `ai.onnx_nmm` ops: modules that hand the op to a kernel backend.

The factors U, V live in the op's module as parameters named after their ONNX initializers, not as
anonymous graph buffers, so `factor_parameters` can find them (to fine-tune them, and to write them
back). Two ops naming the same initializer share one parameter.

The backend is not fixed at conversion: `set_backend(module, backend)` points every op of a lowered
model at one (see kernel_backends), so one lowering serves the check against onnxruntime (torch math),
the emulator run and the Neuron trace.
"""

from __future__ import annotations

from onnx2torch.node_converters.registry import add_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult
from torch import nn

from onnx_nmm.lowering.kernel_backends import TorchMath
from onnx_nmm.lowering.onnx2torch_compat import lowering_domain
from onnx_nmm.passes import svd_ops

DOMAIN = lowering_domain(svd_ops.DOMAIN)

# Parameters made during one conversion, by initializer name (reset by onnx_nmm.lowering.lower).
_parameters: dict[str, nn.Parameter] = {}


def reset_shared_parameters() -> None:
    _parameters.clear()


class _KernelOp(nn.Module, OnnxToTorchModule):
    """An `ai.onnx_nmm` op: its node's name, and the backend that computes it (set_backend)."""

    def __init__(self, node: str):
        super().__init__()
        self.node = node
        self.backend = TorchMath()


class _SvdOp(_KernelOp):
    def __init__(self, node: str, factors: list[tuple[str, nn.Parameter]]):
        super().__init__(node)
        self.factor_names = [name for name, _ in factors]  # by input position: a shared U comes twice
        self.factors = nn.ParameterList([parameter for _, parameter in factors])


class SvdMatMulModule(_SvdOp):
    def forward(self, x, *bias):
        return self.backend.run(self.node, svd_ops.SVD_MATMUL, x, *self.factors, *bias)


class SvdGatedMlpModule(_SvdOp):
    def __init__(self, node: str, factors: list[tuple[str, nn.Parameter]], activation: str):
        super().__init__(node, factors)
        self.activation = activation

    def forward(self, x):
        return self.backend.run(self.node, svd_ops.SVD_GATED_MLP, x, *self.factors, activation=self.activation)


class SvdMlpModule(SvdGatedMlpModule):
    def forward(self, x, b1, b2):
        u1, v1, u2, v2 = self.factors
        return self.backend.run(self.node, svd_ops.SVD_MLP, x, u1, v1, b1, u2, v2, b2, activation=self.activation)


class GatedMlpModule(_KernelOp):
    """A dense gated MLP: its weights are the graph's (buffers the lowering passes in), not factors to train."""

    def __init__(self, node: str, activation: str):
        super().__init__(node)
        self.activation = activation

    def forward(self, x, wg, wu, wd):
        return self.backend.run(self.node, svd_ops.GATED_MLP, x, wg, wu, wd, activation=self.activation)


class MlpModule(GatedMlpModule):
    def forward(self, x, w1, b1, w2, b2):
        return self.backend.run(self.node, svd_ops.MLP, x, w1, b1, w2, b2, activation=self.activation)


def _factors(node: OnnxNode, graph: OnnxGraph, names: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
    for name in names:
        if name not in graph.initializers:
            raise NotImplementedError(f"{node.operation_type} '{node.name}' with factor '{name}' "
                                      "that is not an initializer")
        if name not in _parameters:
            _parameters[name] = nn.Parameter(graph.initializers[name].to_torch(), requires_grad=False)
    return [(name, _parameters[name]) for name in names]


@add_converter(svd_ops.SVD_MATMUL, svd_ops.DOMAIN_VERSION, DOMAIN)
def _svd_matmul(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    x, u, v, *bias = node.input_values
    module = SvdMatMulModule(node.name, _factors(node, graph, (u, v)))
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(inputs=(x, *bias),
                                                                                   outputs=node.output_values))


@add_converter(svd_ops.SVD_GATED_MLP, svd_ops.DOMAIN_VERSION, DOMAIN)
def _svd_gated_mlp(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    x, *factors = node.input_values
    module = SvdGatedMlpModule(node.name, _factors(node, graph, tuple(factors)), _activation(node))
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(inputs=(x,),
                                                                                   outputs=node.output_values))


@add_converter(svd_ops.SVD_MLP, svd_ops.DOMAIN_VERSION, DOMAIN)
def _svd_mlp(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    x, u1, v1, b1, u2, v2, b2 = node.input_values
    module = SvdMlpModule(node.name, _factors(node, graph, (u1, v1, u2, v2)), _activation(node))
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(inputs=(x, b1, b2),
                                                                                   outputs=node.output_values))


@add_converter(svd_ops.GATED_MLP, svd_ops.DOMAIN_VERSION, DOMAIN)
def _gated_mlp(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(torch_module=GatedMlpModule(node.name, _activation(node)),
                                    onnx_mapping=OnnxMapping(inputs=node.input_values, outputs=node.output_values))


@add_converter(svd_ops.MLP, svd_ops.DOMAIN_VERSION, DOMAIN)
def _mlp(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(torch_module=MlpModule(node.name, _activation(node)),
                                    onnx_mapping=OnnxMapping(inputs=node.input_values, outputs=node.output_values))


def _activation(node: OnnxNode) -> str:
    activation = node.attributes.get("activation", "silu")
    if activation not in svd_ops.ACTIVATIONS:
        raise NotImplementedError(f"{node.operation_type} with activation {activation!r}")
    return activation


def set_backend(module: nn.Module, backend) -> None:
    for child in module.modules():
        if isinstance(child, _KernelOp):
            child.backend = backend


def svd_ops_of(module: nn.Module) -> list[_SvdOp]:
    return [child for child in module.modules() if isinstance(child, _SvdOp)]


def factor_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every SVD factor of a lowered model, by ONNX initializer name (shared factors once)."""
    found: dict[str, nn.Parameter] = {}
    for op in svd_ops_of(module):
        found.update(zip(op.factor_names, op.factors))
    return found


def weights_as_parameters(module: nn.Module, names: set[str] | list[str]) -> dict[str, nn.Parameter]:
    """The tensors holding the ONNX initializers `names` in a lowered model (onnx2torch keeps them as buffers of
    its `initializers` container, read by the nodes' modules), turned into parameters that need no gradient
    yet: what fine-tuning trains and the damage probe swaps, besides the SVD factors. Refused when a name is
    not an initializer some node reads."""
    import torch.fx

    wanted, found = set(names), {}
    for node in module.graph.nodes:
        mapping = getattr(module.get_submodule(node.target), "onnx_mapping", None) if node.op == "call_module" else None
        if mapping is None:
            continue
        for name, argument in zip(mapping.inputs, node.args):
            if name in wanted and isinstance(argument, torch.fx.Node) and argument.op == "get_attr":
                found[name] = argument.target
    missing = wanted - set(found)
    if missing:
        raise ValueError(f"the lowered model reads no initializer named {sorted(missing)[:3]}")
    parameters = {}
    for name, target in found.items():
        owner_path, _, attribute = target.rpartition(".")
        owner = module.get_submodule(owner_path)
        tensor = getattr(owner, attribute)
        if not isinstance(tensor, nn.Parameter):
            delattr(owner, attribute)
            owner.register_parameter(attribute, nn.Parameter(tensor.detach().clone(), requires_grad=False))
        parameters[name] = getattr(owner, attribute)
    return parameters
