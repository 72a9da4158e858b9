"""Tile sizes and the small data-movement steps every kernel here shares.

Contraction blocks are row-interleaved: within a block of P*t rows starting at k0, partition p and tile j
hold row k0 + p*t + j. Each partition then reads t consecutive rows, so one DMA descriptor carries t whole
rows of a weight (long contiguous runs, hardware.dma_efficiency), and the contraction still pairs the same
row of both operands. Only the order of the fp32 sum over k changes.
"""

from onnx_nmm.kernels.nki_kernels.nki_api import nisa, nl

PMAX = nl.tile_size.pmax  # 128 partitions: the contraction tile and the largest on-chip tile
TILE_M = nl.tile_size.gemm_stationary_fmax  # 128: stationary free size = result partitions
TILE_N = nl.tile_size.gemm_moving_fmax  # 512: moving free size = fp32 elements in one PSUM bank
HALF_BANK = TILE_N // 2  # two row tiles' sums of at most 256 columns share a PSUM bank (psum_sums)
PSUM_BANK_BYTES = nl.tile_size.psum_bank_fmax_bytes  # 2 KiB per partition per bank
RAMP_TILES = 2  # tiles of a ramped first contraction block (ramped_k_blocks)


def cdiv(a, b):
    return -(-a // b)


def dtype_bytes(dtype):
    """Bytes per element of the input dtypes the kernels take (bfloat16, float16, float32)."""
    if dtype == nl.float32:
        return 4
    assert dtype == nl.bfloat16 or dtype == nl.float16, f"kernels take float32, bfloat16 or float16, not {dtype}"
    return 2


def psum_sums(rows, cols, halves):
    """acc[r][n]: the fp32 PSUM sum of row tile r (128 partitions of `rows`) and column tile n (512 of `cols`),
    a bank each; with `halves`, a last column tile of at most HALF_BANK columns shares its bank with the next
    row tile's (blocking.psum_banks counts them)."""
    row_tiles = cdiv(rows, TILE_M)
    whole, rest = divmod(cols, TILE_N)
    acc = [[nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum) for _ in range(whole)]
           for _ in range(row_tiles)]
    if halves and 0 < rest <= HALF_BANK:
        for r in range(0, row_tiles, 2):
            bank = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for half, sums in enumerate(acc[r : r + 2]):
                sums.append(bank[:, half * HALF_BANK : (half + 1) * HALF_BANK])
    elif rest:
        for sums in acc:
            sums.append(nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum))
    return acc


def column_pieces(cols, piece, first_block):
    """(c0, width) of the loads a contraction block's `cols` columns of w come in: pieces of `piece` columns
    (None: the block whole), the first contraction block's TILE_N wide, so that TensorE starts after a small
    load and the rest of the block streams in behind its matmuls."""
    if piece is None or piece >= cols:
        return [(0, cols)]
    width = TILE_N if first_block else piece
    return [(c0, min(width, cols - c0)) for c0 in range(0, cols, width)]


def k_blocks(rows, tiles):
    """Contraction blocks (k0, P, t) covering `rows`: blocks of `tiles` full tiles, then the full tiles that
    are left as one block, then the last rows % 128 as a block of one partial tile."""
    blocks = []
    full_tiles = rows // PMAX
    for first in range(0, full_tiles, tiles):
        t = min(tiles, full_tiles - first)
        blocks.append((first * PMAX, PMAX, t))
    if rows % PMAX:
        blocks.append((full_tiles * PMAX, rows % PMAX, 1))
    return blocks


def row_pieces(rows, cols, blocks):
    """How many pieces of their columns `rows` whole rows are loaded in, each piece in its own partitions
    (load_row_pieces): 128 / rows for 32 or 64 rows, so that the one DMA spans all 128 partitions (each DMA
    queue serves 8 of a transfer's partitions: 32 rows alone keep 4 of the 16 busy), provided each contraction
    block in `blocks` lies within one piece; 1 otherwise."""
    pieces = PMAX // rows if rows in (32, 64) else 1
    if pieces > 1 and cols % pieces == 0:
        width = cols // pieces
        if all(k0 // width == (k0 + P * t - 1) // width for k0, P, t in blocks):
            return pieces
    return 1


def load_row_pieces(block, src, row0, rows, cols, pieces):
    """block[q*rows + i, 0, c] = src[row0 + i, q*width + c] with width = cols / pieces: piece q of the rows'
    columns in partitions q*rows.., in one DMA."""
    width = cols // pieces
    parts = src[row0 : row0 + rows, 0:cols].reshape((rows, pieces, width)).permute((1, 0, 2))
    nisa.dma_copy(dst=block[0 : rows * pieces, 0, 0:width], src=parts)


def ramped_k_blocks(rows, tiles):
    """k_blocks, but the first blocks growing from RAMP_TILES tiles, doubling up to `tiles`: a kernel's first
    matmul waits for the first blocks of both operands, and while TensorE multiplies a block the DMA queues
    bring the next, twice as large."""
    blocks, k0, t = [], 0, min(RAMP_TILES, tiles)
    while t < tiles and rows - k0 >= 2 * t * PMAX:
        blocks.append((k0, PMAX, t))
        k0, t = k0 + t * PMAX, 2 * t
    return blocks + [(k0 + first, P, t) for first, P, t in k_blocks(rows - k0, tiles)]


def load_interleaved_rows(block, src, k0, partitions, tiles, col0, col1):
    """block[p, j, :] = src[k0 + p*tiles + j, col0:col1], in one DMA.

    Whole rows make one contiguous run of tiles*cols elements per partition; part rows make `tiles` runs of
    cols each. One transfer either way: each DMA queue starts its transfers ~1.3 us apart, so a block
    moved as one transfer is not held up behind its own tiles (hardware.NeuronCore.dma_issue_interval_s).
    """
    cols = col1 - col0
    rows = src[k0 : k0 + partitions * tiles, col0:col1].reshape((partitions, tiles, cols))
    nisa.dma_copy(dst=block[0:partitions, 0:tiles, 0:cols], src=rows)


def load_row_tiles(block, src, row0, rows, col0, col1):
    """block[p, j, :] = src[row0 + j*128 + p, col0:col1]: the 128-row tiles (the last may be partial), the
    full ones in one DMA of `cols`-element runs and a partial last tile in a second."""
    for rows_of_src, tiles in row_tile_pairs(src, block, row0, rows, col0, col1):
        nisa.dma_copy(dst=tiles, src=rows_of_src)


def store_row_tiles(dst, block, row0, rows, col0, col1):
    """dst[row0 + j*128 + p, col0:col1] = block[p, j, :], load_row_tiles' way back: the full 128-row tiles in
    one DMA, a partial last tile in a second."""
    for rows_of_dst, tiles in row_tile_pairs(dst, block, row0, rows, col0, col1):
        nisa.dma_copy(dst=rows_of_dst, src=tiles)


def row_tile_pairs(hbm, block, row0, rows, col0, col1):
    """The (rows of `hbm`, tiles of `block`) views one DMA each moves between hbm[row0 + j*128 + p, col0:col1]
    and block[p, j, :]: the full 128-row tiles together, then a partial last tile."""
    cols = col1 - col0
    full = rows // PMAX
    pairs = []
    if full:
        tiles = hbm[row0 : row0 + full * PMAX, col0:col1].reshape((full, PMAX, cols)).permute((1, 0, 2))
        pairs.append((tiles, block[0:PMAX, 0:full, 0:cols]))
    if rows % PMAX:
        first = row0 + full * PMAX
        pairs.append((hbm[first : row0 + rows, col0:col1], block[0 : rows % PMAX, full, 0:cols]))
    return pairs


def transpose_tokens(xT, x, row0, tokens, k0, partitions, tiles, col):
    """xT[p, j, col + i] = x[row0 + i, k0 + p*tiles + j] for i < tokens (<= 128), by TensorE transposes.

    The rows arrive with one contiguous DMA (partitions*tiles elements per token); TensorE transposes each
    [tokens, partitions] slice into PSUM, several to a bank, and ScalarE copies each bank back to SBUF.
    PE transposes work on trn1 and trn2 alike (DMA transposes are trn2-only and run below full DMA
    throughput); a 128x128 transpose costs TensorE 128 cycles against the 512 of each matmul it feeds,
    and leaves the DMA queues, which bound the small-token cases, to the weights.
    """
    row_elements = partitions * tiles
    rows = nl.ndarray((PMAX, row_elements), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows[0:tokens, 0:row_elements], src=x[row0 : row0 + tokens, k0 : k0 + row_elements])
    transpose_rows(xT, rows, tokens, 0, partitions, tiles, col)


def transpose_rows(xT, rows, tokens, k0, partitions, tiles, col):
    """xT[p, j, col + i] = rows[i, k0 + p*tiles + j] for i < tokens (<= 128): TensorE transposes of token rows
    already in SBUF, several to a PSUM bank, each bank copied back by ScalarE."""
    per_bank = PSUM_BANK_BYTES // (PMAX * dtype_bytes(rows.dtype))
    row_elements = partitions * tiles
    for j0 in range(0, tiles, per_bank):
        group = min(per_bank, tiles - j0)
        bank = nl.ndarray((PMAX, per_bank, PMAX), dtype=rows.dtype, buffer=nl.psum)
        for j in range(group):
            nisa.nc_transpose(
                dst=bank[0:partitions, j, 0:tokens],
                data=rows[0:tokens, k0 + j0 + j : k0 + row_elements : tiles],
                engine=nisa.engine.tensor,
            )
        nisa.activation(dst=xT[0:partitions, j0 : j0 + group, col : col + tokens], op=nl.copy,
                        data=bank[0:partitions, 0:group, 0:tokens])


def multiply_rows_into(y, y_row0, y_col0, lhsT, w_block, partials, partial0, rows, cols, P, t, first, last):
    """y[y_row0 : y_row0 + rows, y_col0 : y_col0 + cols] (+)= lhsTᵀ · w_block, for one contraction block of t
    tiles of P partitions, 128 rows and TILE_N columns at a time: lhsT [P, t, rows] stationary, w_block
    [P, t, cols] moving, the t tiles summed in one PSUM bank. `partials` holds the fp32 sums of the earlier
    contraction blocks, one [128, cols] tile per 128 rows from tile `partial0` (None for a single block); the
    rows go out to HBM once the last block is in."""
    for r0 in range(0, rows, TILE_M):
        R = min(TILE_M, rows - r0)
        result = nl.ndarray((PMAX, cols), dtype=y.dtype, buffer=nl.sbuf) if last else None
        for n0 in range(0, cols, TILE_N):
            nt = min(TILE_N, cols - n0)
            acc = nl.ndarray((PMAX, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for j in range(t):
                nisa.nc_matmul(acc[0:R, 0:nt], stationary=lhsT[0:P, j, r0 : r0 + R],
                               moving=w_block[0:P, j, n0 : n0 + nt], accumulate=j > 0)
            partial = None if partials is None else partials[partial0 + r0 // TILE_M][0:R, n0 : n0 + nt]
            done = result[0:R, n0 : n0 + nt] if last else None
            evict_partial_sum(done, partial, acc[0:R, 0:nt], first, last)
        if last:
            nisa.dma_copy(dst=y[y_row0 + r0 : y_row0 + r0 + R, y_col0 : y_col0 + cols], src=result[0:R, 0:cols])


def evict_partial_sum(result, partial, psum, first, last):
    """Move one PSUM accumulation group out, combining contraction blocks in fp32.

    The only block goes straight to `result`; the first of several starts the fp32 `partial` in SBUF;
    middle blocks add onto it; the last adds it to PSUM while writing `result` in its own dtype.
    """
    if first and last:
        nisa.activation(dst=result, op=nl.copy, data=psum)
    elif first:
        nisa.activation(dst=partial, op=nl.copy, data=psum)
    elif last:
        nisa.tensor_tensor(dst=result, data1=partial, data2=psum, op=nl.add)
    else:
        nisa.tensor_tensor(dst=partial, data1=partial, data2=psum, op=nl.add)
