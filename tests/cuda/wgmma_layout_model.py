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
bad = 0
for d in (64, 128):
    BM, BN = 128, 128
    # Q (K-major A): warpgroup g rows 64g.., k-step kk: element (i, j) = Q[64g + i][16kk + j]
    for g in range(2):
        for kk in range(d // 16):
            s, l, sb = k_major_desc(base, BM, 64 * g, kk)
            for i in range(64):
                for j in range(16):
                    if hw_k_major(s, l, sb, i, j) != store_addr(base, BM, 64 * g + i, 16 * kk + j): bad += 1
    # K (K-major B, N = BN keys): element (n, j) = K[n][16kk + j]
    for kk in range(d // 16):
        s, l, sb = k_major_desc(base, BN, 0, kk)
        for n in range(BN):
            for j in range(16):
                if hw_k_major(s, l, sb, n, j) != store_addr(base, BN, n, 16 * kk + j): bad += 1
    # V (N-major B): element (k = key 16kk + j, n = dim) = V[16kk + j][n]
    for kk in range(BN // 16):
        s, l, sb = n_major_desc(base, BN, kk)
        for j in range(16):
            for n in range(d):
                if hw_mn_major(s, l, sb, j, n) != store_addr(base, BN, 16 * kk + j, n): bad += 1
# Backward (flash_bwd_sm90.cuh), BN = 128 keys, BM = 64 queries.
for d in (64, 128):
    BM, BN = 64, 128
    # S^T = K Q^T: A = K rows 64g.. (K-major), B = Q (K-major, N = BM queries).
    for g in range(2):
        for kk in range(d // 16):
            s_, l, sb = k_major_desc(base, BN, 64 * g, kk)
            for i in range(64):
                for j in range(16):
                    if hw_k_major(s_, l, sb, i, j) != store_addr(base, BN, 64 * g + i, 16 * kk + j): bad += 1
    for kk in range(d // 16):
        s_, l, sb = k_major_desc(base, BM, 0, kk)
        for n in range(BM):
            for j in range(16):
                if hw_k_major(s_, l, sb, n, j) != store_addr(base, BM, n, 16 * kk + j): bad += 1
    # dV += P^T dO: B = dO (N-major: k = query 16kk + j, n = dim).
    for kk in range(BM // 16):
        s_, l, sb = n_major_desc(base, BM, kk)
        for j in range(16):
            for n in range(d):
                if hw_mn_major(s_, l, sb, j, n) != store_addr(base, BM, 16 * kk + j, n): bad += 1
    # dQ = dS K: A = dS (M-major from dS^T stored [key][query]: element (m = query, k = key 16kk + j)),
    # B = K (N-major, the group's 64 columns: element (k = key, n = 64g + n)).
    for kk in range(BN // 16):
        s_, l, sb = n_major_desc(base, BN, kk)  # DsTile = GmmaTile<BN, BM>
        for j in range(16):
            for m in range(BM):
                if hw_mn_major(s_, l, sb, j, m) != store_addr(base, BN, 16 * kk + j, m): bad += 1
        for g in range(d // 64):
            s_, l, sb = n_major_desc(base + g * BN * 128, BN, kk)
            for j in range(16):
                for n in range(64):
                    if hw_mn_major(s_, l, sb, j, n) != store_addr(base, BN, 16 * kk + j, 64 * g + n): bad += 1
print("mismatches:", bad)
