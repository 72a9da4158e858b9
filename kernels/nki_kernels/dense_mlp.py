"""Dense MLPs in one kernel each: the honest baseline of the fused SVD MLP, and the kernel a narrowed MLP
(--method nystrom: a dense MLP of smaller width) runs on.

    dense_gated_mlp    y = (act(x·Wg) * (x·Wu)) · Wd        Llama, Qwen, Gemma
    dense_ungated_mlp  y = act(x·W1 + b1) · W2              GPT-2, Phi (W2's bias: the caller's)

For each block of tokens:
  1. x^T of the block, every contraction tile of H: the rows of 128 tokens in one DMA each, then TensorE
     transposes (tiles.transpose_rows) into the contraction blocks of H the weights are loaded in;
  2. for each block of the intermediate dimension I: the Wg and Wu columns of the block are the stationary
     operands and x^T the moving one, so gate and up leave PSUM as [I rows, tokens] — already transposed.
     act is applied as the gate leaves PSUM (ScalarE; b1, one value per I row, is its per-partition bias),
     the product with up as up leaves it (VectorE): actᵀ, I on partitions, in x's dtype;
  3. actᵀ is the stationary operand of the down projection and Wd's rows of the block the moving one, so y
     leaves PSUM in its natural [tokens, H] layout; the I blocks are summed in fp32 in SBUF;
  4. the last I block writes y in x's dtype and stores it.
No transpose of the intermediate activation, and it never leaves SBUF — the same dataflow as the fused SVD
MLP (fused_mlp), with whole weights instead of factors.

Up to 128 tokens (decode), when blocking.sums_in_psum allows, every sum stays in PSUM instead:
  2'. per block of I, the gate's columns stream in by blocks of H, in long rows, each I tile's sum over all of
      H in its own place of PSUM; then the up's the same way, in the other half of PSUM, while the gate's
      sums leave it through the activation (the up's leave, multiplied in, while the next block's gate's are
      made): actᵀ of every block of I, with all of PSUM for these sums (blocks of 16 I tiles of 128 tokens);
  3'. then Wd's rows of a few I tiles at a time (consecutive rows per partition, one long run) are the
      stationary operand and actᵀ the moving one (a weight tile costs TensorE max(tokens, 64) cycles instead
      of 512), y^T summed over all of I in PSUM;
  4'. y^T leaves PSUM once, TensorE transposes it back, and the rows are stored.
Nothing is summed in SBUF, so no VectorE addition per block of I (a [1, 512] one costs as much as a
[128, 512] one). Block sizes come from blocking.plan_dense_mlp.
"""

from onnx_nmm.kernels.nki_kernels.fused_mlp import ACTIVATIONS
from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nki, nl
from onnx_nmm.kernels.nki_kernels.tiles import (
    PMAX,
    PSUM_BANK_BYTES,
    TILE_M,
    TILE_N,
    cdiv,
    dtype_bytes,
    k_blocks,
    load_interleaved_rows,
    multiply_rows_into,
    ramped_k_blocks,
    transpose_rows,
)
from onnx_nmm.kernels.pricing.blocking import down_tiles_per_load, plan_dense_mlp, sums_in_psum


@nki.jit
def dense_gated_mlp(x, wg, wu, wd, plan=None, activation="silu"):
    """y = (act(x · wg) * (x · wu)) · wd.

    Args:
        x: [M, H] activations, row-major.
        wg, wu: [H, I] gate and up weights; wd: [I, H] down weight; all in x's dtype.
        plan: a blocking.DenseMlpPlan; None asks blocking.plan_dense_mlp for this shape and target.
        activation: act, a key of fused_mlp.ACTIVATIONS.
    Returns:
        y: [M, H] in x's dtype, in shared HBM.
    """
    M, H = x.shape
    intermediate = wg.shape[1]
    assert wg.shape == (H, intermediate) and wu.shape == (H, intermediate), "Wg and Wu must be [H, I]"
    assert wd.shape == (intermediate, H), "Wd must be [I, H]"
    _check_operands(x, (wg, wu, wd), activation)
    if plan is None:
        plan = plan_dense_mlp(M, H, intermediate, True, x.dtype)
    return _token_blocks(x, (wg, wu), None, wd, plan, ACTIVATIONS[activation])


@nki.jit
def dense_ungated_mlp(x, w1, b1, w2, plan=None, activation="gelu_tanh"):
    """y = act(x · w1 + b1) · w2.

    Args:
        x: [M, H] activations, row-major.
        w1: [H, I], b1: [I]  the first projection (fc1) and its bias; w2: [I, H] the second (fc2), whose bias
            the caller adds; all in x's dtype.
        plan: a blocking.DenseMlpPlan; None asks blocking.plan_dense_mlp for this shape and target.
        activation: act, a key of fused_mlp.ACTIVATIONS.
    Returns:
        y: [M, H] in x's dtype, in shared HBM.
    """
    M, H = x.shape
    intermediate = w1.shape[1]
    assert w1.shape == (H, intermediate) and w2.shape == (intermediate, H), "W1 must be [H, I] and W2 [I, H]"
    assert b1.shape == (intermediate,), "b1 must be [I]"
    _check_operands(x, (w1, b1, w2), activation)
    if plan is None:
        plan = plan_dense_mlp(M, H, intermediate, False, x.dtype)
    return _token_blocks(x, (w1,), b1, w2, plan, ACTIVATIONS[activation])


def _check_operands(x, operands, activation):
    for operand in operands:
        assert operand.dtype == x.dtype, f"weights and biases must have x's dtype {x.dtype}, not {operand.dtype}"
    assert activation in ACTIVATIONS, f"activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}"


def _token_blocks(x, projections, bias, wd, plan, act):
    """y, one block of tokens at a time: steps 1-4 of the module docstring."""
    M, H = x.shape
    y = nl.ndarray((M, H), dtype=x.dtype, buffer=nl.shared_hbm)
    h_blocks = k_blocks(H, plan.k_tiles)
    rows = _token_rows(x, 0, min(plan.token_block, M))
    for row0 in range(0, M, plan.token_block):
        tokens = min(plan.token_block, M - row0)
        xT = _transposed(rows, tokens, h_blocks)
        next0 = row0 + plan.token_block
        if next0 < M:
            # the next block's rows are loaded now: made as it starts, their loads would queue behind the weight
            # loads already running ahead for it
            rows = _token_rows(x, next0, min(plan.token_block, M - next0))
        # the first block of more than 128 tokens ramps its blocks of I up: nothing runs before the first block's
        # gate and up columns arrive (later token blocks find theirs loaded while the one before computes)
        ramped = row0 == 0 and tokens > PMAX
        i_blocks = (ramped_k_blocks if ramped else k_blocks)(wd.shape[0], plan.i_tiles)
        if sums_in_psum(tokens, H, plan.i_tiles, len(projections)):
            _streamed_token_block(xT, h_blocks, i_blocks, projections, bias, wd, y, row0, tokens, act, x.dtype)
            continue
        # fp32 sums of y over the I blocks, one [128, H] tile per 128 tokens; a single I block needs none.
        partials = None
        if len(i_blocks) > 1:
            partials = [nl.ndarray((PMAX, H), dtype=nl.float32, buffer=nl.sbuf) for _ in range(cdiv(tokens, TILE_M))]
        for b, (i0, P, t) in enumerate(i_blocks):
            blocks = _projection_blocks(projections, h_blocks, i0, P, t)
            # the Wd block loads while the gate and up blocks are used (allocated after the matmuls, its bytes
            # would be those freed last, and its load would start late)
            wd_block = nl.ndarray((PMAX, t, H), dtype=wd.dtype, buffer=nl.sbuf)
            load_interleaved_rows(wd_block, wd, i0, P, t, 0, H)
            actT = _act_T(xT, h_blocks, blocks, bias, i0, P, t, tokens, act, x.dtype)
            _down(actT, wd_block, y, partials, row0, tokens, P, t, b == 0, b == len(i_blocks) - 1)
    return y


def _streamed_token_block(xT, h_blocks, i_blocks, projections, bias, wd, y, row0, tokens, act, dtype):
    """y for up to 128 tokens, every sum in PSUM (steps 2'-4' of the module docstring): actᵀ of every block of
    I first, with all of PSUM for the gate and up sums, then the down projection into y^T."""
    actT = [_streamed_act_T(xT, h_blocks, projections, bias, i0, P, t, tokens, act, dtype) for i0, P, t in i_blocks]
    H = y.shape[1]
    yT = _psum_tiles(cdiv(H, PMAX), tokens)
    for b, ((i0, P, t), block_act) in enumerate(zip(i_blocks, actT)):
        per_load = down_tiles_per_load(t, H, dtype_bytes(wd.dtype))
        for j0 in range(0, t, per_load):
            d = min(per_load, t - j0)
            # Wd's rows of actᵀ's tiles j0..j0+d: rows i0 + p*t + j0.. are consecutive, one run per partition
            wd_rows = nl.ndarray((PMAX, per_load, H), dtype=wd.dtype, buffer=nl.sbuf)
            rows = wd[i0 : i0 + P * t, 0:H].reshape((P, t * H))[:, j0 * H : (j0 + d) * H]
            nisa.dma_copy(dst=wd_rows[0:P, 0:d, 0:H], src=rows.reshape((P, d, H)))
            for j in range(d):
                for n, h0 in enumerate(range(0, H, PMAX)):
                    h_rows = min(PMAX, H - h0)
                    nisa.nc_matmul(yT(n, h_rows), stationary=wd_rows[0:P, j, h0 : h0 + h_rows],
                                   moving=block_act[0:P, j0 + j, 0:tokens], accumulate=b > 0 or j0 + j > 0)
    _store_transposed(yT, y, row0, tokens)


def _streamed_act_T(xT, h_blocks, projections, bias, i0, P, t, tokens, act, dtype):
    """actᵀ of one block of I: each projection in turn streams its columns of the block by blocks of H, each I
    tile's sum over all of H in its own place of PSUM (the gate's sums leave while the up's are made)."""
    columns = P * t
    sums = []
    for w in projections:
        acc = _psum_tiles(t, tokens)
        for (k0, kp, kt), x_block in zip(h_blocks, xT):
            w_block = nl.ndarray((PMAX, kt, columns), dtype=w.dtype, buffer=nl.sbuf)
            load_interleaved_rows(w_block, w, k0, kp, kt, i0, i0 + columns)
            for j in range(t):
                for h in range(kt):
                    nisa.nc_matmul(acc(j, P), stationary=w_block[0:kp, h, j : columns : t],
                                   moving=x_block[0:kp, h, 0:tokens], accumulate=k0 > 0 or h > 0)
        sums.append(acc)
    return _activated(sums, bias, i0, P, t, tokens, act, dtype)


def _psum_tiles(count, tokens):
    """`count` fp32 sums of [128, tokens] in PSUM, as many to a bank as fit (a matmul's output stays within a
    bank); returns sum(i, rows), the first `rows` partitions of the i-th."""
    per_bank = TILE_N // tokens
    banks = [nl.ndarray((PMAX, min(per_bank, count - i0), tokens), dtype=nl.float32, buffer=nl.psum)
             for i0 in range(0, count, per_bank)]
    return lambda i, rows: banks[i // per_bank][0:rows, i % per_bank, 0:tokens]


def _store_transposed(yT, y, row0, tokens):
    """y[row0 : row0+tokens] from its transpose's PSUM sums: each [128, tokens] tile out of PSUM, transposed
    back by TensorE, several to a bank, out of PSUM again, and the rows stored in one DMA."""
    H = y.shape[1]
    h_tiles = cdiv(H, PMAX)
    yT_rows = nl.ndarray((PMAX, h_tiles, tokens), dtype=y.dtype, buffer=nl.sbuf)
    for n, h0 in enumerate(range(0, H, PMAX)):
        rows = min(PMAX, H - h0)
        nisa.activation(dst=yT_rows[0:rows, n, 0:tokens], op=nl.copy, data=yT(n, rows))
    result = nl.ndarray((PMAX, H), dtype=y.dtype, buffer=nl.sbuf)
    per_transpose_bank = PSUM_BANK_BYTES // (PMAX * dtype_bytes(y.dtype))
    for g0 in range(0, h_tiles, per_transpose_bank):
        bank = nl.ndarray((PMAX, per_transpose_bank, PMAX), dtype=y.dtype, buffer=nl.psum)
        for n in range(g0, min(h_tiles, g0 + per_transpose_bank)):
            rows = min(PMAX, H - n * PMAX)
            nisa.nc_transpose(dst=bank[0:tokens, n - g0, 0:rows], data=yT_rows[0:rows, n, 0:tokens],
                              engine=nisa.engine.tensor)
            nisa.activation(dst=result[0:tokens, n * PMAX : n * PMAX + rows], op=nl.copy,
                            data=bank[0:tokens, n - g0, 0:rows])
    nisa.dma_copy(dst=y[row0 : row0 + tokens, 0:H], src=result[0:tokens, 0:H])


def _activated(sums, bias, i0, P, t, tokens, act, dtype):
    """actᵀ [128, t, tokens] in `dtype` from the PSUM sums of the gate and up (or fc1): act on ScalarE as the
    gate leaves PSUM (with fc1's bias, one value per I row), the product with the up on VectorE."""
    bias_block = None
    if bias is not None:
        bias_block = nl.ndarray((PMAX, t), dtype=bias.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_block[0:P, 0:t], src=bias[i0 : i0 + P * t].reshape((P, t)))
    actT = nl.ndarray((PMAX, t, tokens), dtype=dtype, buffer=nl.sbuf)
    gate = actT if len(sums) == 1 else nl.ndarray((PMAX, t, tokens), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(t):
        row_bias = None if bias_block is None else bias_block[0:P, j : j + 1]
        nisa.activation(dst=gate[0:P, j, 0:tokens], op=act, data=sums[0](j, P), bias=row_bias)
        if len(sums) == 2:
            nisa.tensor_tensor(dst=actT[0:P, j, 0:tokens], data1=gate[0:P, j, 0:tokens],
                               data2=sums[1](j, P), op=nl.multiply)
    return actT


def _token_rows(x, row0, tokens):
    """The rows of the token block, 128 to a tile, one DMA each."""
    H = x.shape[1]
    tiles = []
    for tok0 in range(0, tokens, PMAX):
        T = min(PMAX, tokens - tok0)
        rows = nl.ndarray((PMAX, H), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[0:T, 0:H], src=x[row0 + tok0 : row0 + tok0 + T, 0:H])
        tiles.append(rows)
    return tiles


def _transposed(rows, tokens, h_blocks):
    """x^T of the token block whose rows are `rows` (_token_rows), in each contraction block (k0, P, t) of H:
    [128, t, tokens] apiece."""
    xT = [nl.ndarray((PMAX, t, tokens), dtype=rows[0].dtype, buffer=nl.sbuf) for _, _, t in h_blocks]
    for tile, tok0 in zip(rows, range(0, tokens, PMAX)):
        for block, (k0, P, t) in zip(xT, h_blocks):
            transpose_rows(block, tile, min(PMAX, tokens - tok0), k0, P, t, tok0)
    return xT


def _projection_blocks(projections, h_blocks, i0, P, t):
    """Each projection's columns of the block of I, loaded per contraction block of H: [128, tiles, P*t]."""
    blocks = []
    for w in projections:
        loaded = []
        for k0, kp, kt in h_blocks:
            w_block = nl.ndarray((PMAX, kt, P * t), dtype=w.dtype, buffer=nl.sbuf)
            load_interleaved_rows(w_block, w, k0, kp, kt, i0, i0 + P * t)
            loaded.append(w_block)
        blocks.append(loaded)
    return blocks


def _act_T(xT, h_blocks, blocks, bias, i0, P, t, tokens, act, dtype):
    """actᵀ for the intermediate rows i0 + p*t + j: [128, t, tokens] in `dtype`, from each projection's `blocks`
    (_projection_blocks): column p*t + j of a block is the stationary operand for row p of tile j, so each
    PSUM tile is [I rows, tokens]."""
    columns = P * t
    bias_block = None
    if bias is not None:
        bias_block = nl.ndarray((PMAX, t), dtype=bias.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_block[0:P, 0:t], src=bias[i0 : i0 + columns].reshape((P, t)))
    actT = nl.ndarray((PMAX, t, tokens), dtype=dtype, buffer=nl.sbuf)
    for j in range(t):
        for c0 in range(0, tokens, TILE_N):
            cw = min(TILE_N, tokens - c0)
            acc = _project(xT, h_blocks, blocks[0], j, t, P, c0, cw)
            row_bias = None if bias_block is None else bias_block[0:P, j : j + 1]
            if len(blocks) == 1:
                nisa.activation(dst=actT[0:P, j, c0 : c0 + cw], op=act, data=acc[0:P, 0:cw], bias=row_bias)
                continue
            # the gated activation in fp32, one PSUM bank's worth at a time, the up multiplied in as it leaves PSUM
            gate = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=gate[0:P, 0:cw], op=act, data=acc[0:P, 0:cw], bias=row_bias)
            up = _project(xT, h_blocks, blocks[1], j, t, P, c0, cw)
            nisa.tensor_tensor(dst=actT[0:P, j, c0 : c0 + cw], data1=gate[0:P, 0:cw], data2=up[0:P, 0:cw],
                               op=nl.multiply)
    return actT


def _project(xT, h_blocks, w_blocks, j, t, P, c0, cw):
    """PSUM [P, cw] = W[:, columns p*t + j]ᵀ · x^T[:, tokens c0..]: the contraction over every tile of H."""
    acc = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
    steps = sum(kt for _, _, kt in h_blocks)
    step = 0
    for (_, kp, kt), x_block, w_block in zip(h_blocks, xT, w_blocks):
        for h in range(kt):
            nisa.nc_matmul(acc[0:P, 0:cw], stationary=w_block[0:kp, h, j : P * t : t],
                           moving=x_block[0:kp, h, c0 : c0 + cw], accumulate=step > 0)
            step += 1
    assert step == steps
    return acc


def _down(actT, wd_block, y, partials, row0, tokens, P, t, first, last):
    """y (+)= act_blk · Wd_blk for every 128 tokens and TILE_N columns of H: actᵀ stationary, Wd's rows moving."""
    multiply_rows_into(y, row0, 0, actT, wd_block, partials, 0, tokens, wd_block.shape[2], P, t, first, last)
