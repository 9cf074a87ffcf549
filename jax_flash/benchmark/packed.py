"""Packed documents (--packed-documents D): each row holds D documents of seq / D tokens, and
jax_flash's packed kernel is timed beside the same tokens as separate rows (issue 16's figure).

Every case of a packed run is packed (cases.packed_cases; Case.documents). The peers take its
documents as each can express them (peers: jax_flash q_segment_ids = kv_segment_ids, jax.nn
and tokamax a (B, 1, T, S) bool mask formed in the step, Pallas its segment ids, PyTorch a
bool attn_mask), or read "unavailable" with the reason: where they have no such argument, or
their kernel refuses the call at trace time (a NotImplementedError). jax_flash's "cpu" and
"cuda" kernels both take segment ids. Beside them runs the baseline,
"jax_flash_separate": jax_flash on the same inputs as B * D rows of S / D tokens, and the
table gives jax_flash's packed time over it ("packed/separate time").
"""

from __future__ import annotations

import dataclasses

from jax_flash.benchmark.columns import DOCUMENTS_COLUMN
from jax_flash.benchmark.peers import separate_flash_peer
from jax_flash.benchmark.platforms import (FLASH_KERNELS, Platform, beside_baseline,
                                           with_case_column)

# The ratio column: jax_flash's packed time over the separate rows' time.
RATIO_HEADER = "packed/separate time"


def with_packed_documents(platform: Platform, deterministic: bool = False) -> Platform:
  """The platform for a run of packed cases: jax_flash (packed), its separate-rows baseline,
  then the other peers; its table keeps the platform's case columns with the docs column after
  the causal one, and gives the baseline's rate beside jax_flash's, the packed time over the
  separate one's, and the other peers' columns as the platform has them."""
  flash, *others = platform.peers
  separate = separate_flash_peer(FLASH_KERNELS[platform.name], platform.device_kind,
                                 deterministic)
  platform = with_case_column(platform, DOCUMENTS_COLUMN)
  columns = beside_baseline(platform, separate, flash, others, RATIO_HEADER)
  return dataclasses.replace(platform, peers=(flash, separate, *others), columns=columns)


def packed_caption(platform: Platform, documents: int) -> str:
  """The caption line of a packed run: how each of the platform's peers takes the documents,
  and how FLOPs count."""
  mask = "a (B, 1, T, S) bool mask formed in the step"
  forms = {"jax_flash": "q_segment_ids = kv_segment_ids",
           "jax_flash_separate": f"the same tokens as batch*{documents} separate rows",
           "cudnn": mask, "tokamax": mask, "xla": mask, "pallas": "its (B, T) segment ids",
           "torch": "a (B, 1, T, S) bool attn_mask, the causal mask folded in"}
  peers = "; ".join(f"{peer.name}: {forms[peer.name]}" for peer in platform.peers
                    if peer.name in forms)
  return (f"packed documents: {documents} per row of seq/{documents} tokens each, end to end "
          f"(ids sorted), causal within each document in the causal cases; {peers}. FLOPs "
          f"count only the pairs within documents (1/{documents} of a dense row's), so packed "
          f"and separate rates compare")
