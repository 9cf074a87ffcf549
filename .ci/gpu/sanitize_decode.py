"""Small odd-shaped calls of the CUDA split-KV decode kernel (contiguous and paged, one and
several key chunks, row tiles, head dims 40/96/256, lengths 0/partial/full, windows, a reached
bad page entry) for compute-sanitizer (memcheck, racecheck, initcheck):

  compute-sanitizer --tool memcheck python3 .ci/gpu/sanitize_decode.py

Sets JAX_FLASH_CUDA_DECODE=kernel itself (jax_flash reads it once, at import).
"""

from __future__ import annotations

import os

os.environ["JAX_FLASH_CUDA_DECODE"] = "kernel"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash import _decode  # noqa: E402

# (batch, T, S, heads_q, heads_k, head_dim, causal, window, splits)
CONTIGUOUS = [
    (3, 1, 700, 8, 2, 40, False, None, 1),
    (2, 4, 333, 32, 2, 96, True, (50, 0), 5),   # 64 packed rows: 4 row tiles
    (1, 2, 1025, 4, 4, 256, False, (7, 1), 3),
]
# (batch, T, page_size, pages_per_seq, heads_q, heads_k, head_dim, causal, bad entry)
PAGED = [
    (2, 1, 16, 9, 8, 2, 64, False, False),
    (2, 4, 1, 70, 4, 1, 128, True, False),
    (2, 2, 100, 3, 8, 8, 40, True, True),
]


def main() -> None:
  for i, (b, t, s, n, kh, h, causal, window, splits) in enumerate(CONTIGUOUS):
    ks = jax.random.split(jax.random.key(i), 3)
    pad = -h % 8
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
               zip(ks, ((b, t, n, h + pad), (b, s, kh, h + pad), (b, s, kh, h + pad))))
    lens = jnp.array([s, 0, s // 3][:b], jnp.int32)
    left, right = window or (-1, -1)
    jax.block_until_ready(_decode.decode_fwd(
        q, k, v, jnp.full((b,), t, jnp.int32), lens, scale=h ** -0.5, is_causal=causal,
        window_left=left, window_right=right, splits=splits, implementation="cuda"))
  for i, (b, t, page, pages, n, kh, h, causal, bad) in enumerate(PAGED):
    ks = jax.random.split(jax.random.key(100 + i), 3)
    num_pages = b * pages + 3
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float16)
    kp, vp = (jax.random.normal(key, (num_pages, page, kh, h), jnp.float16) for key in ks[1:])
    table = jax.random.permutation(ks[0], num_pages)[:b * pages].reshape(b, pages).astype(jnp.int32)
    if bad:
      table = table.at[1, 1].set(num_pages + 5)
    lens = jnp.array([page * pages, page + 1][:b], jnp.int32)
    jax.block_until_ready(jax_flash.paged_attention(q, kp, vp, table, lens, is_causal=causal,
                                                    implementation="cuda"))


if __name__ == "__main__":
  main()
