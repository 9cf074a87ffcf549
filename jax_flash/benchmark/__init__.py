"""Benchmark CLI: jax_flash beside its peers, measured in one run.

    python -m jax_flash.benchmark [--platform cpu|gpu] [--seqs 512 1024 ...]
                                  [--head-dims 64,128,256] [--causal both|yes|no]
                                  [--reps N] [--out DIR] [--quick] [--deterministic]
                                  [--skip PEER ...] [--block-density D]
                                  [--logits-soft-cap C] [--alibi] [--sinks] [--dropout-rate R]
                                  [--packed-documents D] [--value-head-dim HV]
                                  [--heads N] [--kv-heads K]

Each platform (`platforms`) has a list of cases (`cases`), a list of peers (`peers`) and a table
layout (`columns`):

- gpu: the FlashAttention benchmark's shapes: 16k tokens in all (batch = 16384 // seq), hidden
  2048 (heads = 2048 // head dim), bfloat16, seq 512 ... 16384, head dims 64, 128, 256; peers
  jax_flash's CUDA kernels, cuDNN through jax.nn.dot_product_attention, tokamax's Mosaic GPU
  attention (where `import tokamax` works: it needs Python >= 3.12), XLA through
  jax.nn.dot_product_attention, and Pallas' Triton FlashAttention (`mha`).
- cpu: B=1, 4 heads, head dim 64, float32, seq 512 ... 8192; peers jax_flash's CPU kernels, XLA
  and PyTorch's scaled_dot_product_attention.

A peer builds, for one case, a step per pass that runs the forward pass to completion and one that
runs forward and backward; or it reports why it is unavailable, or fails and the benchmark records
the reason (and goes on) (`runner`). Every step is compiled, warmed up, then repeated (fewer times
for slow peers) and the median time is reported (`measure`).

FLOPs follow the FlashAttention benchmarks: forward 4·B·S²·N·H, halved when causal; forward plus
backward 3.5× the forward. The table's "bwd" rows are the backward alone, derived: the median
fwd+bwd time less the median fwd time of the same peer in the same run (2.5× the forward's
FLOPs). Memory: XLA's compiled temp bytes of each pass (the figure to compare), and the device's
peak bytes in use after it where the runtime reports them (a high-water mark over the whole
process, so it only grows). Absolute times drift between machines; compare peers of one run.

With --block-density D, every case runs block-sparse (``block_mask``: a random mask of 128 x 128
blocks (jax_flash.BLOCK_MASK_BLOCK), a fraction D of them set, seed cases.BLOCK_MASK_SEED, every query block row's diagonal
block set, shared by batch and heads), each followed by its dense twin (no mask) in the same run;
the table gains a "blocks" column (the share of the dense FLOPs a row computes) and, below it,
jax_flash's block-sparse speed-up over dense per case and pass. A block-sparse row's FLOPs count
only the computed blocks (the dense convention times that share; diagonal blocks half when
causal), for every peer: XLA, which takes the mask expanded to a (T, S) bool array and computes
every block, is rated on the same useful work. Peers that take no block mask (PyTorch's flash
kernel, cuDNN, Pallas, tokamax, and jax_flash's CUDA kernels for now) read "unavailable" there.

With --deterministic, jax_flash runs with `deterministic=True` (its bit-reproducible backward),
beside the same peers. --skip leaves peers out (recorded as unavailable, "skipped (--skip)").

With a score variant (`variants`: --logits-soft-cap C, --alibi, --sinks, --dropout-rate R, any
combination), each case times the plain jax_flash ("jax_flash") and jax_flash with the variant
("jax_flash+variant") on the same inputs, and every other peer with the variant ("cudnn+variant",
...) where it takes it; the table gives the variant's rate (the same FLOP count as the plain
kernel's) and its time over the plain one's ("variant/plain time"), and above it the variant
(also in results.json: settings' "variant"). A peer that cannot take the variant, or a case its
kernel refuses at trace time (NotImplementedError: the CUDA kernels' dropout), reads
"unavailable" with the reason.

With --packed-documents D (`packed`), every case is packed: each row holds D documents of seq/D
tokens end to end (ids sorted; every seq must be divisible by D), and a token attends only
within its document (causal within it in the causal cases). jax_flash runs it with
q_segment_ids = kv_segment_ids, and beside it, on the same inputs, "jax_flash_separate" runs
the same tokens as batch*D separate rows of seq/D (the inputs reshaped: the baseline of issue
16); the table gives the docs column ("16x1024"), both rates and jax_flash's packed time over
the separate one's ("packed/separate time"). The other peers run the packed mask where they
can express it: jax.nn's xla and cudnn and tokamax a (B, 1, T, S) bool mask formed in the step,
Pallas its segment ids, PyTorch's CPU flash kernel a bool attn_mask (the causal mask folded
in); else, or where a kernel refuses the call at trace time (a NotImplementedError; cuDNN also
a ValueError), they read "unavailable" with the reason. jax_flash's "cpu" and "cuda" kernels
both take segment ids (each skips the blocks whose ids cannot meet: a row of sorted documents
visits only the blocks along their diagonals). A packed
row's FLOPs count only the pairs within documents (1/D of the dense convention's: each of D
documents (seq/D)^2, halved when causal), which is also what the separate rows compute, so
the rates compare. results.json: settings' "packed_documents", each measurement's
"documents".

With --value-head-dim HV, every case's value (and so its output and output cotangent) has head
dim HV, (B, S, N, HV), while query and key keep the case's head dim H (MLA: DeepSeek-V2's
192/128); the hdim column reads "H/HV", results.json records settings' and each measurement's
"value_head_dim". FLOPs count each product over its own head dim (cases.PASS_PRODUCTS): forward
2·B·N·T·S·(H + HV), backward 2·B·N·T·S·(3H + 2HV), halved when causal; with HV = H exactly the
counts above. jax_flash and tokamax (whose dot_product_attention takes a value of another head
dim) run such cases; jax.nn's cuDNN and XLA, Pallas' mha and PyTorch's CPU flash kernel read
"unavailable" with the reason (`peers`).

With --heads N, every case has N query heads instead of the grid's (cpu 4, gpu 2048 // head
dim; the GPU batch stays 16384 // seq). With --kv-heads K (grouped-query attention; multi-query
with K = 1), every case's key and value have K heads, (B, S, K, H) and (B, S, K, HV), each
shared by N/K query heads, while the query, the output and its cotangent keep N; every case's N
must be divisible by K (an argument error naming both otherwise), and neither option applies to
--preset decode (its shapes have their own heads). With either option the table gains a heads
column after seq ("N", or "N/K"), results.json records settings' "heads" and "kv_heads" (and
each measurement its case's "heads" and "kv_heads"); FLOPs count the query heads, the same as
with K = N. Each peer gets k and v of K heads as they are (none repeats them to N, which would
change the work): jax_flash, jax.nn's XLA and cuDNN, and tokamax take them natively (probed at
trace time where a kernel may refuse), PyTorch's CPU flash kernel with enable_gqa=True where it
takes that (probed: torch 2.13's does); Pallas' mha, which indexes k and v by the query head,
reads "unavailable" with the reason (`peers`).

With --out DIR: results.json (environment, settings, every measurement) and table.md, rewritten
after each case so that an interrupted run keeps what it measured (`report`), and plot.png at the
end (`plot`).
"""

from jax_flash.benchmark.cases import (FWD_BWD_FLOP_FACTOR, PASSES, Case, Inputs,
                                       block_sparse_cases, cpu_cases, document_ids, gpu_cases,
                                       make_inputs, packed_cases)
from jax_flash.benchmark.cli import main, parse_args, positive_ints
from jax_flash.benchmark.columns import Column, Row
from jax_flash.benchmark.measure import (TIME_BUDGET_S, Compiled, Measurement, check_fits,
                                         failure_reason, peak_bytes_in_use, time_step)
from jax_flash.benchmark.packed import packed_caption, with_packed_documents
from jax_flash.benchmark.peers import TOKAMAX_GPU, Peer, flash_peer, jax_peer
from jax_flash.benchmark.platforms import CPU, GPU, PLATFORMS, Platform, with_deterministic_flash
from jax_flash.benchmark.plot import write_plot
from jax_flash.benchmark.provenance import accelerator_packages, environment
from jax_flash.benchmark.report import TABLE_PASSES, format_table, with_backward, write_results
from jax_flash.benchmark.runner import measure_peer, run
from jax_flash.benchmark.variants import Variant, with_variant

# The name examples/bench_ring.py imports (from the single-file module this package replaces).
_accelerator_packages = accelerator_packages

__all__ = [
    "CPU", "FWD_BWD_FLOP_FACTOR", "GPU", "PASSES", "PLATFORMS", "TABLE_PASSES", "TIME_BUDGET_S",
    "TOKAMAX_GPU", "Case", "Column", "Compiled", "Inputs", "Measurement", "Peer", "Platform",
    "Row", "accelerator_packages", "block_sparse_cases", "check_fits", "cpu_cases",
    "document_ids", "environment", "failure_reason",
    "flash_peer", "format_table", "gpu_cases", "jax_peer", "main", "make_inputs", "measure_peer",
    "packed_caption", "packed_cases", "parse_args", "peak_bytes_in_use", "positive_ints", "run",
    "time_step", "Variant", "with_backward", "with_deterministic_flash",
    "with_packed_documents", "with_variant", "write_plot", "write_results",
]
