"""The two stages of a fused low-rank product, shared by fused_xuv and fused_mlp.

Stage 1 computes a strip (x_blk · U)ᵀ for a block of tokens: U is the stationary operand and x^T the
moving one, so TensorE writes the product transposed — rank on partitions, tokens in the free dimension —
with no transpose instruction. The strip stays in SBUF.

Stage 2 multiplies the cached strip by V one block of output columns at a time: the strip is the
stationary operand (rank on partitions = the contraction), V streams as the moving one, and the result
comes out in natural [tokens, columns] layout, ready to store.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nl
from onnx_nmm.kernels.nki_kernels.tiles import (
    PMAX,
    TILE_M,
    TILE_N,
    cdiv,
    evict_partial_sum,
    k_blocks,
    load_interleaved_rows,
    load_row_tiles,
    transpose_tokens,
)


def project_tokens(x, us, row0, tokens, k_tiles, prefetch):
    """Stage 1 for several U sharing x: returns one strip (x[row0:row0+tokens] · U)ᵀ per U, and the blocks
    `prefetch` asks for.

    Each strip is [128, ceil(r/128), tokens] in x's dtype: rank r = 128*tile + partition. The contraction
    over K streams in blocks of k_tiles tiles; a block's x^T is transposed once and used by every U. Above
    128 tokens TensorE transposes the next block's x midway through this block's matmuls, so ScalarE moves
    those transposes out of PSUM while TensorE multiplies and the next block's matmuls find their x^T ready;
    at 128 tokens or fewer the kernel waits on DMA, and a late x load would stall the matmuls queued behind
    its transposes (TensorE runs in program order), so each block transposes its own x first. `prefetch` lists
    (V, columns): the first column block of each V the stages after this one start with,
    loaded once the first contraction block's loads are under way, so they arrive while stage 1 computes.
    """
    K = x.shape[1]
    blocks = k_blocks(K, k_tiles)
    strips = [nl.ndarray((PMAX, cdiv(u.shape[1], PMAX), tokens), dtype=x.dtype, buffer=nl.sbuf) for u in us]
    # fp32 partial sums across contraction blocks (none when one block covers K).
    partials = [None for u in us]
    if len(blocks) > 1:
        partials = [nl.ndarray((PMAX, cdiv(u.shape[1], PMAX), tokens), dtype=nl.float32, buffer=nl.sbuf) for u in us]

    prefetched = []
    ahead = tokens > TILE_M
    next_xT = transposed_block(x, row0, tokens, blocks[0])
    for b, (k0, P, t) in enumerate(blocks):
        xT = next_xT if ahead or b == 0 else transposed_block(x, row0, tokens, blocks[b])
        for i in range(len(us)):
            u = us[i]
            u_block = nl.ndarray((PMAX, t, u.shape[1]), dtype=u.dtype, buffer=nl.sbuf)
            load_interleaved_rows(u_block, u, k0, P, t, 0, u.shape[1])
            step = (strips[i], partials[i], u_block, xT, P, t, tokens, b == 0, b == len(blocks) - 1)
            rank_tiles = cdiv(u.shape[1], PMAX)
            if ahead and i == 0 and b + 1 < len(blocks):
                accumulate_strip(*step, range(0, rank_tiles // 2))
                next_xT = transposed_block(x, row0, tokens, blocks[b + 1])
                accumulate_strip(*step, range(rank_tiles // 2, rank_tiles))
            else:
                accumulate_strip(*step, range(rank_tiles))
        if b == 0:
            prefetched = [load_v_block(v, 0, columns) for v, columns in prefetch]
    return strips, prefetched


def transposed_block(x, row0, tokens, block):
    """x^T of one contraction block (k0, P, t) for the token block: [128, t, tokens], 128 tokens at a time."""
    k0, P, t = block
    xT = nl.ndarray((PMAX, t, tokens), dtype=x.dtype, buffer=nl.sbuf)
    for tok0 in range(0, tokens, PMAX):
        transpose_tokens(xT, x, row0 + tok0, min(PMAX, tokens - tok0), k0, P, t, tok0)
    return xT


def accumulate_strip(strip, partial, u_block, xT, P, t, tokens, first, last, rank_tiles):
    """strip (+)= (x_blk · U_blk)ᵀ for one contraction block of t tiles of P partitions, over the strip's
    `rank_tiles` (a range of its 128-rank tiles).

    U_blk [P, t, r] is stationary, so the PSUM result is [rank tile, tokens]: the transposed product.
    """
    rank = u_block.shape[2]
    for rt in rank_tiles:
        r0 = rt * PMAX
        rr = min(PMAX, rank - r0)
        for c0 in range(0, tokens, TILE_N):
            cw = min(TILE_N, tokens - c0)
            acc = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for j in range(t):
                nisa.nc_matmul(acc[0:rr, 0:cw], stationary=u_block[0:P, j, r0 : r0 + rr],
                               moving=xT[0:P, j, c0 : c0 + cw], accumulate=j > 0)
            part = None if partial is None else partial[0:rr, rt, c0 : c0 + cw]
            evict_partial_sum(strip[0:rr, rt, c0 : c0 + cw], part, acc[0:rr, 0:cw], first, last)


def load_v_block(v, n0, n_block):
    """V's columns n0 .. n0+n_block as [128, rank tiles, columns]: the moving operand of stage 2."""
    rank, N = v.shape
    cols = min(n_block, N - n0)
    v_block = nl.ndarray((PMAX, cdiv(rank, PMAX), cols), dtype=v.dtype, buffer=nl.sbuf)
    load_row_tiles(v_block, v, 0, rank, n0, n0 + cols)
    return v_block


def expand_strip(strip, v, y, row0, tokens, n_block, first_block):
    """Stage 2: y[row0:row0+tokens, :] = stripᵀ · V, one block of n_block columns of V at a time.

    The strip is reused for every column block (no recomputation of stage 1, no HBM round trip); the
    V block is loaded once per token block and reused by every 128-token tile. `first_block` is V's first
    column block, which the caller loads before stage 1 so that stage 2 starts the moment the strip is done.

    A block of at most 128 tokens gathers its whole rows and stores them in two transfers, the first half of
    the columns while the rest is computed (in place of one transfer per column block); a larger one stores
    each tile's columns as soon as they are done.
    """
    rank, N = v.shape
    rank_tiles = cdiv(rank, PMAX)
    whole_rows = tokens <= TILE_M
    stored = 0  # columns of the whole rows already stored
    if whole_rows:
        rows = nl.ndarray((PMAX, N), dtype=y.dtype, buffer=nl.sbuf)
    for n0 in range(0, N, n_block):
        cols = min(n_block, N - n0)
        v_block = first_block if n0 == 0 else load_v_block(v, n0, n_block)
        for tok0 in range(0, tokens, TILE_M):
            T = min(TILE_M, tokens - tok0)
            result, c0 = (rows, n0) if whole_rows else (nl.ndarray((PMAX, cols), dtype=y.dtype, buffer=nl.sbuf), 0)
            for nt0 in range(0, cols, TILE_N):
                nt = min(TILE_N, cols - nt0)
                acc = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
                for rt in range(rank_tiles):
                    rr = min(PMAX, rank - rt * PMAX)
                    nisa.nc_matmul(acc[0:T, 0:nt], stationary=strip[0:rr, rt, tok0 : tok0 + T],
                                   moving=v_block[0:rr, rt, nt0 : nt0 + nt], accumulate=rt > 0)
                nisa.activation(dst=result[0:T, c0 + nt0 : c0 + nt0 + nt], op=nl.copy, data=acc[0:T, 0:nt])
            if not whole_rows:
                nisa.dma_copy(dst=y[row0 + tok0 : row0 + tok0 + T, n0 : n0 + cols], src=result[0:T, 0:cols])
        if whole_rows and n0 < N // 2 <= n0 + cols < N:  # the first half goes out while the rest computes
            stored = n0 + cols
            nisa.dma_copy(dst=y[row0 : row0 + tokens, 0:stored], src=rows[0:tokens, 0:stored])
    if whole_rows:
        nisa.dma_copy(dst=y[row0 : row0 + tokens, stored:N], src=rows[0:tokens, stored:N])
