"""Fused SVD MLPs in one kernel each (NeuronMM's fused MLP), act SiLU (Llama, Qwen) or GELU, exact or
tanh-approximated (Gemma, GPT-2): one ScalarE activation either way.

    fused_svd_mlp          y = (act(x·Ug·Vg) * (x·Uu·Vu)) · Ud · Vd      gated
    fused_svd_ungated_mlp  y = act(x·U1·V1 + b1) · U2 · V2               not gated (fc2's bias: the caller's)

For each block of tokens:
  1. gate and up strips (x·Ug)ᵀ and (x·Uu)ᵀ — stage 1 of the XUV kernel, sharing one x^T (ungated: one
     strip);
  2. for each block of the intermediate dimension I: Vg and Vu are the stationary operands, so the
     gate and up products come out as [I, tokens] — already transposed; act is applied as the gate
     leaves PSUM (b1, one value per I row, is the activation's per-partition bias) and the product with up
     as up leaves PSUM, giving actᵀ with I on partitions;
  3. actᵀ is exactly the moving operand the down projection's stage 1 needs: (act · Ud)ᵀ accumulates over
     the I blocks in fp32 with no transpose and no trip through HBM;
  4. y = (act · Ud) · Vd, stage 2 of the XUV kernel, stored in natural [tokens, H] layout.
Block sizes come from blocking.plan_mlp and blocking.plan_ungated_mlp.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nki, nl
from onnx_nmm.kernels.nki_kernels.strip_stages import accumulate_strip, expand_strip, load_v_block, project_tokens
from onnx_nmm.kernels.nki_kernels.tiles import PMAX, TILE_N, cdiv, k_blocks
from onnx_nmm.kernels.pricing.blocking import plan_mlp, plan_ungated_mlp

# The gate activations by the names SvdGatedMLP's `activation` attribute uses.
ACTIVATIONS = {"silu": nl.silu, "gelu": nl.gelu, "gelu_tanh": nl.gelu_apprx_tanh}


@nki.jit
def fused_svd_mlp(x, ug, vg, uu, vu, ud, vd, plan=None, activation="silu"):
    """y = (act(x · ug · vg) * (x · uu · vu)) · ud · vd.

    Args:
        x: [M, H] activations, row-major.
        ug: [H, rg], vg: [rg, I]  gate projection factors;
        uu: [H, ru], vu: [ru, I]  up projection factors;
        ud: [I, rd], vd: [rd, H]  down projection factors (ranks may differ).
        plan: a blocking.MlpPlan; None asks blocking.plan_mlp for this shape and target.
        activation: act, a key of ACTIVATIONS.
    Returns:
        y: [M, H] in x's dtype, in shared HBM.
    """
    M, H = x.shape
    intermediate = vg.shape[1]
    assert ug.shape[0] == H and uu.shape[0] == H and vd.shape[1] == H, "Ug, Uu rows and Vd columns must be H"
    assert ug.shape[1] == vg.shape[0] and uu.shape[1] == vu.shape[0] and ud.shape[1] == vd.shape[0], "ranks"
    assert vu.shape[1] == intermediate and ud.shape[0] == intermediate, "Vg, Vu columns and Ud rows must be I"
    check_operands(x, (ug, vg, uu, vu, ud, vd), activation)
    if plan is None:
        plan = plan_mlp(M, H, intermediate, ug.shape[1], uu.shape[1], ud.shape[1], x.dtype)
    return mlp_token_blocks(x, (ug, vg, None), (uu, vu), ud, vd, plan, activation)


@nki.jit
def fused_svd_ungated_mlp(x, u1, v1, b1, u2, v2, plan=None, activation="gelu_tanh"):
    """y = act(x · u1 · v1 + b1) · u2 · v2.

    Args:
        x: [M, H] activations, row-major.
        u1: [H, r1], v1: [r1, I], b1: [I]  the first projection (fc1) and its bias;
        u2: [I, r2], v2: [r2, H]           the second (fc2); its bias is added by the caller.
        plan: a blocking.MlpPlan; None asks blocking.plan_ungated_mlp for this shape and target.
        activation: act, a key of ACTIVATIONS.
    Returns:
        y: [M, H] in x's dtype, in shared HBM.
    """
    M, H = x.shape
    intermediate = v1.shape[1]
    assert u1.shape[0] == H and v2.shape[1] == H, "U1 rows and V2 columns must be H"
    assert u1.shape[1] == v1.shape[0] and u2.shape[1] == v2.shape[0], "ranks"
    assert u2.shape[0] == intermediate and b1.shape == (intermediate,), "V1 columns, U2 rows and b1 must be I"
    check_operands(x, (u1, v1, b1, u2, v2), activation)
    if plan is None:
        plan = plan_ungated_mlp(M, H, intermediate, u1.shape[1], u2.shape[1], x.dtype)
    return mlp_token_blocks(x, (u1, v1, b1), None, u2, v2, plan, activation)


def check_operands(x, operands, activation):
    for operand in operands:
        assert operand.dtype == x.dtype, f"factors and biases must have x's dtype {x.dtype}, not {operand.dtype}"
    assert activation in ACTIVATIONS, f"activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}"


def mlp_token_blocks(x, gate, up, ud, vd, plan, activation):
    """y for every block of tokens: steps 1-3 give (act · Ud)ᵀ, step 4 expands it by Vd."""
    M, H = x.shape
    y = nl.ndarray((M, H), dtype=x.dtype, buffer=nl.shared_hbm)
    for row0 in range(0, M, plan.token_block):
        tokens = min(plan.token_block, M - row0)
        down_strip, first_vd_block = act_down_strip(x, gate, up, ud, vd, row0, tokens, plan, ACTIVATIONS[activation])
        expand_strip(down_strip, vd, y, row0, tokens, plan.n_block, first_vd_block)
    return y


def act_down_strip(x, gate, up, ud, vd, row0, tokens, plan, act):
    """(act · Ud)ᵀ for one token block: [128, ceil(rd/128), tokens], rank on partitions; and Vd's first
    column block, loaded during stage 1 with the first blocks of Vg and Vu.

    gate is (U, V, bias or None); up is (U, V), or None for an ungated MLP.
    """
    intermediate, rank_d = ud.shape
    blocks = k_blocks(intermediate, plan.i_tiles)
    first_columns = blocks[0][1] * blocks[0][2]
    projections = (gate,) if up is None else (gate, up)
    strips, prefetched = project_tokens(x, tuple(p[0] for p in projections), row0, tokens, plan.k_tiles,
                                        prefetch=tuple((p[1], first_columns) for p in projections)
                                                 + ((vd, plan.n_block),))
    *first_v_blocks, first_vd_block = prefetched
    down_strip = nl.ndarray((PMAX, cdiv(rank_d, PMAX), tokens), dtype=x.dtype, buffer=nl.sbuf)
    steps = 0  # Ud sub-blocks: the contraction blocks of the down projection
    for _, _, t in blocks:
        steps += cdiv(t, plan.down_tiles)
    partial = None
    if steps > 1:
        partial = nl.ndarray((PMAX, cdiv(rank_d, PMAX), tokens), dtype=nl.float32, buffer=nl.sbuf)

    step = 0
    for b, (i0, P, t) in enumerate(blocks):
        v_blocks = first_v_blocks if b == 0 else [load_v_block(p[1], i0, P * t) for p in projections]
        if up is None:
            actT = act_T(strips[0], v_blocks[0], gate[1].shape[0], gate[2], i0, P, t, tokens, act, x.dtype)
        else:
            actT = gated_act_T(strips, v_blocks, (gate[1].shape[0], up[1].shape[0]), P, t, tokens, act)
        # Stage 1 of the down projection, actᵀ as the moving operand, Ud rows in sub-blocks of down_tiles.
        ud_rows = ud[i0 : i0 + P * t, 0:rank_d].reshape((P, t, rank_d))
        for j0 in range(0, t, plan.down_tiles):
            tc = min(plan.down_tiles, t - j0)
            ud_block = nl.ndarray((PMAX, tc, rank_d), dtype=ud.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=ud_block[0:P, 0:tc, 0:rank_d], src=ud_rows[0:P, j0 : j0 + tc, 0:rank_d])
            accumulate_strip(down_strip, partial, ud_block, actT[0:PMAX, j0 : j0 + tc, 0:tokens], P, tc, tokens,
                             step == 0, step == steps - 1, range(cdiv(rank_d, PMAX)))
            step += 1
    return down_strip, first_vd_block


def act_T(strip, v_block, rank, bias, i0, P, t, tokens, act, dtype):
    """act(strip · V + bias)ᵀ for intermediate rows i0 + p*t + j: [128, t, tokens] in `dtype`, from V's
    block of those columns ([128, rank tiles, P*t]).

    V is stationary, so each PSUM tile is [I rows, tokens]; act is applied as it leaves PSUM (ScalarE), with
    the bias of each I row (if any) as the activation's per-partition bias.
    """
    columns = P * t
    result = nl.ndarray((PMAX, t, tokens), dtype=dtype, buffer=nl.sbuf)
    bias_block = None
    if bias is not None:
        bias_block = nl.ndarray((PMAX, t), dtype=bias.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_block[0:P, 0:t], src=bias[i0 : i0 + columns].reshape((P, t)))
    for j in range(t):
        for c0 in range(0, tokens, TILE_N):
            cw = min(TILE_N, tokens - c0)
            acc = project_columns(v_block, strip, rank, j, t, P, c0, cw)
            row_bias = None if bias_block is None else bias_block[0:P, j : j + 1]
            nisa.activation(dst=result[0:P, j, c0 : c0 + cw], op=act, data=acc[0:P, 0:cw], bias=row_bias)
    return result


def gated_act_T(strips, v_blocks, ranks, P, t, tokens, act):
    """actᵀ[p, j, :] = act(gate) * up for the block's intermediate row p*t + j: [128, t, tokens], from the
    gate and up strips, the blocks of Vg and Vu of the block's columns, and the two ranks.

    The gate is act_T's, kept in fp32; Vu is stationary for the up, and the product is taken as up leaves
    PSUM (VectorE), written in x's dtype.
    """
    (gate_strip, up_strip), (vg_block, vu_block), (rank_gate, rank_up) = strips, v_blocks, ranks
    gate = act_T(gate_strip, vg_block, rank_gate, None, 0, P, t, tokens, act, nl.float32)
    actT = nl.ndarray((PMAX, t, tokens), dtype=gate_strip.dtype, buffer=nl.sbuf)
    for j in range(t):
        for c0 in range(0, tokens, TILE_N):
            cw = min(TILE_N, tokens - c0)
            acc = project_columns(vu_block, up_strip, rank_up, j, t, P, c0, cw)
            nisa.tensor_tensor(dst=actT[0:P, j, c0 : c0 + cw], data1=gate[0:P, j, c0 : c0 + cw],
                               data2=acc[0:P, 0:cw], op=nl.multiply)
    return actT


def project_columns(v_block, strip, rank, j, t, P, c0, cw):
    """PSUM [P, cw] = V[:, columns p*t + j]ᵀ · strip[:, tokens c0..]: the tile's P columns as stationary."""
    acc = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
    for rt in range(v_block.shape[1]):
        rr = min(PMAX, rank - rt * PMAX)
        nisa.nc_matmul(acc[0:P, 0:cw], stationary=v_block[0:rr, rt, j : P * t : t],
                       moving=strip[0:rr, rt, c0 : c0 + cw], accumulate=rt > 0)
    return acc
