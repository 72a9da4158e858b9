"""Dense matmul y = x · w: the dense baseline every low-rank kernel is set against, and the AWS tutorial's
matmul (the cost model's calibration anchor).

`dense_matmul(x, w)` takes x in natural [M, K] layout like every other kernel here. It computes y in output
blocks of m_block rows and n_block columns, a row block's column blocks one after another:

  1. x^T of a row block is made once and stays in SBUF for every column block: up to 128 tokens from their
     whole rows (one DMA; 32 or 64 tokens in pieces of their columns side by side over all 128 partitions,
     tiles.row_pieces), all of it while the first w block arrives; above, as the first column block needs
     it, per contraction block from one DMA of the block's columns for every 128 tokens (TensorE transposes,
     ScalarE copies). The first row block's contraction blocks ramp up where its first w block is large
     (blocking.contraction_blocks);
  2. per contraction block of k_tiles tiles, the block's rows of w (one DMA, row-interleaved as x^T's
     tiles are) are the moving operand and x^T the stationary one, each 128 x 512 output tile in a PSUM
     bank;
  3. a block of at most OUTPUT_BANKS banks accumulates over the whole contraction in PSUM, and after the
     last contraction block ScalarE copies each bank out in x's dtype; a larger block leaves PSUM after
     every contraction block and is summed in fp32 in SBUF; a PSUM-summed block's full 128-row tiles go to
     HBM in one DMA, a larger block's rows 128 at a time. With plan.all_psum, blocks of up to all 8 banks
     sum in PSUM once the row block's x^T is made, the first block narrowed to what OUTPUT_BANKS hold
     (blocking.output_column_blocks; 512 tokens: 768 columns, two row tiles' last 256 sharing a bank,
     tiles.psum_sums): at 512 tokens that keeps 512 x 1,024 blocks, w in 2 KiB runs, out of fp32 partial
     sums, and the first block, which waits for x's rows, small;
  4. a row block of at most 64 tokens multiplies its output blocks' columns in groups side by side
     (blocking.column_groups): x^T is kept with zeros between its tokens, and each group's window of it
     sends the group's piece of the columns to its own partitions of the same PSUM banks. Four groups of 32
     tokens make a bank hold 2,048 columns, so a block can take w in whole rows (runs of 16 KiB and more
     instead of 6 KiB) and leaves through all 128 partitions, on all 16 DMA queues.

Summing in PSUM costs a small M no eviction per contraction block (a [1, 512] partial sum costs VectorE
as much as a [128, 512] one); larger blocks reuse each block of w over more rows and load it in longer
rows. w is read once per row block, x once. Block sizes come from blocking.plan_dense for the shape and
target.

`dense_matmul_lhsT(lhsT, w)` is the tutorial's kernel in its own calling convention (x delivered
transposed; nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py,
`nki_matmul_fully_optimized_`): a stripe of output rows for one block of columns held in SBUF while the
contraction streams in blocks, each block of w loaded once and reused by every row block of the stripe,
TensorE accumulating one contraction block in PSUM before VectorE adds it onto the stripe. It is what the
cost model's calibration anchor runs (tools/tutorial_matmuls.py), with three changes: the stripe's partial
sums are float32 (the tutorial keeps them in the output dtype), its block sizes come from
blocking.plan_dense(transposed_input=True) unless given, and a plan may load each block of w in pieces of
its columns (`w_piece`; the first block's one PSUM tile wide): where moving w takes the DMA about as long as
TensorE takes to use it (512 tokens on trn1), TensorE then starts after a piece instead of a whole block of
several MiB, and each later piece streams in behind the matmuls of the one before.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nki, nl
from onnx_nmm.kernels.nki_kernels.tiles import (
    PMAX,
    TILE_M,
    TILE_N,
    cdiv,
    column_pieces,
    dtype_bytes,
    evict_partial_sum,
    k_blocks,
    load_interleaved_rows,
    load_row_pieces,
    load_row_tiles,
    multiply_rows_into,
    psum_sums,
    row_pieces,
    store_row_tiles,
    transpose_rows,
)
from onnx_nmm.kernels.pricing.blocking import (
    column_groups,
    contraction_blocks,
    output_column_blocks,
    plan_dense,
)


@nki.jit
def dense_matmul(x, w, plan=None):
    """y = x · w.

    Args:
        x: [M, K] activations, row-major (tokens x features, as an ONNX graph holds them).
        w: [K, N] weight, same dtype as x (bfloat16 or float32).
        plan: a blocking.OutputBlockPlan; None asks blocking.plan_dense for this shape and target.
    Returns:
        y: [M, N] in x's dtype, in shared HBM.
    """
    M, K = x.shape
    K_w, N = w.shape
    assert K == K_w, f"x has {K} features but w has {K_w} rows"
    assert x.dtype == w.dtype, f"x is {x.dtype} but w is {w.dtype}"
    if plan is None:
        plan = plan_dense(M, K, N, x.dtype, transposed_input=False)
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    n_block = min(plan.n_block, N)
    for row0 in range(0, M, plan.m_block):
        rows = min(plan.m_block, M - row0)
        # the first row block's contraction blocks ramp up where its first w block is large (nothing runs before
        # its first loads arrive); a later row block's loads run ahead while the one before computes
        blocks = contraction_blocks(K, plan.k_tiles, n_block, dtype_bytes(x.dtype), row0 == 0)
        # up to 128 tokens, their whole rows in one DMA (short rows per contraction block move slowly)
        x_rows = None
        if rows <= PMAX:
            pieces = row_pieces(rows, K, blocks)
            x_rows = nl.ndarray((PMAX, 1, K // pieces), dtype=x.dtype, buffer=nl.sbuf)
            load_row_pieces(x_rows, x, row0, rows, K, pieces)
        groups = column_groups(rows, n_block, N)
        # the row block's x^T, one tile per contraction block (transposed_block), made as first used; when it
        # stays for several column blocks its tiles are allocated here, before any w block (allocated as they are
        # made, they would sit between the w blocks, and the next column block's w loads would wait for them)
        xT = []
        reserved = [x_transposed_tile(x.dtype, rows, t, groups) for _, _, t in blocks] if n_block < N else None
        if x_rows is not None:
            # up to 128 tokens, all of x^T at once while the first w block arrives: x's rows are then free before
            # any w block is allocated (one taking their place late would wait for the last transposes)
            for _ in blocks:
                transpose_next_block(xT, reserved, x, x_rows, row0, rows, blocks, groups)
        # fp32 sums of output blocks too large for PSUM: two sets for the row block, its column blocks taking them
        # in turn (freed between blocks, their bytes would go to the next block's first w block, whose load would
        # then wait for the last additions; one set, the next block's first sums would wait for them)
        column_blocks = output_column_blocks(rows, n_block, N, groups, plan.all_psum)
        partials = [None]
        if not all(block.in_psum(rows, groups) for block in column_blocks) and len(blocks) > 1:
            partials = [[nl.ndarray((PMAX, n_block), dtype=nl.float32, buffer=nl.sbuf)
                         for _ in range(cdiv(rows, TILE_M))] for _ in range(min(2, cdiv(N, n_block)))]
        for c, column_block in enumerate(column_blocks):
            output_block(x, x_rows, xT, reserved, w, y, blocks, row0, rows, column_block, partials[c % len(partials)],
                         groups)
    return y


def output_block(x, x_rows, xT, reserved, w, y, blocks, row0, rows, column_block, partials, groups):
    """y[row0 : row0+rows, col0 : col0+cols] = x · w for the columns of `column_block`. The row block's x^T tiles
    (`xT`, one per contraction block) are made here where they are first used, in the `reserved` tiles if any,
    from `x_rows` if its rows are loaded already.

    A block that fits its PSUM banks (blocking.ColumnBlock.in_psum, blocking.output_column_blocks) accumulates
    over the whole contraction in PSUM and leaves it once, its columns in `groups` pieces side by side
    (blocking.column_groups); a larger one leaves PSUM after every contraction block, summed in fp32 in SBUF
    (the tutorial's partial sums), and a single contraction block needs no sums at all.
    """
    col0, cols = column_block.col0, column_block.cols
    in_psum = column_block.in_psum(rows, groups)
    acc = psum_sums(rows * groups, cols // groups, column_block.halves) if in_psum else None
    for b, (k0, P, t) in enumerate(blocks):
        # x^T a contraction block ahead, so that ScalarE copies the next block's transposes out of PSUM while
        # TensorE multiplies this one
        while len(xT) < min(b + 2, len(blocks)):
            transpose_next_block(xT, reserved, x, x_rows, row0, rows, blocks, groups)
        w_block = nl.ndarray((PMAX, t, cols), dtype=w.dtype, buffer=nl.sbuf)
        load_interleaved_rows(w_block, w, k0, P, t, col0, col0 + cols)
        if in_psum:
            accumulate(acc, xT[b], w_block, rows, cols, P, t, groups, first=b == 0)
        else:
            multiply_rows_into(y, row0, col0, xT[b], w_block, partials, 0, rows, cols, P, t, b == 0,
                               b == len(blocks) - 1)
    if in_psum:
        store_sums(acc, y, row0, rows, col0, cols, groups)


def store_sums(acc, y, row0, rows, col0, cols, groups):
    """y[row0 : row0+rows, col0 : col0+cols] from its PSUM sums: each bank copied out by ScalarE in y's dtype,
    the full 128-row tiles stored in one DMA and a partial last one in another (tiles.store_row_tiles). With
    column groups, partition g*i + q holds piece q of token i's columns, and a token's pieces follow each
    other in its row of y: one DMA."""
    piece = cols // groups
    result = nl.ndarray((PMAX, cdiv(rows, TILE_M), piece), dtype=y.dtype, buffer=nl.sbuf)
    for r, r0 in enumerate(range(0, rows, TILE_M)):
        R = min(TILE_M, rows - r0)
        for n, n0 in enumerate(range(0, piece, TILE_N)):
            nt = min(TILE_N, piece - n0)
            evict_partial_sum(result[0 : R * groups, r, n0 : n0 + nt], None, acc[r][n][0 : R * groups, 0:nt],
                              first=True, last=True)
    if groups > 1:
        nisa.dma_copy(dst=y[row0 : row0 + rows, col0 : col0 + cols].reshape((rows, groups, piece)),
                      src=result[0 : rows * groups, 0, 0:piece])
    else:
        store_row_tiles(y, result, row0, rows, col0, col0 + cols)


def accumulate(acc, xT, w_block, rows, cols, P, t, groups, first):
    """acc[r][n] (+)= one contraction block's product, row tile by row tile (the first row tile's matmuls need
    only the first 128 tokens' x^T).

    With several groups, piece q of the columns is multiplied with the stationary window of x^T's tile that
    puts token i in column g*i + q and zeros in the other columns (see transposed_block), so its products
    land in partitions g*i + q and the other partitions of the bank gain zeros.
    """
    piece = cols // groups
    for r, r0 in enumerate(range(0, rows, TILE_M)):
        R = min(TILE_M, rows - r0)
        for j in range(t):
            for q in range(groups):
                window = groups * r0 + groups - 1 - q
                for n, n0 in enumerate(range(0, piece, TILE_N)):
                    nt = min(TILE_N, piece - n0)
                    c0 = q * piece + n0
                    nisa.nc_matmul(acc[r][n][0 : R * groups, 0:nt],
                                   stationary=xT[0:P, j, window : window + R * groups],
                                   moving=w_block[0:P, j, c0 : c0 + nt], accumulate=not first or j > 0 or q > 0)


def x_transposed_tile(dtype, rows, t, groups):
    """A tile for one contraction block of x^T (transposed_block): [P, t, rows], or with several column groups
    [P, t, g*rows + g - 1]."""
    return nl.ndarray((PMAX, t, groups * rows + groups - 1), dtype=dtype, buffer=nl.sbuf)


def transpose_next_block(xT, reserved, x, x_rows, row0, rows, blocks, groups):
    """Appends to `xT` the x^T of the next contraction block in `blocks`, in its `reserved` tile if any."""
    b = len(xT)
    k0, P, t = blocks[b]
    tile = x_transposed_tile(x.dtype, rows, t, groups) if reserved is None else reserved[b]
    xT.append(transposed_block(tile, x, x_rows, row0, rows, k0, P, t, groups))


def transposed_block(block, x, x_rows, row0, rows, k0, P, t, groups):
    """block = x^T for contraction rows k0.. (row-interleaved, as the w block) and the `rows` tokens from row0,
    by TensorE transposes: from `x_rows` (the tokens' whole rows, in pieces of their columns side by side as
    tiles.load_row_pieces puts them), or from the block's columns of every 128 tokens loaded in one DMA
    (tiles.load_row_tiles).

    With several column groups the tile is zeros but for token i in column g*i + g - 1, so that the window of
    g*rows columns from g - 1 - q puts token i in column g*i + q.
    """
    if x_rows is None:
        x_rows = nl.ndarray((PMAX, cdiv(rows, PMAX), P * t), dtype=x.dtype, buffer=nl.sbuf)
        load_row_tiles(x_rows, x, row0, rows, k0, k0 + P * t)
        column0 = 0
    else:
        piece = k0 // x_rows.shape[2]  # the piece of the rows' columns that holds this block
        column0 = k0 - piece * x_rows.shape[2]
        if piece:
            x_rows = x_rows[piece * rows : (piece + 1) * rows]
    width = groups * rows + groups - 1
    if groups > 1:
        nisa.memset(block[0:P, 0:t, 0:width], 0)
    tokens = block[:, :, groups - 1 : width : groups]
    for c, tok0 in enumerate(range(0, rows, PMAX)):
        transpose_rows(tokens, x_rows[:, c, :], min(PMAX, rows - tok0), column0, P, t, tok0)
    return block


@nki.jit
def dense_matmul_lhsT(lhsT, w, plan=None):
    """y = lhsT^T · w, the tutorial's kernel and form.

    Args:
        lhsT: [K, M], the left operand delivered transposed (contraction first).
        w: [K, N] weight, same dtype.
        plan: a blocking.DensePlan; None asks blocking.plan_dense(transposed_input=True).
    Returns:
        y: [M, N] in lhsT's dtype, in shared HBM.
    """
    K, M = lhsT.shape
    K_w, N = w.shape
    assert K == K_w, f"lhsT has {K} rows but w has {K_w}"
    assert lhsT.dtype == w.dtype, f"lhsT is {lhsT.dtype} but w is {w.dtype}"
    if plan is None:
        plan = plan_dense(M, K, N, lhsT.dtype, transposed_input=True)
    # Partial sums are kept per 128-row tile of the stripe, so row blocks must start on tile boundaries.
    assert plan.m_block % TILE_M == 0 or plan.m_block >= M, f"m_block {plan.m_block}: a multiple of {TILE_M}"
    assert plan.m_stripe % plan.m_block == 0 or plan.m_stripe >= M, "m_stripe must be a multiple of m_block"
    y = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for row0 in range(0, M, plan.m_stripe):
        for col0 in range(0, N, plan.n_block):
            stripe_block(lhsT, w, y, row0, min(plan.m_stripe, M - row0), col0, min(plan.n_block, N - col0), plan)
    return y


def stripe_block(lhsT, w, y, row0, rows, col0, cols, plan):
    """y[row0:row0+rows, col0:col0+cols], streaming the contraction in blocks of plan.k_tiles tiles, each
    block's w in pieces of plan.w_piece columns if given (tiles.column_pieces)."""
    K = w.shape[0]
    blocks = k_blocks(K, plan.k_tiles)
    # fp32 partial sums of the stripe, one [128, cols] tile per 128 output rows; a single block needs none.
    partials = None
    if len(blocks) > 1:
        partials = [nl.ndarray((PMAX, cols), dtype=nl.float32, buffer=nl.sbuf) for _ in range(cdiv(rows, TILE_M))]

    for b, (k0, P, t) in enumerate(blocks):
        first, last = b == 0, b == len(blocks) - 1
        lhsT_blocks = []  # the row blocks' lhsT, loaded with the first piece of w and used by every piece
        for c0, width in column_pieces(cols, plan.w_piece, first):
            # each piece of w is loaded once and reused by every row block of the stripe
            w_block = nl.ndarray((PMAX, t, width), dtype=w.dtype, buffer=nl.sbuf)
            load_interleaved_rows(w_block, w, k0, P, t, col0 + c0, col0 + c0 + width)
            piece_partials = None if partials is None else [tile[:, c0 : c0 + width] for tile in partials]
            for i, m0 in enumerate(range(0, rows, plan.m_block)):
                m_rows = min(plan.m_block, rows - m0)
                if c0 == 0:
                    lhsT_blocks.append(nl.ndarray((PMAX, t, m_rows), dtype=lhsT.dtype, buffer=nl.sbuf))
                    load_interleaved_rows(lhsT_blocks[i], lhsT, k0, P, t, row0 + m0, row0 + m0 + m_rows)
                multiply_rows_into(y, row0 + m0, col0 + c0, lhsT_blocks[i], w_block, piece_partials, m0 // TILE_M,
                                   m_rows, width, P, t, first, last)
