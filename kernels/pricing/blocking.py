"""Block sizes for the kernels, chosen by pricing every candidate plan with the cost model's own formulas.

estimate_plan counts what a kernel's loop nest does under a plan — every matmul, transpose, PSUM eviction
and DMA transfer, with its size and contiguous run — and prices each one with instruction_costs, the
formulas cost_model applies to a traced kernel. The helpers below follow the kernels' loop nests call for
call (dense_matmul.output_block and stripe_block, strip_stages, fused_mlp.act_down_strip, dense_mlp, tiles),
so for any plan the estimate's busy time per engine and its HBM bytes are those cost_model finds in the kernel's trace
(tests/kernels/test_planner_agrees_with_trace.py). Nothing is traced here: kernels plan while NKI builds
them, on Trainium too, where there is no emulator.

Two figures are the planner's own. SBUF bytes per partition count every live tile, loop-local ones twice
(the next is loaded while the current one is used): at least the emulator's peak. The overlapped time is an
estimate, since cost_model plays the instructions as an event-driven schedule that no closed form
reproduces: DMA runs ahead of compute through the loop nests, each nest pipelines its own loads and compute
(_Work.pipelined), each HBM tensor's transfers are an issue interval apart, and the kernel takes the longest
path through the two streams (_overlapped_seconds).

plan_dense, plan_xuv, plan_mlp, plan_ungated_mlp and plan_dense_mlp price every candidate blocking of the shape
on the target. A candidate
that does not fit SBUF (less the compiler's reserve) is out; of the rest the fastest wins, estimates within
TIE of it counting as a tie that the fewest HBM bytes, then the least SBUF, break. Bigger blocks raise
arithmetic intensity (fewer re-reads of
x and the weights) until SBUF runs out — the trade-off NeuronMM's Eq. 10/11 describe — and the decision is
made per shape and per target, not looked up from a table.
"""

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nl
from onnx_nmm.kernels.nki_kernels.tiles import (
    HALF_BANK,
    PMAX,
    PSUM_BANK_BYTES,
    TILE_M,
    TILE_N,
    cdiv,
    column_pieces,
    dtype_bytes,
    k_blocks,
    ramped_k_blocks,
    row_pieces,
)
from onnx_nmm.kernels.pricing.hardware import TRN1, TRN2, neuron_core
from onnx_nmm.kernels.pricing.instruction_costs import (
    dma_seconds,
    elementwise_seconds,
    takes_psum_port,
    tensor_engine_seconds,
)

# nki-library leaves 16 KiB + 264 B of each SBUF partition to the compiler (DMA scratch, reserved locations,
# transpose identity): MAX_AVAILABLE_SBUF_SIZE = 224*1024 - 16384 - 8 - 256 in
# nki-library src/nkilib_src/nkilib/core/mlp/mlp_cte/mlp_cte_constants.py.
SBUF_RESERVE_BYTES = 16384 + 8 + 256

# Estimated times this close (relative) are a tie when choosing a plan: the overlapped time is an estimate.
TIE = 0.005

# Within a loop nest compute and DMA overlap as the 4-norm of their times rather than their max: of two plans
# with the same bottleneck, the one whose other stream has more slack wins.
CONTENTION_NORM = 4

BLOCK_TILES = (1, 2, 4, 8, 16)  # contraction tiles per block
COLUMN_BLOCKS = (512, 1024, 2048, 4096, 8192)  # output columns per weight block
W_PIECE = 1024  # dense_matmul_lhsT's columns of w per load when it loads a block in pieces (2 KiB runs in bf16)
ROW_BLOCKS = (128, 256, 512, 1024, 2048)  # rows of x per lhsT block (dense)
TOKEN_BLOCKS = (128, 256, 512, 1024, 2048, 4096, 8192)  # tokens per cached strip / output stripe
PSUM_BANKS = TRN1.psum_banks  # 16 KiB per partition in 2 KiB banks, on trn1 and trn2 alike
# PSUM banks one output block of dense_matmul may hold: its x^T transposes take turns in the others
OUTPUT_BANKS = 6
# PSUM groups TensorE may run ahead of the engines emptying PSUM: the banks a kernel's loops rotate through,
# less those its long-lived sums hold
PSUM_LAG = 4
# Narrowest piece of columns dense_matmul's column groups multiply at once: a matmul costs TensorE at least
# 64 cycles (MM_INIT_LATENCY), the time of 64 moving columns
MIN_PIECE = 64
# First w blocks from this size on are ramped up (contraction_blocks): 1 MiB takes 2.9 / 3.9 us on trn2 / trn1,
# several times a transfer's 1.3 us issue interval
RAMP_BYTES = 1 << 20
# Loads of Wd's rows in dense_mlp's streamed down projection: at most this many bytes per partition (runs long
# enough for the DMA's full rate, hardware.dma_efficiency, yet loaded while TensorE still makes actᵀ), and at
# least DOWN_LOADS per block of I (down_tiles_per_load)
DOWN_LOAD_BYTES = 16 * 1024
DOWN_LOADS = 4

KERNELS = ("dense_matmul", "dense_matmul_lhsT", "fused_xuv", "fused_svd_mlp", "fused_svd_ungated_mlp",
           "dense_gated_mlp", "dense_ungated_mlp")
MLP_KERNELS = ("fused_svd_mlp", "fused_svd_ungated_mlp")
DENSE_MLP_KERNELS = ("dense_gated_mlp", "dense_ungated_mlp")
ENGINES = ("pe", "act", "dve", "dma")  # the engines the kernels use


@dataclass
class OutputBlockPlan(nl.NKIObject):
    m_block: int  # output rows per block, whose x^T stays in SBUF for every column block
    n_block: int  # output columns per block: the block is m_block/128 x n_block/512 PSUM banks
    k_tiles: int  # 128-row contraction tiles per w block
    # once a row block's x^T is made, its blocks sum in all of PSUM, the first narrowed (output_column_blocks)
    all_psum: bool = False


@dataclass
class DensePlan(nl.NKIObject):
    m_stripe: int  # output rows whose fp32 partial sums stay in SBUF while w streams
    m_block: int  # rows of x^T per block (the tutorial's BLOCK_M)
    n_block: int  # output columns per w block (BLOCK_N)
    k_tiles: int  # 128-row contraction tiles per block (TILES_IN_BLOCK_K)
    w_piece: int | None = None  # w columns per load within a contraction block (None: the whole block at once)


@dataclass
class XuvPlan(nl.NKIObject):
    token_block: int  # tokens per cached strip
    k_tiles: int  # contraction tiles per block in stage 1
    n_block: int  # output columns per V block in stage 2


@dataclass
class MlpPlan(nl.NKIObject):
    token_block: int  # tokens per cached strip
    k_tiles: int  # contraction tiles (over H) per block for the gate and up strips
    i_tiles: int  # tiles of the intermediate dimension per gate/up block (actᵀ block)
    down_tiles: int  # tiles of I per Ud load in the down projection's stage 1
    n_block: int  # output columns per Vd block


@dataclass
class DenseMlpPlan(nl.NKIObject):
    token_block: int  # tokens whose x^T and fp32 sums of y stay in SBUF while the weights stream
    k_tiles: int  # contraction tiles (over H) per block of the gate and up weights
    i_tiles: int  # tiles of the intermediate dimension per block (actᵀ block, Wd rows)


@dataclass(frozen=True)
class PlanEstimate:
    """The planner's model of one kernel launch under a plan.

    busy_s and the HBM bytes equal what cost_model finds in the launch's trace; sbuf_bytes is at least the
    trace's peak; total_s estimates cost_model's overlapped time.
    """

    busy_s: dict[str, float]  # seconds each engine works (ENGINES); "dma" is the queues' work / their number
    hbm_read_bytes: int
    hbm_write_bytes: int
    sbuf_bytes: int  # per partition
    total_s: float

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes


def kernel_core():
    """The NeuronCore the kernel is being built for (trn1 for NeuronCore-v2, else trn2)."""
    return TRN1 if nisa.get_nc_version() == nisa.nc_version.gen2 else TRN2


def plan_dense(M, K, N, dtype, transposed_input=False, target=None):
    """The blocking of dense_matmul (transposed_input=False: an OutputBlockPlan) or of the tutorial's
    dense_matmul_lhsT (a DensePlan) for this shape."""
    return _fastest("dense_matmul_lhsT" if transposed_input else "dense_matmul", (M, K, N), dtype, target)


def plan_xuv(M, K, rank, N, dtype, target=None):
    """The blocking of fused_xuv: tokens per strip, contraction tiles of stage 1, V columns of stage 2."""
    return _fastest("fused_xuv", (M, K, rank, N), dtype, target)


def plan_mlp(M, H, intermediate, rank_gate, rank_up, rank_down, dtype, target=None):
    """The blocking of fused_svd_mlp: tokens per strip, then the blocks of each step."""
    return _fastest("fused_svd_mlp", (M, H, intermediate, rank_gate, rank_up, rank_down), dtype, target)


def plan_ungated_mlp(M, H, intermediate, rank_1, rank_2, dtype, target=None):
    """The blocking of fused_svd_ungated_mlp: the same steps as fused_svd_mlp's, without the up."""
    return _fastest("fused_svd_ungated_mlp", (M, H, intermediate, rank_1, rank_2), dtype, target)


def plan_dense_mlp(M, H, intermediate, gated, dtype, target=None):
    """The blocking of dense_gated_mlp (gated) or dense_ungated_mlp: tokens per block, then the blocks of H and
    of I."""
    return _fastest("dense_gated_mlp" if gated else "dense_ungated_mlp", (M, H, intermediate), dtype, target)


def plan_blocks(kernel, shape, dtype, target=None):
    """The blocking of any of KERNELS on `shape`, the dimensions candidate_plans names."""
    _check_kernel(kernel)
    return _fastest(kernel, shape, dtype, target)


def candidate_plans(kernel, shape):
    """Every blocking the planner considers for `kernel` (one of KERNELS) on `shape`, the dimensions plan_*
    takes: (M, K, N) for the dense kernels, (M, K, rank, N) for fused_xuv, (M, H, I, rg, ru, rd) for
    fused_svd_mlp, (M, H, I, r1, r2) for fused_svd_ungated_mlp, (M, H, I) for the dense MLPs."""
    if kernel == "dense_matmul":  # blocks summed in PSUM, and larger ones
        M, K, N = shape
        in_psum = {(min(rows * TILE_M, M), min(pieces * TILE_N, N)) for rows in range(1, OUTPUT_BANKS + 1)
                   for pieces in range(1, OUTPUT_BANKS // rows + 1)}
        larger = {(m, n) for m in _clipped(ROW_BLOCKS, M) for n in _clipped(COLUMN_BLOCKS + (N,), N)}
        # all of PSUM after the first block (output_column_blocks), in blocks of 2 tiles and more: one-tile blocks of
        # w there move too few bytes per transfer for w's queue, whose transfers start an issue interval apart
        return [OutputBlockPlan(m, n, k, all_psum) for m, n in sorted(in_psum | larger) for k in _contraction_tiles(K)
                for all_psum in (False, *((True,) if k > 1 and psum_after_first(m, n, N, column_groups(m, n, N))
                                          else ()))]
    if kernel in DENSE_MLP_KERNELS:
        # above 128 tokens a block of I sums over all of H before its first activation, its gate and up columns
        # all in SBUF at once: contraction blocks of one tile would only double their transfers (each tensor's
        # an issue interval apart)
        M, H, intermediate = shape
        return [DenseMlpPlan(tokens, k, i) for tokens in _clipped(TOKEN_BLOCKS, M) for k in _contraction_tiles(H)
                if k > 1 or tokens <= PMAX or H <= PMAX
                for i in _clipped(BLOCK_TILES + (32, 64), max(1, intermediate // PMAX))]
    if kernel == "fused_xuv":
        M, K, _, N = shape
        return [XuvPlan(tokens, k, n) for tokens in _clipped(TOKEN_BLOCKS, M) for k in _contraction_tiles(K)
                for n in _clipped(COLUMN_BLOCKS, N)]
    if kernel in MLP_KERNELS:
        M, H, intermediate = shape[:3]
        return [MlpPlan(tokens, k, i, d, n) for tokens in _clipped(TOKEN_BLOCKS, M) for k in _contraction_tiles(H)
                for i in _clipped(BLOCK_TILES + (32,), max(1, intermediate // PMAX)) for d in _clipped(BLOCK_TILES, i)
                for n in _clipped(COLUMN_BLOCKS, H)]
    _check_kernel(kernel)  # dense_matmul_lhsT
    # w whole per contraction block, or in pieces of W_PIECE columns; in pieces, blocks of 6 tiles besides (a
    # smaller first load, at a VectorE pass over the stripe's partial sums per block, which 6 tiles' matmuls still
    # cover on trn1; whole blocks of 6 leave VectorE too little slack)
    M, K, N = shape
    pieces = [(k, None) for k in _contraction_tiles(K)] + [
        (k, W_PIECE) for k in sorted({*_contraction_tiles(K), min(6, max(1, K // PMAX))})]
    return [DensePlan(stripe, m_block, n, k, piece) for n in _clipped(COLUMN_BLOCKS, N) for k, piece in pieces
            if piece is None or n > piece
            for m_block in _clipped(ROW_BLOCKS, M) for stripe in _clipped(TOKEN_BLOCKS, M)
            if stripe >= m_block and (stripe % m_block == 0 or stripe == M)]


def estimate_plan(kernel, shape, plan, dtype, target=None) -> PlanEstimate:
    """The planner's model of `kernel` (one of KERNELS) run with `plan` on `shape` (see candidate_plans) in
    `dtype`, on `target` ("trn1", "trn2" or a NeuronCore; by default the one the kernel is being built for)."""
    _check_kernel(kernel)
    core = neuron_core(target) if target is not None else kernel_core()
    s = dtype_bytes(dtype)
    if kernel == "fused_xuv":
        M, K, rank, N = shape
        return _estimate([
            (count, [_project_work(tokens, K, (rank,), s, core, plan.k_tiles, _tiles(rank) * min(plan.n_block, N) * s),
                     _expand_work(tokens, rank, N, s, core, plan.n_block)])
            for tokens, count in _spans(M, plan.token_block)
        ], core)
    if kernel in MLP_KERNELS:
        M, H, intermediate, *ranks = shape  # (gate, up, down) or (fc1, fc2)
        first_columns = PMAX * min(plan.i_tiles, intermediate // PMAX) if intermediate >= PMAX else intermediate
        first_vd_block = _tiles(ranks[-1]) * min(plan.n_block, H) * s
        prefetched = sum(_tiles(rank) for rank in ranks[:-1]) * first_columns * s + first_vd_block
        return _estimate([
            (count, [_project_work(tokens, H, tuple(ranks[:-1]), s, core, plan.k_tiles, prefetched),
                     _act_down_work(tokens, intermediate, tuple(ranks), s, core, plan.i_tiles, plan.down_tiles,
                                    first_vd_block),
                     _expand_work(tokens, ranks[-1], H, s, core, plan.n_block)])
            for tokens, count in _spans(M, plan.token_block)
        ], core)
    if kernel in DENSE_MLP_KERNELS:
        M, H, intermediate = shape
        gated = kernel == "dense_gated_mlp"
        followed = M > plan.token_block  # each block but the last loads the next one's rows
        # the first block of tokens, which ramps its blocks of I up, then the others
        first = min(plan.token_block, M)
        later = _spans(M - first, plan.token_block)
        token_blocks = [(1, first, True)] + [(count, tokens, False) for tokens, count in later]
        return _estimate([(count, [_dense_mlp_work(tokens, H, intermediate, gated, s, core, plan.k_tiles, plan.i_tiles,
                                                   followed, first_block)])
                          for count, tokens, first_block in token_blocks], core)
    if kernel == "dense_matmul":
        return _estimate(_accumulated_row_blocks(*shape, s, core, plan), core)
    return _estimate([(1, [_stripe_work(*shape, s, core, plan)])], core)


# -- the instructions each loop nest issues --------------------------------------------------------------------
class _Work:
    """The instructions one loop nest issues, priced with instruction_costs, and the SBUF its tiles need.

    The helpers that fill it price `times` identical calls of a kernel step at once. Instructions come in
    PSUM groups that flow through two stages: TensorE fills a bank, then ScalarE/VectorE empty it. TensorE
    runs ahead of the evictions by up to PSUM_LAG groups (the banks the kernels rotate through), so a phase
    whose evictions are slower than its matmuls catches up during one whose matmuls are slower; `chain` is
    when the last group so far has left PSUM, `pe_done` when TensorE finished it.
    """

    def __init__(self, core, s):
        self.core = core
        self.s = s
        self.busy = dict.fromkeys(ENGINES, 0.0)
        self.chain = self.pe_done = 0.0
        self.hbm_read = self.hbm_write = 0
        # DMAs per HBM tensor (each tensor's go through one queue, in order), loads and stores apart
        self.loads, self.stores = Counter(), Counter()
        self.sbuf = 0
        self.steps = 1  # blocks the nest streams through, each loaded then computed
        self.first_load = None  # seconds of the loads the first matmul waits for (None: one step's share)

    def matmuls(self, count, moving):
        return count * tensor_engine_seconds(self.core, moving, fp32=self.s == 4)

    def transposes(self, count, partitions):
        return count * tensor_engine_seconds(self.core, partitions, fp32=self.s == 4, transpose=True)

    def scalar(self, elements):
        """One ScalarE activation (a copy or SiLU) over `elements` per partition."""
        return elementwise_seconds(self.core, "act", elements)

    def vector(self, elements):
        """One VectorE tensor_tensor reading PSUM and SBUF (no performance-mode gain with a PSUM input)."""
        return elementwise_seconds(self.core, "dve", elements, inputs=2)

    def evict(self, elements, first):
        """(ScalarE, VectorE) seconds of tiles.evict_partial_sum: a copy out of PSUM for the first contraction
        block, an fp32 add onto the partial sums for the others."""
        return (self.scalar(elements), 0.0) if first else (0.0, self.vector(elements))

    def memset(self, times, elements):
        """`times` VectorE memsets of `elements` per partition (off the PSUM groups' chain)."""
        self.busy["dve"] += times * elementwise_seconds(self.core, "dve", elements, inputs=0)

    def group(self, times, pe, act=0.0, dve=0.0):
        """`times` PSUM groups, each `pe` seconds of TensorE work emptied by `act` and/or `dve` seconds (in
        turn where ScalarE and VectorE share PSUM's port)."""
        self.busy["pe"] += times * pe
        self.busy["act"] += times * act
        self.busy["dve"] += times * dve
        evict = act + dve if takes_psum_port(self.core, "act", touches_psum=True) else max(act, dve)
        # a two-stage flow of identical groups: the last leaves PSUM after the evictions so far and its own, or
        # after the matmuls up to its bottleneck stage; TensorE waits where it is PSUM_LAG groups ahead
        start = self.pe_done
        self.chain = max(self.chain + times * evict, start + max(times * pe + evict, pe + times * evict))
        self.pe_done = max(start + times * pe, self.chain - PSUM_LAG * evict)

    def wait(self, times, seconds):
        """The PSUM groups stall `seconds`, `times` over: TensorE waits for data another engine is still
        producing, and the engines emptying PSUM then wait for TensorE."""
        self.pe_done += times * seconds
        self.chain = max(self.chain, self.pe_done)

    def load(self, tensor, times, nbytes, run_bytes):
        """`times` DMAs of `nbytes` from the HBM tensor named `tensor`, in contiguous runs of `run_bytes`."""
        self.busy["dma"] += times * dma_seconds(self.core, nbytes, run_bytes)
        self.hbm_read += times * nbytes
        self.loads[tensor] += times

    def store(self, tensor, times, nbytes, run_bytes):
        self.busy["dma"] += times * dma_seconds(self.core, nbytes, run_bytes)
        self.hbm_write += times * nbytes
        self.stores[tensor] += times

    @property
    def compute(self):
        """Seconds of compute: the busiest engine, or the PSUM groups one after another if longer."""
        return max(self.chain, self.busy["pe"], self.busy["act"], self.busy["dve"])

    def pipelined(self):
        """The nest on its own: compute waits for its first block's loads and its last block's compute follows
        its last load. The two streams meet as a 4-norm rather than a max, since neither is smooth."""
        compute, dma = self.compute, self.busy["dma"]
        first_load = dma / self.steps if self.first_load is None else self.first_load
        return _contended(compute + first_load, dma + compute / self.steps)


def _contended(*streams):
    """Streams that run side by side, each held up at times by the other: their CONTENTION_NORM-norm."""
    return sum(t**CONTENTION_NORM for t in streams) ** (1 / CONTENTION_NORM)


def _estimate(token_blocks, core):
    """The PlanEstimate of a kernel that runs `count` times each list of loop nests, one nest after another.
    Its first load and its last store each wait the DMA's fixed latency."""
    return PlanEstimate(
        busy_s={engine: sum(count * work.busy[engine] for count, nests in token_blocks for work in nests)
                for engine in ENGINES},
        hbm_read_bytes=sum(count * work.hbm_read for count, nests in token_blocks for work in nests),
        hbm_write_bytes=sum(count * work.hbm_write for count, nests in token_blocks for work in nests),
        sbuf_bytes=max(work.sbuf for _, nests in token_blocks for work in nests),
        total_s=2 * core.dma_fixed_latency_s + _overlapped_seconds(token_blocks, core.dma_issue_interval_s),
    )


def _overlapped_seconds(token_blocks, issue_interval):
    """Loads depend on nothing the kernel computes, so DMA runs ahead of compute, and the kernel takes its
    longest path that follows the DMA stream up to some nest, goes through that nest's pipeline, and follows
    the compute stream after it (a two-machine flow shop). Along repeats of one token block the longest path
    keeps to the slower stream.

    Each HBM tensor's transfers start one issue interval apart, the tensors' queues side by side, and every
    load can be issued from the start: a nest ends no earlier than its busiest tensor's loads so far allow,
    nor than its stores one interval apart after the loads of the nests before it; a repeated token block
    takes at least its loads' and its stores' intervals one after the other.
    """
    def issue(*counters):
        return issue_interval * max(sum(counters, Counter()).values(), default=0)

    dma = [max(sum(work.busy["dma"] for work in nests),
               issue(*(w.loads for w in nests)) + issue(*(w.stores for w in nests)))
           for _, nests in token_blocks]
    compute = [sum(work.compute for work in nests) for _, nests in token_blocks]
    longest = 0.0
    for g, (count, nests) in enumerate(token_blocks):
        before = sum(n * seconds for (n, _), seconds in zip(token_blocks[:g], dma[:g]))
        after = sum(n * seconds for (n, _), seconds in zip(token_blocks[g + 1 :], compute[g + 1 :]))
        # each repeat streams its own weights again: its first loads come before its compute can start
        steps = max(work.steps for work in nests)
        repeats = (count - 1) * (_contended(dma[g], compute[g]) + min(dma[g], compute[g]) / steps)
        for k, work in enumerate(nests):
            later = sum(w.compute for w in nests[k + 1 :])
            streamed = sum(w.busy["dma"] for w in nests[:k]) + work.pipelined()
            issued = max(issue(*(w.loads for w in nests[:k])) + issue(work.stores),
                         issue(*(w.loads for w in nests[: k + 1])) + work.compute / work.steps)
            longest = max(longest, before + repeats + max(streamed, issued) + later + after)
    return longest


def _accumulated_row_blocks(M, K, N, s, core, plan):
    """dense_matmul, as (how many, loop nests) per kind of row block: the first column block, which makes x^T
    as it goes, then the other column blocks."""
    m_block, n_block = min(plan.m_block, M), min(plan.n_block, N)
    blocks = contraction_blocks(K, plan.k_tiles, n_block, s, first_row_block=True)
    t_max = max(t for _, _, t in blocks)
    groups = column_groups(m_block, n_block, N)
    x_rows = K if m_block <= PMAX else 2 * cdiv(m_block, PMAX) * t_max * PMAX  # whole rows, or a block's columns
    # x^T stays for the later column blocks, and up to 128 tokens it is made at once; else, with one column
    # block, three blocks of it are live at once
    x_width = groups * m_block + groups - 1
    x_T = sum(t for _, _, t in blocks) * x_width if n_block < N or m_block <= PMAX else 3 * t_max * x_width
    x_tiles = (x_T + x_rows) * s
    in_sbuf = len(blocks) > 1 and not all(
        block.in_psum(m_block, groups) for block in output_column_blocks(m_block, n_block, N, groups, plan.all_psum))
    # two sets of fp32 sums, which a row block's column blocks take in turn
    partials = min(2, cdiv(N, n_block)) * cdiv(m_block, TILE_M) * n_block * 4 if in_sbuf else 0
    sbuf = x_tiles + partials + 2 * t_max * n_block * s + 2 * cdiv(m_block, TILE_M) * (n_block // groups) * s

    # the first row block may ramp its contraction blocks up, the others do not (contraction_blocks)
    first_rows = [(m_block, 1, blocks)]
    later_rows = [(rows, count, contraction_blocks(K, plan.k_tiles, n_block, s, first_row_block=False))
                  for rows, count in _spans(M - m_block, plan.m_block)]
    row_blocks = []
    for rows, count, blocks in first_rows + later_rows:
        groups = column_groups(rows, n_block, N)
        first = _Work(core, s)
        whole_rows = rows <= PMAX
        if whole_rows:
            pieces = row_pieces(rows, K, blocks)
            first.load("x", 1, rows * K * s, K // pieces * s)
        for (P, t), kinds in Counter((P, t) for _, P, t in blocks).items():
            _transposed_block(first, kinds, rows, P, t, loaded=whole_rows, groups=groups)
        # the first matmul waits for ScalarE's copy of the last PSUM bank of the first block's transposes
        first.wait(1, _last_transposes_copy(first, blocks[0][2], rows))
        first_columns, *later_columns = output_column_blocks(rows, n_block, N, groups, plan.all_psum)
        _output_block(first, 1, rows, first_columns, blocks, N, groups)
        nests = [first]
        if later_columns:
            later = _Work(core, s)
            for column_block, column_blocks in Counter(block._replace(col0=0) for block in later_columns).items():
                _output_block(later, column_blocks, rows, column_block, blocks, N, groups)
            later.steps = len(later_columns) * len(blocks)
            nests.append(later)
        first.steps = len(blocks)
        for nest in nests:
            nest.sbuf = sbuf
        row_blocks.append((count, nests))
    return row_blocks


def _output_block(work, times, rows, column_block, blocks, N, groups):
    """dense_matmul.output_block after x^T: per contraction block the w block and its matmuls, the block summed
    in PSUM (ColumnBlock.in_psum), its columns in `groups` pieces (then dense_matmul.store_sums: every bank
    copied out by ScalarE) or, larger, in SBUF as dense_matmul_lhsT's stripes are; every 128 partitions
    stored."""
    s = work.s
    cols = column_block.cols
    if not column_block.in_psum(rows, groups):
        _stripe_block(work, times, rows, cols, _kinds([(P, t) for _, P, t in blocks]), rows, N, rows, loads_lhsT=False)
        return
    for (P, t), count in Counter((P, t) for _, P, t in blocks).items():
        _load_interleaved_rows(work, "w", times * count, P, t, cols, whole_rows=cols == N)
    row_tiles = _spans(rows, TILE_M)
    tiles = sum(count for _, count in row_tiles)
    piece = cols // groups
    widths = _spans(piece, TILE_N)
    evictions = sum(count * tiles * work.scalar(nt) for nt, count in widths)
    k_tiles = sum(t for _, _, t in blocks)
    work.group(times, sum(count * work.matmuls(k_tiles * tiles * groups, nt) for nt, count in widths), act=evictions)
    held = psum_banks(rows, cols, groups, column_block.halves)
    if held > OUTPUT_BANKS:
        # all of PSUM: the next block fills its banks in the order these are emptied, so its first matmuls wait
        # for about one bank's eviction
        work.wait(times, evictions / held)
    elif 2 * held > PSUM_BANKS - 1:
        # no room for the next block's banks beside this one's (and a bank of transposes): the next block's
        # matmuls wait for these banks to be emptied
        work.wait(times, evictions)
    if groups > 1:
        work.store("y", times, rows * cols * s, piece * s)
    else:
        _store_row_tiles(work, "y", times, rows, cols)


def psum_banks(rows, cols, groups=1, halves=False):
    """The PSUM banks dense_matmul's output block of rows x cols holds, its columns in `groups` side by side (see
    column_groups): a bank per 128 partitions and 512 columns; with `halves`, a last piece of at most HALF_BANK
    columns shares its bank with the next row tile's (tiles.psum_sums)."""
    row_tiles, piece = cdiv(rows * groups, TILE_M), cols // groups
    whole, rest = divmod(piece, TILE_N)
    if halves and 0 < rest <= HALF_BANK:
        return row_tiles * whole + cdiv(row_tiles, 2)
    return row_tiles * cdiv(piece, TILE_N)


def block_in_psum(rows, cols, groups=1, banks=OUTPUT_BANKS, halves=False):
    """Whether dense_matmul sums an output block of rows x cols over the whole contraction in PSUM, in at most
    `banks` banks (psum_banks), rather than in SBUF."""
    return psum_banks(rows, cols, groups, halves) <= banks


class ColumnBlock(NamedTuple):
    """One of dense_matmul's column blocks of a row block: its columns, the PSUM banks it may sum in, and
    whether two row tiles' last columns (at most HALF_BANK) share a bank."""

    col0: int
    cols: int
    banks: int
    halves: bool

    def in_psum(self, rows, groups):
        return block_in_psum(rows, self.cols, groups, self.banks, self.halves)


def output_column_blocks(rows, n_block, N, groups=1, all_psum=False):
    """dense_matmul's column blocks of a row block (ColumnBlock). A block takes OUTPUT_BANKS while the row
    block's x^T is made (its transposes take turns in the other banks). With `all_psum`, where n_block fits all
    of PSUM but not that, the first block is narrowed to the most columns OUTPUT_BANKS hold (512 tokens: 768,
    two row tiles sharing a bank for their last 256) and the others, x^T made, sum in all PSUM_BANKS: no fp32
    partial sums in SBUF, and w in longer runs than a block of OUTPUT_BANKS would take it in."""
    if not (all_psum and psum_after_first(rows, n_block, N, groups)):
        return [ColumnBlock(c, min(n_block, N - c), OUTPUT_BANKS, False) for c in range(0, N, n_block)]
    first = _first_columns(rows, n_block, groups)
    return [ColumnBlock(0, first, OUTPUT_BANKS, True),
            *(ColumnBlock(c, min(n_block, N - c), PSUM_BANKS, False) for c in range(first, N, n_block))]


def psum_after_first(rows, n_block, N, groups=1):
    """Whether output_column_blocks(all_psum=True) changes dense_matmul's blocks of rows x n_block: they fit
    all of PSUM but not OUTPUT_BANKS, a first block of at least a bank's 512 columns per group still fits (a
    narrower one would take w in short runs), and there are blocks after it."""
    return (n_block < N and _first_columns(rows, n_block, groups) >= TILE_N * groups
            and not block_in_psum(rows, n_block, groups) and block_in_psum(rows, n_block, groups, PSUM_BANKS))


def _first_columns(rows, n_block, groups):
    """The most columns, in steps of HALF_BANK per group and below n_block, whose block fits OUTPUT_BANKS."""
    step = HALF_BANK * groups
    return max((cols for cols in range(step, n_block, step) if block_in_psum(rows, cols, groups, halves=True)),
               default=0)


def contraction_blocks(K, k_tiles, n_block, s, first_row_block):
    """dense_matmul's contraction blocks for a row block: the first row block's ramp up (tiles.ramped_k_blocks)
    when its first w block would otherwise be RAMP_BYTES or more (TensorE would wait for all of it); small
    weights keep the planned blocks, each transfer of a tensor waiting an issue interval after the last."""
    if first_row_block and PMAX * k_tiles * n_block * s >= RAMP_BYTES:
        return ramped_k_blocks(K, k_tiles)
    return k_blocks(K, k_tiles)


def column_groups(rows, n_block, N):
    """How many pieces of each output block's columns dense_matmul multiplies side by side, for a row block of
    `rows` tokens.

    A stationary x^T of a few tokens fills a few of TensorE's 128 columns, so each PSUM bank would hold the
    block's columns for a few partitions only. With g groups, piece q of the block's columns goes to the
    partitions g*i + q (token i), so a block spans g times fewer banks: blocks of few tokens can be g times
    wider, w arrives in g times longer rows, and the block's rows leave PSUM and SBUF over g times more
    partitions. A power of two while the groups' tokens fit 128 partitions, every block divides into pieces
    of at least MIN_PIECE columns, and the blocks are then summed in PSUM; 1 (plain blocks) otherwise.
    """
    groups = 1
    while (2 * groups * rows <= PMAX and N % (2 * groups) == 0 and n_block % (2 * groups) == 0
           and n_block // (2 * groups) >= MIN_PIECE):
        groups *= 2
    return groups if groups > 1 and block_in_psum(rows, n_block, groups) else 1


def _transposed_block(work, times, rows, P, t, loaded, groups):
    """dense_matmul.transposed_block: the block's columns of every 128 rows (tiles.load_row_tiles) unless the
    rows are `loaded` whole, then (with column groups, after VectorE zeroes the tile) per 128 tokens TensorE
    transposes, several to a PSUM bank, each bank copied out by ScalarE."""
    if not loaded:
        _load_row_tiles(work, "x", times, rows, P * t)
    if groups > 1:
        work.memset(times, t * (groups * rows + groups - 1))
    for T, chunks in _spans(rows, PMAX):
        for group, banks in _spans(t, _transposes_per_bank(work.s)):
            work.group(times * chunks * banks, work.transposes(group, T), act=work.scalar(group * T))


def _stripe_work(M, K, N, s, core, plan):
    """dense_matmul_lhsT: one stripe block per stripe of rows and block of columns."""
    work = _Work(core, s)
    blocks = k_blocks(K, plan.k_tiles)
    block_kinds = _kinds([(P, t) for _, P, t in blocks])
    for rows, stripes in _spans(M, plan.m_stripe):
        for cols, column_blocks in _spans(N, plan.n_block):
            _stripe_block(work, stripes * column_blocks, rows, cols, block_kinds, M, N, plan.m_block, loads_lhsT=True,
                          w_piece=plan.w_piece)
    t_max = max(t for _, _, t in blocks)
    m_stripe, m_block, n_block = min(plan.m_stripe, M), min(plan.m_block, M), min(plan.n_block, N)
    row_blocks = cdiv(m_stripe, m_block)
    pieces = column_pieces(n_block, plan.w_piece, first_block=False)
    work.steps = cdiv(M, plan.m_stripe) * cdiv(N, plan.n_block) * len(blocks) * len(pieces) * row_blocks
    # the first matmul waits for the first load of w (a whole block, or its first piece) and the first lhsT block
    _, P, t = blocks[0]
    width = column_pieces(n_block, plan.w_piece, first_block=True)[0][1]
    work.first_load = (dma_seconds(core, P * t * width * s, (t if width == N else 1) * width * s)
                       + dma_seconds(core, P * t * m_block * s, (t if m_block == M else 1) * m_block * s))
    partials = cdiv(m_stripe, TILE_M) * n_block * 4 if len(blocks) > 1 else 0
    # two w blocks in turn and room for a third: SBUF is handed out next-fit, and a w block needs one free range
    # among the lhsT blocks and output rows around it
    work.sbuf = partials + 3 * t_max * n_block * s + 2 * t_max * m_block * s + 2 * n_block * s
    return work


def _stripe_block(work, times, rows, cols, block_kinds, M, N, m_block, loads_lhsT, w_piece=None):
    """dense_matmul.stripe_block: per contraction block the w block (in pieces of `w_piece` columns, if given),
    then per row block its lhsT block (when `loads_lhsT`; dense_matmul's larger output blocks hold x^T already)
    and the matmuls of each 128 x 512 output tile, summed in fp32 in SBUF across the blocks; the last
    contraction block stores the rows, a piece at a time."""
    s = work.s
    for (P, t, first, last), count in block_kinds.items():
        blocks = times * count
        pieces = Counter(width for _, width in column_pieces(cols, w_piece, first))
        for width, n in pieces.items():
            _load_interleaved_rows(work, "w", blocks * n, P, t, width, whole_rows=width == N)
        for m_rows, row_blocks in _spans(rows, m_block):
            if loads_lhsT:
                _load_interleaved_rows(work, "x", blocks * row_blocks, P, t, m_rows, whole_rows=m_rows == M)
            for mt, row_tiles in _spans(m_rows, TILE_M):
                tiles = blocks * row_blocks * row_tiles
                for nt, column_tiles in _spans(cols, TILE_N):
                    work.group(tiles * column_tiles, work.matmuls(t, nt), *work.evict(nt, first))
                for width, n in pieces.items() if last else ():
                    work.store("y", tiles * n, mt * width * s, width * s)


# The fused kernels' loop nests are cached: plan_mlp prices thousands of candidates that share them.
@lru_cache(maxsize=4096)
def _project_work(tokens, K, ranks, s, core, k_tiles, prefetched):
    """strip_stages.project_tokens: per contraction block, x^T (transposed 128 tokens at a time; above 128
    tokens, the next block's midway through this block's matmuls) shared by every U, then each U's block and its
    matmuls into
    the strip, in fp32 partial sums across blocks; the first blocks of the later stages' weights
    (`prefetched` bytes per partition) arrive meanwhile."""
    work = _Work(core, s)
    blocks = k_blocks(K, k_tiles)
    for (P, t, first, _), count in _kinds([(P, t) for _, P, t in blocks]).items():
        _transposed_x(work, count, tokens, P, t, waited_for=first or tokens <= TILE_M)
        for u, rank in enumerate(ranks):
            _load_interleaved_rows(work, f"u{u}", count, P, t, rank, whole_rows=True)
            _accumulate_strip(work, count, rank, t, tokens, first)
    work.steps = len(blocks) * (1 + len(ranks))

    t_max = max(t for _, _, t in blocks)
    strips = sum(_tiles(rank) for rank in ranks) * tokens
    partials = strips * 4 if len(blocks) > 1 else 0
    x_tiles = 2 * t_max * tokens * s + 2 * t_max * PMAX * s  # x^T and the rows it is transposed from
    work.sbuf = strips * s + partials + x_tiles + 2 * t_max * max(ranks) * s + prefetched
    return work


@lru_cache(maxsize=4096)
def _act_down_work(tokens, intermediate, ranks, s, core, i_tiles, down_tiles, first_vd_block):
    """fused_mlp.act_down_strip after the strips: per block of I its actᵀ (gated when `ranks` are the gate's,
    up's and down's; with fc1's bias when they are fc1's and fc2's), then the down projection's stage 1 over
    the block's Ud sub-blocks, in fp32 partial sums across all of them."""
    *inner, rank_down = ranks
    gated = len(inner) == 2
    work = _Work(core, s)
    blocks = k_blocks(intermediate, i_tiles)
    for (P, t), count in Counter((P, t) for _, P, t in blocks).items():
        _act_T(work, count, P, t, tokens, inner[0], bias=not gated)
        if gated:
            _gated_up(work, count, P, t, tokens, inner[1])
    sub_blocks = [(P, min(down_tiles, t - j0)) for _, P, t in blocks for j0 in range(0, t, down_tiles)]
    for (P, tc, first, _), count in _kinds(sub_blocks).items():
        work.load("ud", count, P * tc * rank_down * s, tc * rank_down * s)  # tc whole rows of Ud per partition
        _accumulate_strip(work, count, rank_down, tc, tokens, first)
    work.steps = len(inner) * len(blocks) + len(sub_blocks)

    t_max = max(t for _, _, t in blocks)
    columns = t_max * PMAX
    strips = sum(_tiles(rank) for rank in ranks) * tokens * s
    down_partial = _tiles(rank_down) * tokens * 4 if len(sub_blocks) > 1 else 0
    # actᵀ (double-buffered), and the fp32 act(gate) of a gated MLP or fc1's bias of an ungated one
    act = 2 * t_max * tokens * s + (t_max * tokens * 4 if gated else 2 * t_max * s)
    weights = sum(_tiles(rank) for rank in inner) * columns * s + 2 * min(t_max, down_tiles) * rank_down * s
    work.sbuf = strips + down_partial + act + weights + first_vd_block
    return work


@lru_cache(maxsize=4096)
def _expand_work(tokens, rank, N, s, core, n_block):
    """strip_stages.expand_strip: per block of V's columns, the V block, then per 128-token tile the matmuls
    of each 512-column piece with the strip stationary, and the tile's rows stored (when the block is one
    tile, its whole rows in two halves)."""
    work = _Work(core, s)
    whole_rows = tokens <= TILE_M
    for cols, column_blocks in _spans(N, n_block):
        _load_row_tiles(work, "v", column_blocks, rank, cols)
        for T, token_tiles in _spans(tokens, TILE_M):
            for nt, pieces in _spans(cols, TILE_N):
                work.group(column_blocks * token_tiles * pieces, work.matmuls(_tiles(rank), nt), work.scalar(nt))
            if not whole_rows:
                work.store("y", column_blocks * token_tiles, T * cols * s, cols * s)
    if whole_rows:
        stored = next((n0 + cols for n0 in range(0, N, n_block) for cols in [min(n_block, N - n0)]
                       if n0 < N // 2 <= n0 + cols < N), 0)
        for columns in (stored, N - stored):
            if columns:
                work.store("y", 1, tokens * columns * s, columns * s)
    work.steps = cdiv(N, n_block) * cdiv(tokens, TILE_M)

    results = N * s if whole_rows else 2 * min(n_block, N) * s
    work.sbuf = _tiles(rank) * tokens * s + 2 * _tiles(rank) * min(n_block, N) * s + results
    return work


@lru_cache(maxsize=4096)
def _dense_mlp_work(tokens, H, intermediate, gated, s, core, k_tiles, i_tiles, followed, first_block):
    """dense_mlp._token_blocks for one block of tokens: x^T of every block of H, then per block of I the gate
    (and up) weight blocks and their matmuls with the activation (and the up's product) as they leave PSUM,
    the Wd block, and the down projection's matmuls into fp32 sums of y across the I blocks; the last I
    block stores y. Where another block `followed`, its rows load meanwhile; the `first_block` of more than 128
    tokens ramps its blocks of I up (dense_mlp._token_blocks)."""
    work = _Work(core, s)
    h_blocks = k_blocks(H, k_tiles)
    for T, chunks in _spans(tokens, PMAX):  # dense_mlp._transposed: the rows once, then every block's transposes
        work.load("x", chunks, T * H * s, H * s)
        for (_, t), count in Counter((P, t) for _, P, t in h_blocks).items():
            for group, banks in _spans(t, _transposes_per_bank(s)):
                work.group(chunks * count * banks, work.transposes(group, T), act=work.scalar(group * T))
    work.wait(1, _last_transposes_copy(work, h_blocks[-1][2], tokens))  # the first matmul reads every block
    h_tiles = sum(t for _, _, t in h_blocks)
    projections = ("wg", "wu") if gated else ("w1",)
    i_blocks = (ramped_k_blocks if first_block and tokens > PMAX else k_blocks)(intermediate, i_tiles)
    if sums_in_psum(tokens, H, i_tiles, len(projections)):
        _streamed_mlp_work(work, tokens, H, intermediate, h_blocks, i_blocks, projections)
        return work
    # the first block of I's first sums need every gate block of it, which the gate's queue starts an issue
    # interval apart
    if first_block:
        work.wait(1, core.dma_issue_interval_s * len(h_blocks))
    for (P, t, first, last), count in _kinds([(P, t) for _, P, t in i_blocks]).items():
        for tensor in projections:
            for (kp, kt), h_count in Counter((kp, kt) for _, kp, kt in h_blocks).items():
                _load_interleaved_rows(work, tensor, count * h_count, kp, kt, P * t, whole_rows=P * t == intermediate)
        if not gated:
            work.load("bias", count, P * t * s, t * s)
        _load_interleaved_rows(work, "wd", count, P, t, H, whole_rows=True)
        for _ in range(count):  # one block after another: its down projection's evictions catch up during the next
            for cw, pieces in _spans(tokens, TILE_N):  # block's gate and up
                work.group(t * pieces, work.matmuls(h_tiles, cw), act=work.scalar(cw))
                if gated:
                    work.group(t * pieces, work.matmuls(h_tiles, cw), dve=work.vector(cw))
            for _, token_tiles in _spans(tokens, TILE_M):
                for nt, pieces in _spans(H, TILE_N):
                    work.group(token_tiles * pieces, work.matmuls(t, nt), *work.evict(nt, first))
        if last:
            for T, token_tiles in _spans(tokens, TILE_M):
                work.store("y", count * token_tiles, T * H * s, H * s)
    work.steps = len(h_blocks) + len(i_blocks) * (len(projections) + 1)

    t_max = max(t for _, _, t in i_blocks)
    columns = t_max * PMAX
    x_T = h_tiles * tokens * s
    # a block of I's gate and up columns over all of H, and the next block's first ones loading meanwhile
    kt_max = max(t for _, _, t in h_blocks)
    projected = len(projections) * (h_tiles + kt_max) * columns * s + (0 if gated else 2 * t_max * s)
    # the Wd block, loading while the gate and up blocks are used, and two output rows in turn at the end
    down = t_max * H * s + 2 * H * s
    # actᵀ of the block and the gate's activation of one PSUM bank, two in turn
    act = t_max * tokens * s + (2 * TILE_N * 4 if gated else 0)
    sums = cdiv(tokens, TILE_M) * H * 4 if len(i_blocks) > 1 else 0
    # the token block's rows are gone once x^T is made; the next block's, if any, arrive meanwhile, into room
    # the Wd block leaves while the gate and up blocks are used, or beside them
    rows = cdiv(tokens, PMAX) * H * s
    weights = max(projected + down, (rows if followed else 0) + max(projected, down))
    work.sbuf = x_T + max(rows, act + sums + weights)
    return work


def _streamed_mlp_work(work, tokens, H, intermediate, h_blocks, i_blocks, projections):
    """dense_mlp._streamed_token_block after x^T: per block of I, each projection in turn streams its columns by
    blocks of H with their matmuls (the block's sums in PSUM), actᵀ as they leave it; then per block of I
    Wd's rows, a few I tiles per load, and the matmuls of their weight tiles into y^T (summed over all of I in
    PSUM); at the end y^T copied out, transposed back, copied out again and stored (_store_transposed)."""
    s = work.s
    h_tiles = sum(t for _, _, t in h_blocks)
    gated = len(projections) == 2
    out_tiles = _spans(H, PMAX)
    for (P, t), count in Counter((P, t) for _, P, t in i_blocks).items():
        for tensor in projections:
            for (kp, kt), h_count in Counter((kp, kt) for _, kp, kt in h_blocks).items():
                _load_interleaved_rows(work, tensor, count * h_count, kp, kt, P * t, whole_rows=P * t == intermediate)
        if not gated:
            work.load("bias", count, P * t * s, t * s)
        # the gate's sums leave PSUM (ScalarE) while the up's are made, the up's (VectorE) while the next block's
        # gate's are; a lone projection's next sums wait for these to leave where PSUM has no room for both
        work.group(count, work.matmuls(h_tiles * t, tokens), act=t * work.scalar(tokens))
        if gated:
            work.group(count, work.matmuls(h_tiles * t, tokens), dve=t * work.vector(tokens))
        elif 2 * _psum_banks(t, tokens) > PSUM_BANKS:
            work.wait(count, t * work.scalar(tokens))
    for (P, t), count in Counter((P, t) for _, P, t in i_blocks).items():
        per_load = down_tiles_per_load(t, H, s)
        for d, loads in _spans(t, per_load):
            work.load("wd", count * loads, P * d * H * s, d * H * s)
        work.group(count, work.matmuls(t * cdiv(H, PMAX), tokens))
    for rows, n in out_tiles:
        work.group(n, work.transposes(1, rows), act=work.scalar(tokens) + work.scalar(rows))
    work.store("y", 1, tokens * H * s, H * s)
    work.steps = len(i_blocks) * (len(projections) * len(h_blocks) + 1)

    t_max = max(t for _, _, t in i_blocks)
    kt_max = max(t for _, _, t in h_blocks)
    x_tiles = h_tiles * tokens * s + 2 * H * s  # x^T and the rows it comes from
    # two blocks of each projection's columns, two loads of Wd's rows; actᵀ of all of I, the gate of a block
    weights = 2 * len(projections) * kt_max * PMAX * t_max * s + 2 * down_tiles_per_load(t_max, H, s) * H * s
    act = cdiv(intermediate, PMAX) * tokens * s + (t_max * tokens * 4 if gated else 2 * t_max * s)
    work.sbuf = x_tiles + weights + act + cdiv(H, PMAX) * tokens * s + H * s


def sums_in_psum(tokens, H, i_tiles, projections):
    """Whether dense_mlp keeps every sum of a block of `tokens` in PSUM: first each block of I's gate and up
    (`projections` of them) over all of H, a set of sums per projection; then y^T over all of I ([128, tokens]
    per 128 rows of H) with a bank to spare (the transposes back)."""
    if tokens > TILE_M:
        return False
    return (projections * _psum_banks(i_tiles, tokens) <= PSUM_BANKS
            and _psum_banks(cdiv(H, PMAX), tokens) < PSUM_BANKS)


def down_tiles_per_load(i_tiles, H, s):
    """Tiles of I whose Wd rows dense_mlp's streamed down projection loads at once: rows of H elements of
    `s` bytes, consecutive per partition, up to DOWN_LOAD_BYTES a partition, and a block of I in at least
    DOWN_LOADS loads (the matmuls of one load run while the next arrives, and only the last one's follow the
    kernel's last weight bytes)."""
    return max(1, min(cdiv(i_tiles, DOWN_LOADS), DOWN_LOAD_BYTES // (H * s)))


def _psum_banks(sums, tokens):
    """PSUM banks that `sums` fp32 sums of [128, tokens] take (dense_mlp._psum_tiles)."""
    return cdiv(sums, TILE_N // tokens)


def _act_T(work, times, P, t, tokens, rank, bias):
    """fused_mlp.act_T: the V block (and the bias block), then per I tile and 512-token piece the matmuls
    with the activation on ScalarE as they leave PSUM."""
    _load_row_tiles(work, "v_act", times, rank, P * t)
    if bias:
        work.load("bias", times, P * t * work.s, t * work.s)
    for cw, pieces in _spans(tokens, TILE_N):
        work.group(times * t * pieces, work.matmuls(_tiles(rank), cw), act=work.scalar(cw))


def _gated_up(work, times, P, t, tokens, rank_up):
    """fused_mlp.gated_act_T after the gate: the Vu block, then the up's matmuls times act(gate) on VectorE."""
    _load_row_tiles(work, "v_up", times, rank_up, P * t)
    for cw, pieces in _spans(tokens, TILE_N):
        work.group(times * t * pieces, work.matmuls(_tiles(rank_up), cw), dve=work.vector(cw))


def _accumulate_strip(work, times, rank, t, tokens, first):
    """strip_stages.accumulate_strip: per rank tile and 512-token piece, t matmuls into one PSUM bank."""
    for cw, pieces in _spans(tokens, TILE_N):
        work.group(times * _tiles(rank) * pieces, work.matmuls(t, cw), *work.evict(cw, first))


def _transposed_x(work, times, tokens, P, t, waited_for=True):
    """x^T of one contraction block for `tokens` rows, 128 at a time. If `waited_for`, the first matmul that
    uses it waits for ScalarE's copy of the last PSUM bank of transposes (above 128 tokens stage 1
    transposes the next block's x while it multiplies, so only its first block is)."""
    for T, chunks in _spans(tokens, PMAX):
        _transpose_tokens(work, times * chunks, T, P, t)
    if waited_for:
        work.wait(times, _last_transposes_copy(work, t, tokens))


def _transpose_tokens(work, times, tokens, P, t):
    """tiles.transpose_tokens: one DMA of the rows, TensorE transposes several to a PSUM bank, ScalarE copies
    each bank out."""
    s = work.s
    work.load("x", times, tokens * P * t * s, P * t * s)
    for group, banks in _spans(t, _transposes_per_bank(s)):
        work.group(times * banks, work.transposes(group, tokens), act=work.scalar(group * tokens))


def _last_transposes_copy(work, t, tokens):
    """ScalarE's copy of the last PSUM bank of a contraction block's transposes (t tiles, `tokens` rows): the
    last 128 tokens' last bank, which the block's first matmul waits for."""
    last_bank = t % _transposes_per_bank(work.s) or _transposes_per_bank(work.s)
    return work.scalar(last_bank * (tokens % PMAX or PMAX))


def _transposes_per_bank(s):
    return PSUM_BANK_BYTES // (PMAX * s)


def _load_interleaved_rows(work, tensor, times, P, t, cols, whole_rows):
    """tiles.load_interleaved_rows: one DMA of t rows per partition, contiguous if they are whole rows."""
    s = work.s
    work.load(tensor, times, P * t * cols * s, (t if whole_rows else 1) * cols * s)


def _load_row_tiles(work, tensor, times, rows, cols):
    """tiles.load_row_tiles: one DMA of the full 128-row tiles, one of a partial last tile."""
    _row_tile_transfers(work.load, tensor, times, rows, cols, work.s)


def _store_row_tiles(work, tensor, times, rows, cols):
    """tiles.store_row_tiles: the same DMAs the other way."""
    _row_tile_transfers(work.store, tensor, times, rows, cols, work.s)


def _row_tile_transfers(move, tensor, times, rows, cols, s):
    """tiles.row_tile_pairs: `move` (a _Work's load or store) of the full 128-row tiles, then a partial one."""
    full, partial = divmod(rows, PMAX)
    for partitions, count in ((PMAX, full), (partial, 1)):
        if partitions and count:
            move(tensor, times, partitions * count * cols * s, cols * s)


# -- choosing ----------------------------------------------------------------------------------------------
def _fastest(kernel, shape, dtype, target):
    """The candidate plan that fits SBUF with the best estimated time; estimates within TIE of the best are
    a tie, which the fewest HBM bytes and then the least SBUF break (a fuller SBUF reuses freed bytes
    sooner, and a load into them waits for their last reader)."""
    core = neuron_core(target) if target is not None else kernel_core()
    budget = core.sbuf_partition_bytes - SBUF_RESERVE_BYTES
    fitting = []
    for plan in candidate_plans(kernel, shape):
        estimate = estimate_plan(kernel, shape, plan, dtype, core)
        if estimate.sbuf_bytes <= budget:
            fitting.append((estimate, plan))
    if not fitting:
        raise ValueError(f"{kernel}: no blocking of shape {shape} fits SBUF; reduce the rank or split the layer")
    fastest = min(estimate.total_s for estimate, _ in fitting)
    tied = [(e.hbm_bytes, e.sbuf_bytes, e.total_s, i) for i, (e, _) in enumerate(fitting)
            if e.total_s <= fastest * (1 + TIE)]
    return fitting[min(tied)[-1]][1]


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; the planner knows {', '.join(KERNELS)}")


def _contraction_tiles(rows):
    return _clipped(BLOCK_TILES, max(1, rows // PMAX))


def _clipped(candidates, limit):
    """Candidate sizes, each capped at `limit` (so a small dimension is taken whole)."""
    return sorted({min(c, limit) for c in candidates})


def _spans(n, step):
    """The pieces range(0, n, step) cuts n into, as (size, how many): full pieces, then the remainder."""
    return [(size, count) for size, count in ((step, n // step), (n % step, 1)) if size and count]


def _kinds(steps):
    """A sequence of steps as {(*step, is first, is last): how many}: identical steps are priced once."""
    return Counter((*step, i == 0, i == len(steps) - 1) for i, step in enumerate(steps))


def _tiles(rank):
    return cdiv(rank, PMAX)
