"""The main job's plots (matplotlib, imported where a figure is drawn).

``figure`` is ``OUT/loss.png``: the held-out loss against step, cumulative bytes, the modelled
wall-clock at each link speed and the wall-clock over a timed link, then where compression pays
off (``payoff``). ``line_styles`` and ``draw_payoff`` are shared with the planner's plot.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxcomp.train.runs import WINDOW, Run, modelled_to_target, rate_label, target_of


MARKERS = "os^Dv<>pP*X"
"""Line markers, cycled with a period (11) that shares no factor with the colours' (10 or 20)."""


def line_styles(count: int) -> list:
  """``count`` matplotlib line styles (colour, marker, dashes), no two alike: tab10's colours up to
  10 lines, tab20's beyond, each line with its own colour and marker pair (up to 220 lines); solid
  lines, then dashed ones after 20."""
  import matplotlib
  colours = matplotlib.colormaps["tab10" if count <= 10 else "tab20"].colors
  return [{"color": colours[i % len(colours)], "marker": MARKERS[i % len(MARKERS)],
           "linestyle": "-" if i < 20 else "--"} for i in range(count)]


def loss_limits(runs: Sequence[Run], target: float) -> tuple:
  """The loss axis: from just below the lowest held-out loss up to 1.5× the target, so that runs
  far above the target (diverging or barely training) leave the target's neighbourhood readable."""
  finite = [v for r in runs for v in (r.held_out(e[0])[0] for e in r.evals[1:]) if np.isfinite(v)]
  low = min(finite + [target])
  high = max(1.5 * target, low + 0.1 * abs(target) + 1e-3)
  return low - 0.03 * (high - low), high


def payoff(ax, runs: Sequence[Run], styles: Sequence[dict], world: int,
           gbits: Sequence[float]) -> None:
  """Draws on ``ax`` each run's modelled wall-clock to target as a ratio to the baseline's, against
  the link speed (a decade below ``gbits`` to their top, and at least 0.01–100 Gbit/s): below 1,
  the compressor pays off at that speed. Runs that never reached the target have no line."""
  speeds = np.geomspace(min(min(gbits) / 10, 0.01), max(max(gbits), 100), 25)
  modelled = modelled_to_target(runs, world, speeds)
  base, _ = target_of(runs)
  curves = {r.name: [modelled[g][r.name] / modelled[g][base.name] for g in speeds]
            for r in runs if modelled[speeds[0]][r.name] is not None}
  draw_payoff(ax, speeds, curves, {r.name: style for r, style in zip(runs, styles)},
              f"modelled wall-clock to target / {base.name}'s",
              f"where compression pays off (< 1), modelled, W = {world}")


def draw_payoff(ax, speeds: Sequence[float], curves: dict, styles: dict, ylabel: str,
                title: str) -> None:
  """Draws ``curves`` (``{name: [time / the baseline's at each of speeds]}``) against the link
  speed, each in ``styles[name]``, with the line of 1 (below it, the entry pays off): the "where
  compression pays off" panel of the job (``payoff``) and of the planner."""
  for name, ratios in curves.items():
    ax.plot(speeds, ratios, **styles[name], label=name, lw=1.3, ms=4, markevery=3)
  ax.axhline(1.0, color="black", lw=0.8, ls="--")
  ax.set(xscale="log", yscale="log", xlabel="link speed per worker (Gbit/s)", ylabel=ylabel,
         title=title)


def figure(runs: Sequence[Run], title: str, world: int = 1, gbits: Sequence[float] = ()):
  """The held-out loss against step, against cumulative bytes sent, against the wall-clock
  modelled at each of ``gbits`` for ``world`` workers and — when a link was timed — against
  wall-clock over it, every point an evaluation after the start; then the modelled wall-clock to
  target against link speed (``payoff``). A matplotlib ``Figure``. Every line has its own colour
  and marker; the loss axis is the target's neighbourhood (``loss_limits``)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  linked = all(r.link_seconds for r in runs)
  curves = 2 + len(gbits) + linked  # panels of held-out loss
  panels = curves + bool(gbits)
  columns = min(panels, 3)
  rows = -(-panels // columns)
  fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False)
  axes = axes.ravel()
  for ax in axes[1:curves]:
    ax.sharey(axes[0])
  _, target = target_of(runs)
  styles = line_styles(len(runs))
  for r, style in zip(runs, styles):
    steps = np.asarray([e[0] for e in r.evals[1:]])  # measured points after the start
    loss = [r.held_out(s)[0] for s in steps]
    line = dict(style, label=r.name, lw=1.3, ms=4, markevery=max(len(steps) // 8, 1))
    axes[0].plot(steps, loss, **line)
    sent = np.cumsum([0.0] + [r.program_bytes[r.phase_at(t)] for t in range(len(r.losses))])
    axes[1].plot(sent[steps] / 1e6, loss, **line)
    per_step = [r.modelled_seconds(g, world) for g in gbits] + ([r.link_seconds] if linked else [])
    for ax, seconds in zip(axes[2:], per_step):
      clock = np.cumsum([0.0] + [seconds[r.phase_at(t)] for t in range(len(r.losses))])
      ax.plot(clock[steps], loss, **line)
  axes[0].set(xlabel="step", ylabel=f"held-out loss (mean of {WINDOW} evaluations)", title=title)
  axes[1].set(xlabel="cumulative MB sent per device", xscale="log", title="against bytes")
  for ax, g in zip(axes[2:], gbits):
    ax.set(xlabel="wall-clock, modelled (s)", xscale="log",
           title=f"modelled: W = {world}, {rate_label(g)} per worker")
  if linked:
    axes[2 + len(gbits)].set(xlabel="wall-clock over the link (s)", xscale="log",
                             title="against wall-clock over the link")
  if gbits:
    payoff(axes[curves], runs, styles, world, gbits)
  for ax in axes[:curves]:
    ax.axhline(target, color="black", lw=0.8, ls="--")
  for ax in axes[:panels]:
    ax.grid(alpha=0.3)
  for ax in axes[panels:]:
    ax.set_visible(False)
  plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")  # 0.01, not 10⁻²
  for ax in axes[1:panels]:  # log axes: decades labelled plainly, no crowded minor labels
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  if gbits:
    axes[curves].yaxis.set_major_formatter(plain)
    axes[curves].yaxis.set_minor_formatter(plain)
  axes[0].set_ylim(*loss_limits(runs, target))
  axes[0].legend(fontsize=8, ncol=2 if len(runs) > 12 else 1)
  fig.tight_layout()
  return fig


def plot(runs: Sequence[Run], path: str, title: str, world: int = 1,
         gbits: Sequence[float] = ()) -> None:
  """Saves ``figure`` to ``path``."""
  import matplotlib.pyplot as plt
  fig = figure(runs, title, world, gbits)
  fig.savefig(path, dpi=110)
  plt.close(fig)
