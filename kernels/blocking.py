"""Block sizes for the kernels, from an analytical model of SBUF capacity and arithmetic intensity.

For each candidate blocking the model counts what the kernel will do — TensorE and ScalarE/VectorE cycles
per PSUM group, HBM bytes with the DMA efficiency their contiguous runs allow, the loads before the first
block can start and the compute after the last load — and the SBUF bytes per partition its live tiles
need (loop-local tiles counted twice: the next one is loaded while the current one is used). A candidate
that does not fit SBUF (less the compiler's reserve) is out; among the rest the model takes the shortest
time (compute and DMA overlapped, _Work.seconds), then the fewest HBM bytes, then the least SBUF. Bigger
blocks raise arithmetic intensity (fewer re-reads of x and the weights) until SBUF runs out — the
trade-off NeuronMM's Eq. 10/11 describe — and the decision is made per shape and per target, not looked
up from a table.

The formulas mirror the loop nests of dense_matmul, strip_stages, fused_xuv and fused_mlp; the emulator
checks the real footprint of every kernel it runs.
"""

from dataclasses import dataclass

from onnx_nmm.kernels.hardware import TRN1, TRN2, dma_efficiency, neuron_core
from onnx_nmm.kernels.nki_api import nisa, nl
from onnx_nmm.kernels.tiles import PMAX, TILE_M, TILE_N, cdiv, dtype_bytes, k_blocks

# nki-library leaves 16 KiB + 264 B of each SBUF partition to the compiler (DMA scratch, reserved locations,
# transpose identity): MAX_AVAILABLE_SBUF_SIZE = 224*1024 - 16384 - 8 - 256 in
# nki-library src/nkilib_src/nkilib/core/mlp/mlp_cte/mlp_cte_constants.py.
SBUF_RESERVE_BYTES = 16384 + 8 + 256

# Compute and DMA overlap as the 4-norm of their times rather than their max: of two plans with the same
# bottleneck, the one whose other stream has more slack wins.
CONTENTION_NORM = 4

BLOCK_TILES = (1, 2, 4, 8, 16)  # contraction tiles per block
COLUMN_BLOCKS = (512, 1024, 2048, 4096, 8192)  # output columns per weight block
ROW_BLOCKS = (128, 256, 512, 1024, 2048)  # rows of x per lhsT block (dense)
TOKEN_BLOCKS = (128, 256, 512, 1024, 2048, 4096, 8192)  # tokens per cached strip / output stripe


@dataclass
class DensePlan(nl.NKIObject):
    m_stripe: int  # output rows whose fp32 partial sums stay in SBUF while w streams
    m_block: int  # rows of x^T per block (the tutorial's BLOCK_M)
    n_block: int  # output columns per w block (BLOCK_N)
    k_tiles: int  # 128-row contraction tiles per block (TILES_IN_BLOCK_K)


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


def kernel_core():
    """The NeuronCore the kernel is being built for (trn1 for NeuronCore-v2, else trn2)."""
    return TRN1 if nisa.get_nc_version() == nisa.nc_version.gen2 else TRN2


def plan_dense(M, K, N, dtype, transposed_input=False, target=None):
    """The blocking of dense_matmul (transposed_input=False) or dense_matmul_lhsT for this shape."""
    core = neuron_core(target) if target is not None else kernel_core()
    s = dtype_bytes(dtype)
    best = None
    for n_block in _clipped(COLUMN_BLOCKS, N):
        for k_tiles in _clipped(BLOCK_TILES, max(1, K // PMAX)):
            for m_block in _clipped(ROW_BLOCKS, M):
                for m_stripe in _clipped(TOKEN_BLOCKS, M):
                    if m_stripe < m_block or (m_stripe % m_block and m_stripe != M):
                        continue
                    plan = DensePlan(m_stripe, m_block, n_block, k_tiles)
                    best = _better(best, plan, _dense_cost(M, K, N, s, core, plan, transposed_input), 0, core)
    return _chosen(best, "dense_matmul", (M, K, N))


def plan_xuv(M, K, rank, N, dtype, target=None):
    """The blocking of fused_xuv: tokens per strip, then the best blocking of each stage for it."""
    core = neuron_core(target) if target is not None else kernel_core()
    s = dtype_bytes(dtype)
    best = None
    for tokens in _clipped(TOKEN_BLOCKS, M):
        strip = _tiles(rank) * tokens * s
        k_tiles = _best_choice(
            [(k, _project_cost(tokens, K, (rank,), s, core, k)) for k in _clipped(BLOCK_TILES, max(1, K // PMAX))],
            core, strip, first=True, last=False)
        n_block = _best_choice([(n, _expand_cost(tokens, rank, N, s, core, n)) for n in _clipped(COLUMN_BLOCKS, N)],
                               core, strip, first=False, last=True)
        if k_tiles is None or n_block is None:
            continue
        plan = XuvPlan(tokens, k_tiles, n_block)
        cost = _over_token_blocks(M, tokens, [_xuv_stages(T, K, rank, N, s, core, plan) for T in (tokens, M % tokens)])
        best = _better(best, plan, cost, strip, core)
    return _chosen(best, "fused_xuv", (M, K, rank, N))


def plan_mlp(M, H, intermediate, rank_gate, rank_up, rank_down, dtype, target=None):
    """The blocking of fused_svd_mlp: tokens per strip, then the best blocking of each step for it."""
    core = neuron_core(target) if target is not None else kernel_core()
    s = dtype_bytes(dtype)
    best = None
    for tokens in _clipped(TOKEN_BLOCKS, M):
        gate_up = (_tiles(rank_gate) + _tiles(rank_up)) * tokens * s
        down = _tiles(rank_down) * tokens * s
        k_tiles = _best_choice(
            [(k, _project_cost(tokens, H, (rank_gate, rank_up), s, core, k))
             for k in _clipped(BLOCK_TILES, max(1, H // PMAX))],
            core, gate_up, first=True, last=False)
        gated = _best_choice(
            [((i, d), _gated_down_cost(tokens, intermediate, rank_gate, rank_up, rank_down, s, core, i, d))
             for i in _clipped(BLOCK_TILES + (32,), max(1, intermediate // PMAX))
             for d in _clipped(BLOCK_TILES, i)],
            core, gate_up + down, first=False, last=False)
        n_block = _best_choice(
            [(n, _expand_cost(tokens, rank_down, H, s, core, n)) for n in _clipped(COLUMN_BLOCKS, H)], core, down,
            first=False, last=True)
        if k_tiles is None or gated is None or n_block is None:
            continue
        plan = MlpPlan(tokens, k_tiles, gated[0], gated[1], n_block)
        ranks = (rank_gate, rank_up, rank_down)
        cost = _over_token_blocks(
            M, tokens, [_mlp_stages(T, H, intermediate, ranks, s, core, plan) for T in (tokens, M % tokens)])
        best = _better(best, plan, cost, gate_up + down, core)
    return _chosen(best, "fused_svd_mlp", (M, H, intermediate, rank_gate, rank_up, rank_down))


def _xuv_stages(tokens, K, rank, N, s, core, plan):
    if tokens == 0:
        return []
    return [_project_cost(tokens, K, (rank,), s, core, plan.k_tiles), _expand_cost(tokens, rank, N, s, core, plan.n_block)]


def _mlp_stages(tokens, H, intermediate, ranks, s, core, plan):
    if tokens == 0:
        return []
    rank_gate, rank_up, rank_down = ranks
    return [
        _project_cost(tokens, H, (rank_gate, rank_up), s, core, plan.k_tiles),
        _gated_down_cost(tokens, intermediate, rank_gate, rank_up, rank_down, s, core, plan.i_tiles, plan.down_tiles),
        _expand_cost(tokens, rank_down, H, s, core, plan.n_block),
    ]


# -- the work each loop nest does ----------------------------------------------------------------------------
class _Work:
    """Engine time, DMA time, HBM bytes and SBUF bytes per partition of one loop nest.

    Work is added per PSUM group: TensorE fills one bank while ScalarE/VectorE empty the previous one
    (two banks rotate), so a group takes the longer of its matmuls and its eviction — on trn1 ScalarE and
    VectorE also take turns at PSUM. Those group times add up along the nest.
    """

    def __init__(self, core, s):
        self.core = core
        self.s = s
        self.pe = self.act = self.dve = 0.0  # seconds per engine
        self.chain = 0.0  # seconds of the PSUM groups, each at its slowest engine
        self.dma = 0.0
        self.hbm = 0
        self.sbuf = 0
        self.steps = 1  # blocks the loop nest streams through: compute of the last one follows the last load
        self.fill = 0.0  # seconds of loads before the first block can be computed

    def group(self, count, pe_cycles, act_cycles=0, dve_cycles=0):
        """`count` PSUM groups, each `pe_cycles` on TensorE then evicted by ScalarE and/or VectorE."""
        core = self.core
        pe, act, dve = pe_cycles / core.pe_hz, act_cycles / core.act_hz, dve_cycles / core.dve_hz
        evict = act + dve if core.psum_shared_by_act_and_dve else max(act, dve)
        self.pe += count * pe
        self.act += count * act
        self.dve += count * dve
        self.chain += count * max(pe, evict)

    def matmuls(self, count, moving):
        """TensorE cycles of `count` matmuls with this moving free size."""
        factor = self.core.pe_fp32_factor if self.s == 4 else 1
        return count * max(moving, self.core.pe_min_cycles) * factor

    def transposes(self, count, tokens):
        factor = self.core.pe_fp32_transpose_factor if self.s == 4 else 1
        return count * max(tokens, self.core.pe_min_cycles) * factor

    def elementwise(self, elements, inputs=1):
        """ScalarE/VectorE cycles of one instruction over `elements` per partition."""
        small = self.core.short_instruction_overhead_cycles if elements < self.core.partitions else 0
        return inputs * elements + small

    def evict(self, elements, first):
        """(ScalarE, VectorE) cycles to move a contraction block out of PSUM: a copy for the first block,
        an fp32 add onto the partial sums for the others (tiles.evict_partial_sum)."""
        return (self.elementwise(elements), 0) if first else (0, self.elementwise(elements, 2))

    def load(self, nbytes, run_bytes, first_block_bytes=0):
        seconds_per_byte = 1 / (self.core.dma_bytes_per_s * dma_efficiency(run_bytes))
        self.dma += nbytes * seconds_per_byte
        self.fill += first_block_bytes * seconds_per_byte
        self.hbm += nbytes

    def x_transposes(self, tokens, K, k_tiles, repeats):
        """tiles.transpose_tokens over `tokens` rows and all of K, `repeats` times."""
        per_bank = 2048 // (PMAX * self.s)
        for _, P, t in k_blocks(K, k_tiles):
            for T in _sizes(tokens, PMAX):
                for group in _sizes(t, per_bank):
                    self.group(repeats, self.transposes(group, T), self.elementwise(group * T))

    def seconds(self, first=True, last=True):
        """Compute waits for the first block's loads (when the nest is the kernel's first: a later one's loads
        are prefetched during the one before) and the last block's compute follows the last load (when it
        is the kernel's last). Compute and DMA overlap as a 4-norm rather than a max, since neither stream
        is perfectly smooth."""
        compute = max(self.chain, self.pe, self.act, self.dve)
        times = (compute + (self.fill if first else 0), self.dma + (compute / self.steps if last else 0))
        return sum(t**CONTENTION_NORM for t in times) ** (1 / CONTENTION_NORM)


def _dense_cost(M, K, N, s, core, plan, transposed_input):
    work = _Work(core, s)
    blocks = k_blocks(K, plan.k_tiles)
    t_max = max(t for _, _, t in blocks)
    n_block, m_block, m_stripe = min(plan.n_block, N), min(plan.m_block, M), min(plan.m_stripe, M)
    column_blocks, stripes = cdiv(N, n_block), cdiv(M, m_stripe)
    m_tiles = len(_sizes(M, TILE_M))
    for b, (_, _, t) in enumerate(blocks):
        for nt in _sizes(N, TILE_N):
            work.group(m_tiles, work.matmuls(t, nt), *work.evict(nt, b == 0))
    if not transposed_input:
        work.x_transposes(M, K, plan.k_tiles, column_blocks)
    x_run = m_block if transposed_input else min(K, t_max * PMAX)
    work.load(M * K * s * column_blocks, x_run * s, t_max * PMAX * m_block * s)
    work.load(K * N * s * stripes, n_block * s, t_max * PMAX * n_block * s)
    work.load(M * N * s, n_block * s)
    work.steps = stripes * column_blocks * len(blocks)
    partials = cdiv(m_stripe, TILE_M) * n_block * 4 if len(blocks) > 1 else 0
    x_rows = 0 if transposed_input else 2 * t_max * PMAX * s
    work.sbuf = partials + 2 * t_max * (n_block + m_block) * s + 2 * n_block * s + x_rows
    return work.seconds(), work.hbm, work.sbuf


def _project_cost(tokens, K, ranks, s, core, k_tiles):
    """project_tokens: x^T once per contraction block, then each U's strip (fp32 partials across blocks)."""
    work = _Work(core, s)
    blocks = k_blocks(K, k_tiles)
    t_max = max(t for _, _, t in blocks)
    work.x_transposes(tokens, K, k_tiles, 1)
    work.load(tokens * K * s, min(K, t_max * PMAX) * s, min(tokens, PMAX) * t_max * PMAX * s)
    for rank in ranks:
        for b, (_, _, t) in enumerate(blocks):
            for cw in _sizes(tokens, TILE_N):
                work.group(_tiles(rank), work.matmuls(t, cw), *work.evict(cw, b == 0))
        work.load(K * rank * s, t_max * rank * s, t_max * PMAX * rank * s)
    work.steps = len(blocks)
    partials = sum(_tiles(rank) for rank in ranks) * tokens * 4 if len(blocks) > 1 else 0
    work.sbuf = partials + 2 * t_max * tokens * s + 2 * t_max * max(ranks) * s + 2 * t_max * PMAX * s
    return work


def _expand_cost(tokens, rank, N, s, core, n_block):
    """expand_strip: V block by block, every 128-token tile reusing it."""
    work = _Work(core, s)
    n_block = min(n_block, N)
    for nt in _sizes(N, TILE_N):
        work.group(len(_sizes(tokens, TILE_M)), work.matmuls(_tiles(rank), nt), work.elementwise(nt))
    work.load(rank * N * s, n_block * s, rank * n_block * s)
    work.load(tokens * N * s, n_block * s)
    work.steps = cdiv(N, n_block)
    work.sbuf = 2 * _tiles(rank) * n_block * s + 2 * n_block * s
    return work


def _gated_down_cost(tokens, intermediate, rank_gate, rank_up, rank_down, s, core, i_tiles, down_tiles):
    """act_down_strip after the gate/up strips: actᵀ block by block, each feeding the down projection."""
    work = _Work(core, s)
    blocks = k_blocks(intermediate, i_tiles)
    i_total = sum(t for _, _, t in blocks)
    t_max = max(t for _, _, t in blocks)
    columns = t_max * PMAX
    sub_blocks = [tc for _, _, t in blocks for tc in _sizes(t, down_tiles)]
    for cw in _sizes(tokens, TILE_N):
        work.group(i_total, work.matmuls(_tiles(rank_gate), cw), work.elementwise(cw))  # SiLU leaving PSUM
        work.group(i_total, work.matmuls(_tiles(rank_up), cw), 0, work.elementwise(cw, 2))  # times up
        for step, tc in enumerate(sub_blocks):
            work.group(_tiles(rank_down), work.matmuls(tc, cw), *work.evict(cw, step == 0))
    work.load((rank_gate + rank_up) * intermediate * s, min(intermediate, columns) * s,
              (rank_gate + rank_up) * min(intermediate, columns) * s)
    work.load(intermediate * rank_down * s, min(t_max, down_tiles) * rank_down * s)
    work.steps = len(blocks)
    down_partial = _tiles(rank_down) * tokens * 4 if len(sub_blocks) > 1 else 0
    act = 2 * t_max * tokens * s + t_max * tokens * 4  # actᵀ (double-buffered) and the fp32 SiLU(gate)
    weights = (_tiles(rank_gate) + _tiles(rank_up)) * columns * s + 2 * min(t_max, down_tiles) * rank_down * s
    work.sbuf = down_partial + act + weights
    return work


# -- choosing ----------------------------------------------------------------------------------------------
def _best_choice(options, core, persistent, first, last):
    """The choice whose work fits next to `persistent` bytes with the best (time, HBM bytes, SBUF);
    `first`/`last` say whether the nest starts or ends the kernel (see _Work.seconds)."""
    best = None
    for choice, work in options:
        if persistent + work.sbuf > core.sbuf_partition_bytes - SBUF_RESERVE_BYTES:
            continue
        key = (work.seconds(first, last), work.hbm, work.sbuf)
        if best is None or key < best[1]:
            best = (choice, key)
    return None if best is None else best[0]


def _over_token_blocks(M, tokens, stage_lists):
    """(seconds, HBM bytes, SBUF bytes) of M // tokens full token blocks and one remainder block."""
    full, remainder = stage_lists
    seconds = _stage_seconds(full) * (M // tokens) + _stage_seconds(remainder)
    hbm = sum(stage.hbm for stage in full) * (M // tokens) + sum(stage.hbm for stage in remainder)
    return seconds, hbm, max(stage.sbuf for stage in full)


def _stage_seconds(stages):
    return sum(stage.seconds(i == 0, i == len(stages) - 1) for i, stage in enumerate(stages))


def _better(best, plan, cost, persistent, core):
    seconds, hbm, sbuf = cost
    if persistent + sbuf > core.sbuf_partition_bytes - SBUF_RESERVE_BYTES:
        return best
    key = (seconds, hbm, persistent + sbuf)
    return (plan, key) if best is None or key < best[1] else best


def _chosen(best, kernel, shape):
    if best is None:
        raise ValueError(f"{kernel}: no blocking of shape {shape} fits SBUF; reduce the rank or split the layer")
    return best[0]


def _clipped(candidates, limit):
    """Candidate sizes, each capped at `limit` (so a small dimension is taken whole)."""
    return sorted({min(c, limit) for c in candidates})


def _sizes(n, tile):
    """Sizes of the tiles covering n: full tiles, then the remainder."""
    return [tile] * (n // tile) + ([n % tile] if n % tile else [])


def _tiles(rank):
    return cdiv(rank, PMAX)
