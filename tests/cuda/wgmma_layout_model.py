"""A model of wgmma's shared-memory addressing, to reason about GmmaTile (flash_fwd_sm90.cuh) on a
machine with no GPU: the canonical layouts of the PTX ISA (9.7.15.5.1.2; K-major and MN-major with
the 128-byte swizzle, i.e. Swizzle<3,4,3> on byte addresses, patterns anchored at 1 KiB) against
the tile's storage and the descriptors k_major / n_major compute, for the forward's Q, K and V
operands and the backward's K, V, Q, dO and dS^T. It mirrors the C++ arithmetic (keep them in step); tests/cuda/wgmma_layout_check.cu
checks the real thing on a GPU.

    python tests/cuda/wgmma_layout_model.py     # prints the mismatches (0)
"""
def swz(addr): return addr ^ (((addr >> 7) & 7) << 4)

def gmma_offset(rows, row, chunk):   # GmmaTile::offset in elements
    return (chunk // 8) * rows * 64 + row * 64 + ((chunk % 8) ^ (row % 8)) * 8

def store_addr(base, rows, r, c):    # byte address of element (r, c) in a GmmaTile
    return base + 2 * (gmma_offset(rows, r, c // 8) + c % 8)

def k_major_desc(tile, rows, row0, kk):  # GmmaTile::k_major -> (start, lbo, sbo)
    return tile + (kk // 4) * rows * 128 + row0 * 128 + (kk % 4) * 32, 16, 1024

def n_major_desc(tile, rows, kk):
    return tile + kk * 16 * 128, rows * 128, 1024

def hw_k_major(start, lbo, sbo, mn, k):   # ((8,m),(T,2k)):((8T,SBO),(1,T)), T = 8 bf16
    off = (mn % 8) * 64 * 2 + (mn // 8) * sbo + k * 2
    return swz(start + off)

def hw_mn_major(start, lbo, sbo, k, n):   # ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
    off = (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 64 * 2 + (k // 8) * sbo
    return swz(start + off)

base = 0x10000  # 1 KiB aligned

def k_major_mismatches(rows, row0, count, kk):
    """A K-major operand of a GmmaTile<rows, .>: its rows row0 .. row0 + count - 1 (the M or N
    index), k-step kk (columns 16 kk ..)."""
    s, l, sb = k_major_desc(base, rows, row0, kk)
    return sum(hw_k_major(s, l, sb, i, j) != store_addr(base, rows, row0 + i, 16 * kk + j)
               for i in range(count) for j in range(16))

def n_major_mismatches(rows, col0, count, kk):
    """An MN-major operand of a GmmaTile<rows, .>: k-step kk (rows 16 kk ..), its columns col0 ..
    col0 + count - 1 (col0 a multiple of 64: the descriptor starts at that 64-column block)."""
    s, l, sb = n_major_desc(base + (col0 // 64) * rows * 128, rows, kk)
    return sum(hw_mn_major(s, l, sb, j, n) != store_addr(base, rows, 16 * kk + j, col0 + n)
               for j in range(16) for n in range(count))

bad = 0
for d in (64, 128):
    # Forward (flash_fwd_sm90.cuh), BM = BN = 128.
    BM, BN = 128, 128
    for kk in range(d // 16):
        bad += sum(k_major_mismatches(BM, 64 * g, 64, kk) for g in range(2))  # Q: A of warpgroup g
        bad += k_major_mismatches(BN, 0, BN, kk)                               # K: B of S = Q K^T
    for kk in range(BN // 16):
        bad += n_major_mismatches(BN, 0, d, kk)                                # V: B of O += P V
    # Backward (flash_bwd_sm90.cuh), BN = 128 keys, BM = 64 queries.
    BM, BN = 64, 128
    for kk in range(d // 16):
        bad += sum(k_major_mismatches(BN, 64 * g, 64, kk) for g in range(2))  # K, V: A of S^T, dP^T
        bad += k_major_mismatches(BM, 0, BM, kk)                               # Q, dO: B of S^T, dP^T
    for kk in range(BM // 16):
        bad += n_major_mismatches(BM, 0, d, kk)                                # dO, Q: B of dV, dK
        bad += sum(k_major_mismatches(BN, 64 * g, 64, kk) for g in range(2))  # dS^T: A of dK
    for kk in range(BN // 16):
        bad += n_major_mismatches(BN, 0, BM, kk)                               # dS^T read as dS: A of dQ
        bad += sum(n_major_mismatches(BN, 64 * g, 64, kk) for g in range(d // 64))  # K: B of dQ
print("mismatches:", bad)
