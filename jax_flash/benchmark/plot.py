"""plot.png: FLOP rate against sequence length, a line per peer and pass."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from jax_flash.benchmark.cases import PASSES
from jax_flash.benchmark.measure import Measurement
from jax_flash.benchmark.platforms import Platform
from jax_flash.benchmark.runner import log


def write_plot(path: pathlib.Path, platform: Platform, measurements: Sequence[Measurement],
               title: str) -> None:
  """Writes a PNG of FLOP rate against sequence length: a panel per head dim (rows) and causal
  mode (columns), a line per peer (colour) and pass (forward solid with circles,
  forward+backward dashed with squares).

  Without matplotlib, warns on stderr and writes nothing.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as e:
    log(f"jax_flash benchmark: warning: no plot written, matplotlib is missing ({e})")
    return
  unit = platform.rate_unit
  seqs = sorted({m.case.seq for m in measurements})
  head_dims = sorted({m.case.head_dim for m in measurements})
  # "192/128" with Hv; grouped-query: "64, heads 16/4" (query/key-value heads).
  labels = {m.case.head_dim: m.case.head_dim_label + ("" if m.case.kv_heads is None
                                                      else f", heads {m.case.heads_label}")
            for m in measurements}
  causal_modes = sorted({m.case.causal for m in measurements})
  figure = Figure(figsize=(6 * len(causal_modes), 4 * len(head_dims)), layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.subplots(len(head_dims), len(causal_modes), squeeze=False)
  for row, head_dim in enumerate(head_dims):
    for column, causal in enumerate(causal_modes):
      ax = axes[row][column]
      for colour, peer in enumerate(platform.peers):
        for pass_name, line_style, marker in zip(PASSES, ("-", "--"), "os", strict=True):
          points = sorted((m.case.seq, m.flop_rate(unit)) for m in measurements
                          if m.ok and m.peer == peer.name and m.pass_name == pass_name
                          and m.case.head_dim == head_dim and m.case.causal == causal)
          if points:
            seq_values, rates = zip(*points, strict=True)
            ax.plot(seq_values, rates, line_style, marker=marker, color=f"C{colour}",
                    label=f"{peer.name} {pass_name}")
      ax.set_xscale("log", base=2)
      ax.minorticks_off()
      ax.set_xticks(seqs, [str(seq) for seq in seqs])
      ax.set_ylim(bottom=0)
      ax.grid(alpha=0.3)
      ax.set_title(f"head dim {labels[head_dim]}, {'causal' if causal else 'not causal'}")
      ax.set_xlabel("sequence length")
      ax.set_ylabel(unit)
      if ax.lines:
        ax.legend(fontsize="x-small")
  figure.suptitle(title)
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)
