"""The report of ``benchmarks/scaling_quality.py``: from its result records, the table of the
held-out loss gap to AdamW-allreduce against model size, the two plots (the gap against the
parameters; the loss against the bits each device sent, each size's Pareto front marked) and the
findings the section states (the best entry at ≥ 100× fewer bytes at the largest size, the trend of
the DiLoCo family's gaps)."""

from __future__ import annotations

import math
import os

import numpy as np

FAMILY = ("diloco_maxtext", "sparseloco_covenant", "muloco")
"""The entries whose papers report a gap that shrinks as the model grows."""
FEWER = 100  # "at ≥ 100× fewer bytes than allreduce"
PLOTS = ("scaling_quality_gap.png", "scaling_quality_bits.png")
"""The figures, written into ``benchmarks/`` (a ``--quick`` run's into its results' folder)."""


def gaps(records: list) -> dict:
  """``{(size, entry): [gap per seed]}``, a gap being held-out loss / the baseline's − 1."""
  out: dict = {}
  for r in records:
    out.setdefault((r["size"], r["entry"]), []).append(r["heldout_loss"] / r["allreduce_loss"] - 1)
  return out


def _sizes(records: list) -> list:
  """The sizes measured, smallest first, with their parameter counts."""
  params = {r["size"]: r["params"] for r in records}
  return sorted(params.items(), key=lambda item: item[1])


def _first(records: list, size: str, entry: str) -> dict:
  return next(r for r in records if (r["size"], r["entry"], r["seed"]) == (size, entry, 0))


def fewer_bytes(records: list, size: str, entry: str) -> float:
  """How many times fewer bits than the baseline the entry sent at ``size`` (seed 0)."""
  r = _first(records, size, entry)
  return r["allreduce_bits_per_device"] / r["bits_per_device"] if r["bits_per_device"] else math.inf


def crossing(params: list, gap: list, level: float = 0.01):
  """The size at which the least-squares line of ``gap`` against log10(parameters) reaches
  ``level``, and that line's slope per decade; the size is None where the line does not fall."""
  slope, intercept = np.polyfit(np.log10(params), gap, 1)
  if slope >= 0:
    return None, float(slope)
  return float(10 ** ((level - intercept) / slope)), float(slope)


def _cell(values: list) -> str:
  if len(values) == 1:
    return f"{values[0]:+.2%}"
  return f"{np.mean(values):+.2%} ± {np.std(values, ddof=1):.2%}"


def table(records: list, names: tuple) -> str:
  from benchmarks import common
  sizes, g = _sizes(records), gaps(records)
  header = (["entry"] + [f"gap at {p:,} params" for _, p in sizes]
            + ["fewer bytes (its largest)", "steps to AdamW's loss (its largest)"])
  rows = []
  for name in names:
    measured = [s for s, _ in sizes if (s, name) in g]
    if not measured:
      continue
    largest = measured[-1]  # the largest size this entry has run (a study may stop part-way)
    r = _first(records, largest, name)
    reached = r["steps_to_allreduce_loss"]
    rows.append([name] + [_cell(g[(s, name)]) if (s, name) in g else "-" for s, _ in sizes]
                + [f"{fewer_bytes(records, largest, name):,.0f}×",
                   f"{reached} / {r['steps']}" if reached else f"not in {r['steps']}"])
  return common.markdown_table(header, rows)


def findings(records: list, names: tuple) -> str:
  """The sentences the section states, with their numbers."""
  sizes, g = _sizes(records), gaps(records)
  (smallest, _), (largest, most) = sizes[0], sizes[-1]
  lines = []
  base = [r["heldout_loss"] for r in records if (r["size"], r["entry"]) == (smallest, names[0])]
  if len(base) > 1:
    # The baseline's own gap is 0 at every seed: the spread is the other entries'.
    spread = [np.std(v, ddof=1) for (s, n), v in g.items()
              if s == smallest and n != names[0] and len(v) > 1]
    lines.append(f"Seeds at {sizes[0][1]:,} parameters: AdamW-allreduce's held-out loss "
                 f"{np.mean(base):.4f} ± {np.std(base, ddof=1):.4f} ({len(base)} seeds, "
                 f"{np.std(base, ddof=1) / np.mean(base):.2%}); " + (
                     f"the gaps' standard deviation over seeds, median over the entries run with "
                     f"several ({len(spread)}), {np.median(spread):.2%}: a gap of 1% there is "
                     f"{0.01 / np.median(spread):.1f} of them." if spread and np.median(spread)
                     else "no other entry has run more than one seed yet."))
  frugal = [n for n in names[1:] if (largest, n) in g and fewer_bytes(records, largest, n) >= FEWER]
  if frugal:
    best = min(frugal, key=lambda n: np.mean(g[(largest, n)]))
    gap = np.mean(g[(largest, best)])
    verdict = "within" if gap <= 0.01 else "not within"
    lines.append(f"At the largest size ({most:,} parameters) the best entry at ≥ {FEWER}× fewer "
                 f"bytes than allreduce is {best} ({fewer_bytes(records, largest, best):,.0f}× "
                 f"fewer), {gap:+.2%}: {verdict} 1% of AdamW-allreduce's held-out loss.")
    if gap > 0.01:
      lines.append(_trend(records, best, sizes, g))
  for name in FAMILY:
    measured = [(p, np.mean(g[(s, name)])) for s, p in sizes if (s, name) in g]
    if len(measured) < 2:
      continue
    shrinks = all(b[1] < a[1] for a, b in zip(measured, measured[1:]))
    numbers = " → ".join(f"{v:+.2%}" for _, v in measured)
    lines.append(f"{name}: {numbers} from {measured[0][0]:,} to {measured[-1][0]:,} parameters; "
                 + ("it shrinks with size at every step, as its paper reports; " if shrinks else
                    "it does not shrink at every step, where its paper reports that it does; ")
                 + _trend(records, name, sizes, g, short=True))
  return "\n\n".join(lines)


def _trend(records, name, sizes, g, short=False) -> str:
  measured = [(p, np.mean(g[(s, name)])) for s, p in sizes if (s, name) in g]
  at, slope = crossing(*zip(*measured))
  head = "" if short else f"{name}'s trend: "
  if at is None:
    return f"{head}its gap does not fall with size (least-squares slope {slope:+.2%} a decade)."
  return (f"{head}its gap falls {-slope:.2%} a decade of parameters (least squares over "
          f"{len(measured)} sizes) and would reach 1% at about {at:,.3g} parameters.")


def pareto(points: list) -> list:
  """The points (bits, loss) no other point beats in both, fewest bits first."""
  front, best = [], math.inf
  for bits, loss in sorted(points):
    if loss < best:
      front.append((bits, loss))
      best = loss
  return front


def plots(records: list, names: tuple, folder: str) -> list:
  """Draws the two figures into ``folder``; their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from jaxcomp.train.plots import line_styles
  sizes, g = _sizes(records), gaps(records)
  styles = dict(zip(names, line_styles(len(names))))
  fig, ax = plt.subplots(figsize=(8, 5))
  for name in names[1:]:
    measured = [(p, 100 * np.mean(g[(s, name)]), 100 * np.std(g[(s, name)]))
                for s, p in sizes if (s, name) in g]
    if measured:
      x, y, err = zip(*measured)
      ax.errorbar(x, y, yerr=err, label=name, capsize=3, **styles[name])
  ax.axhline(1, color="grey", linestyle=":", label="1%")
  ax.axhline(0, color="black", linewidth=0.8)
  ax.set(xscale="log", xlabel="parameters", ylabel="held-out loss / AdamW-allreduce's − 1 (%)",
         title="gap to AdamW data-parallel training against model size (chars, 8 devices)")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  paths = [os.path.join(folder, PLOTS[0]), os.path.join(folder, PLOTS[1])]
  fig.savefig(paths[0], dpi=110)
  plt.close(fig)
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.5), squeeze=False)
  for ax, (size, params) in zip(axes[0], sizes):
    points = {}
    for name in names:
      if (size, name) in g:
        r = _first(records, size, name)
        points[name] = (r["bits_per_device"], r["heldout_loss"])
        ax.scatter(*points[name], color=styles[name]["color"], marker=styles[name]["marker"],
                   label=name)
    front = pareto(list(points.values()))
    ax.step(*zip(*front), where="post", color="black", linewidth=1, label="Pareto front")
    ax.set(xscale="log", xlabel="bits sent per device, whole run", ylabel="held-out loss",
           title=f"{params:,} parameters")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(paths[1], dpi=110)
  plt.close(fig)
  return paths


def report(records: list, names: tuple, folder: str) -> str:
  """The section's body: how the study ran, the table, the findings and the two plots."""
  if not records:
    return "No results yet."
  names = tuple(n for n in names if any(r["entry"] == n for r in records))
  paths = plots(records, names, folder)
  hours = sum(r["seconds"] for r in records) / 3600
  sizes = _sizes(records)
  first = records[0]
  tokens = {r["size"]: (r["tokens"], r["steps"], r["batch"]) for r in records if r["seed"] == 0}
  runs = "; ".join(f"{p:,} parameters: {tokens[s][1]:,} steps of {tokens[s][2]} sequences "
                   f"({tokens[s][0]:,} tokens)" for s, p in sizes)
  return (f"Measured {first['date'][:10]} to {records[-1]['date'][:10]} on {first['machine']}; "
          f"{len(records)} runs, {hours:.1f} hours of training (compiling aside). {runs}. "
          f"Gap: held-out loss / {names[0]}'s − 1 at the same size and seed (mean ± standard "
          "deviation over seeds where there are several); fewer bytes: the bits "
          f"{names[0]} sent / the entry's, whole run, per device.\n\n"
          + table(records, names) + "\n\n" + findings(records, names) + "\n\n"
          + "\n".join(f"![{os.path.basename(p)}](benchmarks/{os.path.basename(p)})"
                      for p in paths))
