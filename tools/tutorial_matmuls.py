"""The DMA model against measurements: three schedules of AWS's NKI matmul tutorial, modelled on trn1.

    python tools/tutorial_matmuls.py [--issue-ns 0,1300] [--overhead-ns curve,0,12,25]

AWS measured its matmul tutorial's kernels, bf16 [4096,8192] @ [8192,8192] on trn1.32xlarge with
nki.benchmark (p99): the tiled kernel 51.80 ms, with hoisted loads 42.96 ms, with a blocked free dimension
22.07 ms, fully optimized 6.97 ms (general/nki/tutorials/matrix_multiplication.rst at aws-neuron-sdk
commit ce3668bf, SDK 2.20; removed from the docs in db1586c3). The first three move 256-byte rows of x^T
tiles per partition in their inner loops, so they are what prices small DMA transfers; the last moves
>= 2 KiB rows (the repository's dense_matmul_lhsT, with the tutorial's block sizes, stands in for it).

The schedules below are this project's own NKI code for the loop nests the tutorial describes in words
(tile sizes named as there). The script traces each (trace-only emulation) and models it with each
per-queue issue interval and per-descriptor DMA overhead asked for (hardware.TRN1 uses 1300 ns and 12 ns),
printing modelled time / measured time. Every time is modelled.
"""

from __future__ import annotations

import argparse
import dataclasses

from onnx_nmm.kernels import dense_matmul_lhsT
from onnx_nmm.kernels.emulator import Placeholder, emulation, jit
from onnx_nmm.kernels.emulator import isa as nisa
from onnx_nmm.kernels.emulator import language as nl
from onnx_nmm.kernels.pricing.blocking import DensePlan
from onnx_nmm.kernels.pricing.cost_model import model_trace
from onnx_nmm.kernels.pricing.hardware import TRN1

K, M, N = 8192, 4096, 8192  # lhsT [K, M] @ rhs [K, N]
TILE_K, TILE_M, TILE_N = 128, 128, 512  # contraction partitions, stationary free size, moving free size
MEASURED_MS = {"tiled": 51.80, "hoisted loads": 42.96, "blocked free dimension": 22.07, "fully optimized": 6.97}


def _evict_and_store(acc, out, m, n):
    tile = nl.ndarray((TILE_M, TILE_N), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile, src=acc)
    nisa.dma_copy(dst=out[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=tile)


def _load(src, rows, columns):
    tile = nl.ndarray((TILE_K, columns.stop - columns.start), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src[rows, columns])
    return tile


def _k_rows(k):
    return slice(k * TILE_K, (k + 1) * TILE_K)


@jit
def tiled(lhsT, rhs):
    """Every output tile loads its two operand tiles for every contraction step."""
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        for n in range(N // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                left = _load(lhsT, _k_rows(k), slice(m * TILE_M, (m + 1) * TILE_M))
                right = _load(rhs, _k_rows(k), slice(n * TILE_N, (n + 1) * TILE_N))
                nisa.nc_matmul(dst=acc, stationary=left, moving=right)
            _evict_and_store(acc, out, m, n)
    return out


@jit
def hoisted_loads(lhsT, rhs):
    """An output row of tiles loads its x^T tiles once; the weight tiles still stream per output tile."""
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        left = [_load(lhsT, _k_rows(k), slice(m * TILE_M, (m + 1) * TILE_M)) for k in range(K // TILE_K)]
        for n in range(N // TILE_N):
            right = [_load(rhs, _k_rows(k), slice(n * TILE_N, (n + 1) * TILE_N)) for k in range(K // TILE_K)]
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                nisa.nc_matmul(dst=acc, stationary=left[k], moving=right[k])
            _evict_and_store(acc, out, m, n)
    return out


TILES_IN_BLOCK_M, TILES_IN_BLOCK_N = 16, 2  # the blocked kernel's block of output tiles


@jit
def blocked_free_dimension(lhsT, rhs):
    """Blocks of output tiles: a block's weight tiles are loaded once and reused by all its row tiles."""
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    block_m, block_n = TILES_IN_BLOCK_M * TILE_M, TILES_IN_BLOCK_N * TILE_N
    for n0 in range(0, N, block_n):
        for m0 in range(0, M, block_m):
            right = [_load(rhs, _k_rows(k), slice(n0, n0 + block_n)) for k in range(K // TILE_K)]
            for m in range(m0 // TILE_M, (m0 + block_m) // TILE_M):
                left = [_load(lhsT, _k_rows(k), slice(m * TILE_M, (m + 1) * TILE_M)) for k in range(K // TILE_K)]
                for n in range(n0 // TILE_N, (n0 + block_n) // TILE_N):
                    acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in range(K // TILE_K):
                        nisa.nc_matmul(dst=acc, stationary=left[k],
                                       moving=right[k][:, (n * TILE_N - n0):(n * TILE_N - n0) + TILE_N])
                    _evict_and_store(acc, out, m, n)
    return out


def fully_optimized(lhsT, rhs):
    """The tutorial's block sizes (BLOCK_M 2048, BLOCK_N 1024, BLOCK_K 1024) on dense_matmul_lhsT."""
    return dense_matmul_lhsT(lhsT, rhs, plan=DensePlan(m_stripe=M, m_block=2048, n_block=1024, k_tiles=8))


SCHEDULES = {"tiled": tiled, "hoisted loads": hoisted_loads, "blocked free dimension": blocked_free_dimension,
             "fully optimized": fully_optimized}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead-ns", default="curve,0,25,50,100",
                        help="DMA overheads per descriptor to model, in ns, or 'curve' for the figure's "
                        "efficiency curve (default: %(default)s)")
    parser.add_argument("--issue-ns", default="0,650,1300",
                        help="DMA issue intervals per queue to model, in ns (default: %(default)s)")
    args = parser.parse_args()
    settings = [(float(issue), None if overhead == "curve" else float(overhead))
                for issue in args.issue_ns.split(",") for overhead in args.overhead_ns.split(",")]
    traces = {}
    for name, kernel in SCHEDULES.items():
        with emulation("trn1", trace_only=True) as session:
            kernel(Placeholder((K, M), "bfloat16"), Placeholder((K, N), "bfloat16"))
        (traces[name],) = session.traces
    print(f"bf16 lhsT [{K},{M}] @ [{K},{N}] on trn1: modelled / measured (1.00 is the measurement)\n")
    print("| issue interval | descriptor overhead | " + " | ".join(f"{n} ({MEASURED_MS[n]} ms)" for n in SCHEDULES)
          + " |")
    print("|---:|---:|" + "---:|" * len(SCHEDULES))
    for issue, overhead in settings:
        core = dataclasses.replace(TRN1, dma_issue_interval_s=issue * 1e-9,
                                   dma_descriptor_overhead_s=None if overhead is None else overhead * 1e-9)
        ratios = [model_trace(traces[name], core).total_s * 1e3 / MEASURED_MS[name] for name in SCHEDULES]
        per_descriptor = "figure's curve" if overhead is None else f"{overhead:.0f} ns"
        print(f"| {issue:.0f} ns | {per_descriptor} | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")


if __name__ == "__main__":
    main()
