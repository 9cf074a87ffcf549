"""jax_flash: FlashAttention for JAX.

``jax_flash.dot_product_attention`` is a drop-in for ``jax.nn.dot_product_attention`` backed by
tiled FlashAttention kernels registered as XLA FFI custom calls.
"""

from jax_flash._attention import dot_product_attention
from jax_flash._block_sparse import BLOCK_MASK_BLOCK, block_mask_shape
from jax_flash._context_parallel import context_parallel_attention, ring_attention
from jax_flash._paged import paged_attention
from jax_flash._registry import cpu_kernel_isa, has_platform
from jax_flash._ring import zigzag_indices

__version__ = "0.1.0"

__all__ = [
    "dot_product_attention", "paged_attention", "ring_attention", "context_parallel_attention",
    "zigzag_indices", "cpu_kernel_isa", "has_platform", "BLOCK_MASK_BLOCK", "block_mask_shape",
    "__version__",
]
