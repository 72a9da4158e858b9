"""nki.isa for the emulator: the instructions the project's kernels issue, with NKI 0.6 names and signatures
(nki/api/nki/isa/__init__.py). Each instruction checks the hardware rules, computes its result in float32
like the engines do (unless the emulation only traces), and appends one record to the trace.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from onnx_nmm.kernels.emulator import dtypes, session
from onnx_nmm.kernels.emulator.memory import MemoryRegion
from onnx_nmm.kernels.emulator.rules import NkiValidationError, require  # noqa: F401  (nisa.NkiValidationError)
from onnx_nmm.kernels.emulator.tensor import NkiTensor
from onnx_nmm.kernels.emulator.trace import Instruction

PMAX = 128
STATIONARY_FMAX = 128
MOVING_FMAX = 512
VECTOR_TRANSPOSE_MAX = 32


class engine(Enum):  # noqa: N801  (NKI's spelling)
    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


_Engine = engine  # parameters named `engine` (NKI's signatures) shadow the class inside functions


class nc_version(Enum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


def get_nc_version() -> nc_version:
    return nc_version(session.active_emulation().core.nc_version)


# -- operand checks and trace helpers ---------------------------------------------------------------------
def _check_compute_operand(tensor: NkiTensor, what: str, on: _Engine) -> None:
    require(isinstance(tensor, NkiTensor), "engine-memory", lambda: f"{what} is {type(tensor).__name__}, not a tensor")
    require(tensor._on_chip, "engine-memory", lambda: f"{what} is in {tensor.buffer.value}")
    require(
        not (on is _Engine.gpsimd and tensor.buffer is MemoryRegion.psum),
        "engine-memory",
        lambda: f"{what} is in PSUM and the instruction runs on GpSimd",
    )
    partitions, start = tensor.shape[0], tensor._partition_start
    require(partitions <= PMAX, "partition-max", lambda: f"{what} spans {partitions} partitions")
    allowed = (0,) if partitions > 64 else (0, 64) if partitions > 32 else (0, 32, 64, 96)
    require(start in allowed, "partition-start", lambda: f"{what} has {partitions} partitions from partition {start}")


def _same_layout(first: NkiTensor, second: NkiTensor, what: str) -> None:
    require(
        first.shape[0] == second.shape[0] and first._free_size == second._free_size,
        "elementwise-shape",
        lambda: f"{what}: {first.shape} and {second.shape}",
    )


def _access(tensor: NkiTensor) -> tuple:
    """The bytes the instruction about to be recorded touches; an on-chip storage is live until then."""
    if tensor._on_chip:
        _run().touch(tensor._storage)
    return (tensor.buffer.value if tensor._on_chip else "hbm", tensor._storage.id, *tensor._byte_range())


def _run() -> session.KernelRun:
    return session.current_run()


def _computing() -> bool:
    return not _run().trace_only


def _values(tensor: NkiTensor) -> np.ndarray:
    """The operand's elements as float32, the precision every engine computes in."""
    return tensor._array().astype(np.float32)


def _mark_psum(dst: NkiTensor, by_matmul: bool) -> None:
    if dst.buffer is MemoryRegion.psum:
        dst._view_of(dst._storage.matmul_written)[...] = by_matmul


def _is_16bit(*tensors: NkiTensor) -> bool:
    return all(t.dtype in (dtypes.bfloat16, dtypes.float16) for t in tensors)


def _operand(value, partitions: int, what: str):
    """A scalar, or a [P, 1] tensor broadcast along the free dimension (scale and bias of activation)."""
    if isinstance(value, NkiTensor):
        require(value.shape[0] == partitions and value._free_size == 1, "elementwise-shape",
                lambda: f"{what} {value.shape}")
        return _values(value).reshape(partitions, 1)
    return np.float32(value)


# -- data movement ------------------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src between HBM and SBUF, through float32 when the dtypes differ."""
    for what, tensor in (("dst", dst), ("src", src)):
        require(tensor.buffer is not MemoryRegion.psum, "dma-no-psum", lambda: f"dma_copy {what} is in PSUM")
    require(dst.size == src.size, "dma-element-count", lambda: f"dst {dst.shape} and src {src.shape}")
    if _computing():
        dst._write(src._array().astype(np.float32) if src.dtype != dst.dtype else src._array())
    on_chip = dst if dst._on_chip else src
    itemsize = max(dst.dtype.itemsize, src.dtype.itemsize)
    run = min(dst._contiguous_elements(), src._contiguous_elements())
    _run().record(
        Instruction(
            "dma_copy",
            "dma",
            reads=(_access(src),),
            writes=(_access(dst),),
            size=src.size * itemsize,
            partitions=on_chip.shape[0] if on_chip._on_chip else PMAX,
            run_bytes=run * itemsize,
            hbm_read=0 if src._on_chip else src.size * src.dtype.itemsize,
            hbm_write=0 if dst._on_chip else dst.size * dst.dtype.itemsize,
        )
    )


# -- Tensor engine ------------------------------------------------------------------------------------------
def nc_matmul(
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    tile_position=(),
    tile_size=(),
    perf_mode=matmul_perf_mode.none,
    name=None,
):
    """dst (PSUM, float32) = stationary.T @ moving, or += when accumulating (see `accumulate`).

    accumulate=False overwrites, True adds onto earlier nc_matmul results, None (default) adds where an
    earlier nc_matmul wrote and overwrites elsewhere (nki.isa.nc_matmul).
    """
    if is_transpose or tile_position or tile_size or perf_mode is not matmul_perf_mode.none:
        raise NotImplementedError("the emulator implements plain nc_matmul (no transpose, tiling or perf modes)")
    require(stationary.buffer is MemoryRegion.sbuf, "matmul-operands-sbuf",
            lambda: f"stationary is in {stationary.buffer.value}")
    require(moving.buffer is MemoryRegion.sbuf, "matmul-operands-sbuf", lambda: f"moving is in {moving.buffer.value}")
    require(dst.buffer is MemoryRegion.psum, "matmul-dst-psum", lambda: f"dst is in {dst.buffer.value}")
    for what, tensor in (("stationary", stationary), ("moving", moving), ("dst", dst)):
        _check_compute_operand(tensor, what, _Engine.tensor)
    contraction, stationary_free, moving_free = stationary.shape[0], stationary._free_size, moving._free_size
    require(moving.shape[0] == contraction, "matmul-contraction",
            lambda: f"stationary {stationary.shape}, moving {moving.shape}")
    require(stationary_free <= STATIONARY_FMAX, "matmul-stationary-fmax", lambda: f"stationary {stationary.shape}")
    require(moving_free <= MOVING_FMAX, "matmul-moving-fmax", lambda: f"moving {moving.shape}")
    require(
        dst.shape[0] == stationary_free and dst._free_size == moving_free,
        "matmul-dst-shape",
        lambda: f"dst {dst.shape} for stationary {stationary.shape} and moving {moving.shape}",
    )
    require(dst.dtype == dtypes.float32, "matmul-dtype", lambda: f"dst is {dst.dtype}")
    for what, tensor in (("stationary", stationary), ("moving", moving)):
        require(tensor.dtype in dtypes.MATMUL_INPUTS, "matmul-dtype", lambda: f"{what} is {tensor.dtype}")
    fp32 = (stationary.dtype == dtypes.float32, moving.dtype == dtypes.float32)
    require(fp32[0] == fp32[1], "matmul-dtype", lambda: f"stationary {stationary.dtype} with moving {moving.dtype}")
    bank = _run().core.psum_bank_bytes
    low, high = dst._byte_range()  # PSUM storages start at a bank boundary
    require(low // bank == (high - 1) // bank, "psum-bank",
            lambda: f"dst {dst.shape} spans bytes {low}..{high} of its PSUM tensor")

    written = dst._view_of(dst._storage.matmul_written)
    if accumulate is None:
        adds = written.copy()
        accumulating = bool(adds.any())
    else:
        adds = bool(accumulate)
        accumulating = adds
        if accumulate:
            require(bool(written.all()), "psum-accumulate",
                    lambda: f"accumulate=True onto dst {dst.shape} not written by nc_matmul")
    if _computing():
        product = _values(stationary).reshape(contraction, -1).T @ _values(moving).reshape(contraction, -1)
        product = product.reshape(dst.shape)
        dst._write(np.where(adds, _values(dst) + product, product) if accumulating else product)
    written[...] = True
    _run().record(
        Instruction(
            "nc_matmul",
            "pe",
            reads=(_access(stationary), _access(moving)) + ((_access(dst),) if accumulating else ()),
            writes=(_access(dst),),
            size=moving_free,
            fp32=fp32[0],
            flops=2 * contraction * stationary_free * moving_free,
        )
    )


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst = data.T (free dimensions flattened); TensorE: SBUF -> PSUM, <= 128x128; VectorE: <= 32x32."""
    partitions, free = data.shape[0], data._free_size
    on = engine
    if on is _Engine.unknown:
        on = _Engine.vector if max(partitions, free) <= VECTOR_TRANSPOSE_MAX else _Engine.tensor
    limit = PMAX if on is _Engine.tensor else VECTOR_TRANSPOSE_MAX
    require(partitions <= limit and free <= limit, "transpose-size", lambda: f"data {data.shape} on {on.name}")
    if on is _Engine.tensor:
        require(data.buffer is MemoryRegion.sbuf, "transpose-buffers", lambda: f"data is in {data.buffer.value}")
        require(dst.buffer is MemoryRegion.psum, "transpose-buffers", lambda: f"dst is in {dst.buffer.value}")
    for what, tensor in (("data", data), ("dst", dst)):
        _check_compute_operand(tensor, what, on)
    require(dst.dtype == data.dtype, "transpose-dtype", lambda: f"dst is {dst.dtype}, data is {data.dtype}")
    require(
        dst.shape[0] == free and dst._free_size == partitions,
        "elementwise-shape",
        lambda: f"transpose of {data.shape} into {dst.shape}",
    )
    if _computing():
        dst._array()[...] = data._array().reshape(partitions, free).T.reshape(dst.shape)
    _mark_psum(dst, by_matmul=False)
    if on is _Engine.tensor:
        # TensorE multiplies `data` (stationary) by an identity (moving) of `partitions` columns.
        record = Instruction("nc_transpose", "pe", (_access(data),), (_access(dst),), size=partitions,
                             fp32=data.dtype == dtypes.float32, transpose=True)
    else:
        record = Instruction("nc_transpose", "dve", (_access(data),), (_access(dst),), size=free,
                             psum=MemoryRegion.psum in (data.buffer, dst.buffer))
    _run().record(record)


# -- Scalar, Vector and GpSimd engines ----------------------------------------------------------------------
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, name=None):
    """dst = op(data * scale + bias) on the Scalar engine, in float32, cast to dst's dtype."""
    if reduce_op is not None or reduce_res is not None:
        raise NotImplementedError("the emulator implements activation without its reduction")
    for what, tensor in (("data", data), ("dst", dst)):
        _check_compute_operand(tensor, what, _Engine.scalar)
    _same_layout(data, dst, "activation data and dst")
    partitions = data.shape[0]
    if bias is not None and not isinstance(bias, NkiTensor):
        require(get_nc_version() is not nc_version.gen2, "activation-bias", f"bias={bias!r} on trn1")
    if _computing():
        x = _values(data).reshape(partitions, -1) * _operand(scale, partitions, "scale")
        if bias is not None:
            x = x + _operand(bias, partitions, "bias")
        dst._write(op.function(x.astype(np.float32)))
    _mark_psum(dst, by_matmul=False)
    reads = (_access(data),) + tuple(_access(t) for t in (bias, scale) if isinstance(t, NkiTensor))
    _run().record(
        Instruction("activation", "act", reads, (_access(dst),), size=data._free_size,
                    psum=MemoryRegion.psum in (data.buffer, dst.buffer))
    )


def _elementwise_engine(requested: _Engine) -> _Engine:
    return _Engine.vector if requested is _Engine.unknown else requested


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = op(data1, data2) element-wise on the Vector (or GpSimd) engine, in float32."""
    on = _elementwise_engine(engine)
    require(on in (_Engine.vector, _Engine.gpsimd), "engine-memory", lambda: f"tensor_tensor on {on.name}")
    for what, tensor in (("data1", data1), ("data2", data2), ("dst", dst)):
        _check_compute_operand(tensor, what, on)
    require(
        not (data1.buffer is MemoryRegion.psum and data2.buffer is MemoryRegion.psum),
        "tensor-tensor-psum",
        "data1 and data2 are both in PSUM",
    )
    _same_layout(data1, dst, "tensor_tensor data1 and dst")
    _same_layout(data2, dst, "tensor_tensor data2 and dst")
    if _computing():
        dst._write(op.function(_values(data1).reshape(dst.shape), _values(data2).reshape(dst.shape)))
    _mark_psum(dst, by_matmul=False)
    sbuf_inputs = data1.buffer is MemoryRegion.sbuf and data2.buffer is MemoryRegion.sbuf
    _run().record(
        Instruction(
            "tensor_tensor",
            "dve" if on is _Engine.vector else "pool",
            (_access(data1), _access(data2)),
            (_access(dst),),
            size=dst._free_size,
            inputs=2,
            vector_gain=2 if sbuf_inputs and _is_16bit(data1, data2, dst) else 1,
            psum=MemoryRegion.psum in (data1.buffer, data2.buffer, dst.buffer),
        )
    )


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """dst = src on the Vector (default), Scalar or GpSimd engine; through float32 when dtypes differ."""
    on = _elementwise_engine(engine)
    require(
        not (on is _Engine.scalar and get_nc_version() is nc_version.gen2),
        "scalar-copy-gen2",
        "tensor_copy(engine=scalar) on trn1",
    )
    for what, tensor in (("src", src), ("dst", dst)):
        _check_compute_operand(tensor, what, on)
    _same_layout(src, dst, "tensor_copy src and dst")
    if _computing():
        dst._write(src._array() if src.dtype == dst.dtype else _values(src))
    _mark_psum(dst, by_matmul=False)
    in_psum = MemoryRegion.psum in (src.buffer, dst.buffer)
    contiguous = src._contiguous_elements() == src._free_size and dst._contiguous_elements() == dst._free_size
    gain = 1
    if _is_16bit(src, dst):
        gain = 4 if contiguous and not in_psum else 2
    _run().record(
        Instruction(
            "tensor_copy",
            {_Engine.vector: "dve", _Engine.scalar: "act", _Engine.gpsimd: "pool"}[on],
            (_access(src),),
            (_access(dst),),
            size=dst._free_size,
            vector_gain=gain if on is _Engine.vector else 1,
            psum=in_psum,
        )
    )


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst with a compile-time constant on the Vector (default) or GpSimd engine."""
    on = _elementwise_engine(engine)
    _check_compute_operand(dst, "dst", on)
    if dtypes.is_float(dst.dtype):
        require(isinstance(value, (int, float)), "memset-value", lambda: f"{value!r} into {dst.dtype}")
    else:
        require(isinstance(value, (int, np.integer)), "memset-value", lambda: f"{value!r} into {dst.dtype}")
    if _computing():
        dst._array()[...] = value
    _mark_psum(dst, by_matmul=False)
    _run().record(
        Instruction("memset", "dve" if on is _Engine.vector else "pool", (), (_access(dst),),
                    size=dst._free_size, inputs=0, psum=dst.buffer is MemoryRegion.psum)
    )


__all__ = [
    "NkiValidationError",
    "activation",
    "dge_mode",
    "dma_copy",
    "engine",
    "get_nc_version",
    "matmul_perf_mode",
    "memset",
    "nc_matmul",
    "nc_transpose",
    "nc_version",
    "oob_mode",
    "tensor_copy",
    "tensor_tensor",
]
