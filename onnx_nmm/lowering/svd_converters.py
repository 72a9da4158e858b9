"""onnx2torch converters for the `ai.onnx_nmm` ops: modules that hand the op to a kernel backend.

The backend is not fixed at conversion: `set_backend(module, backend)` points every op of a lowered
model at one (see kernel_backends), so one lowering serves the check against onnxruntime (torch math),
the emulator run and the Neuron trace.
"""

from __future__ import annotations

from onnx2torch.node_converters.registry import add_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxToTorchModule, OperationConverterResult, onnx_mapping_from_node
from torch import nn

from onnx_nmm import svd_ops
from onnx_nmm.lowering.kernel_backends import TorchMath
from onnx_nmm.lowering.onnx2torch_compat import lowering_domain

DOMAIN = lowering_domain(svd_ops.DOMAIN)


class _SvdOp(nn.Module, OnnxToTorchModule):
    def __init__(self, node: str):
        super().__init__()
        self.node = node
        self.backend = TorchMath()


class SvdMatMulModule(_SvdOp):
    def forward(self, x, u, v, bias=None):
        return self.backend.svd_matmul(self.node, x, u, v, bias)


class SvdGatedMlpModule(_SvdOp):
    def forward(self, x, ug, vg, uu, vu, ud, vd):
        return self.backend.gated_mlp(self.node, x, ug, vg, uu, vu, ud, vd)


@add_converter(svd_ops.SVD_MATMUL, svd_ops.DOMAIN_VERSION, DOMAIN)
def _svd_matmul(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(torch_module=SvdMatMulModule(node.name), onnx_mapping=onnx_mapping_from_node(node))


@add_converter(svd_ops.SVD_GATED_MLP, svd_ops.DOMAIN_VERSION, DOMAIN)
def _svd_gated_mlp(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    activation = node.attributes.get("activation", "silu")
    if activation not in svd_ops.GATED_ACTIVATIONS:
        raise NotImplementedError(f"SvdGatedMLP with activation {activation!r}")
    return OperationConverterResult(torch_module=SvdGatedMlpModule(node.name), onnx_mapping=onnx_mapping_from_node(node))


def set_backend(module: nn.Module, backend) -> None:
    for child in module.modules():
        if isinstance(child, _SvdOp):
            child.backend = backend


def svd_ops_of(module: nn.Module) -> list[_SvdOp]:
    return [child for child in module.modules() if isinstance(child, _SvdOp)]
