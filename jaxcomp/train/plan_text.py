"""The planner's text and plot: the recommendation first, then the tables, then the source of every
figure (``planner.plan`` fills a ``Plan``; this writes it)."""

from __future__ import annotations

from typing import Sequence

from jaxcomp.train import evidence, fsdp_plan, network, step_cost, units
from jaxcomp.train.plots import draw_payoff, line_styles

GIB = 2**30


def _gbit(g: float) -> str:
  return (f"{g:,.0f} Gbit/s" if g >= 100 else f"{g:.3g} Gbit/s" if g >= 1
          else f"{1e3 * g:.3g} Mbit/s")


def _speed(kind_g, bound: bool = False) -> str:
  if kind_g is None:
    return "-"
  kind, g = kind_g
  if kind == "always":
    return f"wins at {step_cost.SPEEDS[0]:g}–{step_cost.SPEEDS[1]:,.0f} Gbit/s"
  if kind == "never":
    return f"never in {step_cost.SPEEDS[0]:g}–{step_cost.SPEEDS[1]:,.0f} Gbit/s"
  if bound:  # the entry needs at least its steps ratio: it wins below at most this speed
    return f"below at most {_gbit(g)}" if kind == "below" else f"above at least {_gbit(g)}"
  return f"{kind} {_gbit(g)}"


def _params(n: float) -> str:
  return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,.0f}"


def _steps(row) -> str:
  if not row.points:
    return "not measured"
  tag = f" [{row.steps_source}]" if row.steps_source.startswith("J") else " [study]"
  if row.diverged:
    return "diverged" + tag
  at = f" at {_params(row.points[-1].params)}"
  if row.steps_bound:
    return f"> {row.steps_ratio:.2f}x{at}" + tag
  return f"{row.steps_ratio:.2f}x{at}" + tag


def _ms(value) -> str:
  return "-" if value is None else units.human_ms(value)


def recommendation(result, rec) -> list:
  """The answer at one link speed, as lines."""
  head = f"Recommendation at {_gbit(rec.gbits)} per worker"
  if rec.winner is None:
    return [f"{head}: none. No entry has a measured steps to target that fits "
            f"{result.device_gib:g} GiB per device and compiled; "
            + "; ".join(f"{n}: {why}" for n, why in rec.not_ranked[:6]) + "."]
  w = rec.winner
  target = rec.ranking[0][1]
  bf16 = "" if rec.vs_bf16 is None else f" and {rec.vs_bf16:.2f}x bf16's"
  lines = [f"{head}: **{w.label}**."]
  if rec.step_ms is not None:
    lines.append(f"* Projected step {units.human_ms(rec.step_ms)} (compute "
                 f"{units.human_ms(rec.compute_ms)}, communication not hidden "
                 f"{units.human_ms(max(rec.step_ms - rec.compute_ms, 0.0))}), time to target "
                 f"{target:.2f}x allreduce's{bf16}.")
  memory = f"{w.memory / GIB:.2f} GiB per device (parameters and state with Adam"
  memory += (f"; {result.device_gib:g} GiB on {result.device.name})" if result.device_gib
             else ")")
  if rec.fits is False:
    memory += "; DDP with Adam does not fit, so only the ways that do are ranked"
  lines.append(f"* Memory: {memory}.")
  lines.append(f"* Limited by: {rec.limit}.")
  lines.append(f"* Steps to target: {w.steps:.2f}x allreduce's ({w.source})" + (
      f". Measured on models at most {_params(_largest(result))} parameters, "
      f"{result.params / _largest(result):,.0f}x smaller than this one: the quality at this size "
      f"is unknown. Measure it: `{rec.measure}`." if rec.measure else "."))
  if rec.runner_up is not None:
    lines.append(f"* Runner-up: {rec.runner_up.label} (time to target {rec.ranking[1][1]:.2f}x "
                 "allreduce's).")
  changes = [f"{side} {_gbit(found[0])} {found[1]} wins"
             for side, found in (("below", rec.below), ("above", rec.above)) if found]
  lines.append("* The answer changes " + (" and ".join(changes) if changes else
                                          "nowhere from 1/10,000 to 10,000 times this link")
               + ".")
  if rec.without_credit:
    lines.append(f"* Without the overlap credit (communication not hidden behind compute) "
                 f"{rec.without_credit} wins.")
  for label, why in rec.thin:
    lines.append(f"* Could win, evidence too thin: {label} {why}.")
  return lines


def _largest(result) -> float:
  return max((p.params for r in result.rows for p in r.points), default=1)


def _entry_table(result) -> list:
  head = ["entry", "sent/step/device", "compression", f"update on {result.device.name}",
          "compute overhead", "memory/device", "steps to target", "overlap credited",
          "crossover vs allreduce, per step", "crossover, to target"]
  out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for r in result.rows:
    sent = "no formula" if r.sent is None else units.human_bytes(r.sent)
    update = ("not compiled" if r.update_ms is None else units.human_ms(r.update_ms))
    overhead = "-" if r.overhead_ms is None else f"{r.overhead_ms:+.2f} ms"
    crossings = ([_speed(r.crossover_step), _speed(r.crossover_target, r.steps_bound)]
                 if r.name != "allreduce" else ["-", "-"])
    cells = [r.name, sent, "-" if r.compression is None else f"{r.compression:.1f}x", update,
             overhead, "-" if r.memory is None else f"{r.memory / GIB:.2f} GiB", _steps(r),
             r.overlap or "none"] + crossings
    out.append("| " + " | ".join(cells) + " |")
  return out


def _link_table(result, g: float) -> list:
  head = ["entry", "comm/step, ring", "comm/step, tree", "hidden by overlap", "step",
          "step, overlap credited", "step / allreduce's", "step / bf16's",
          "to target / allreduce's (no credit)", "to target / bf16's"]
  out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  base, bf16 = result.row("allreduce"), result.row("bf16")
  for r in result.rows:
    cells = [r.name, "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    if g in r.comm_ms:
      cells[1:3] = [units.human_ms(r.comm_ms[g]["ring"]), units.human_ms(r.comm_ms[g]["doubling"])]
    if g in r.step_credit_ms:
      cells[3:6] = [_ms(r.hidden_ms[g]), _ms(r.step_ms[g]), _ms(r.step_credit_ms[g])]
      if g in base.step_credit_ms:
        cells[6] = f"{r.step_credit_ms[g] / base.step_credit_ms[g]:.2f}x"
      if g in bf16.step_credit_ms:
        cells[7] = f"{r.step_credit_ms[g] / bf16.step_credit_ms[g]:.2f}x"
    bound = "> " if r.steps_bound else ""
    if g in r.to_target_credit:
      cells[8] = f"{bound}{r.to_target_credit[g]:.2f}x ({bound}{r.to_target[g]:.2f}x)"
    if g in r.to_target_bf16:
      cells[9] = f"{bound}{r.to_target_bf16[g]:.2f}x"
    out.append("| " + " | ".join(cells) + " |")
  return out


def _evidence_table(result) -> list:
  head = ["entry", "measured: parameters, tokens, steps to target, final-loss gap [source]",
          "gap per 10x parameters", "its paper at scale: parameters, tokens, result [citation]"]
  out = ["| " + " | ".join(head) + " |", "|---|---|---:|---|"]
  for r in result.rows:
    measured = "; ".join(
        f"{_params(p.params)}, {_params(p.tokens) if p.tokens else '-'} tokens, "
        + ("diverged" if p.steps_ratio is None else
           f"{'> ' if p.bound else ''}{p.steps_ratio:.2f}x")
        + (f", {100 * p.gap:+.1f}%" if p.gap is not None else ", gap not recorded")
        + f" [{p.source if p.source.startswith('J') else 'study'}]" for p in r.points)
    slope = evidence.trend(r.points)
    paper = evidence.paper(r.name)
    tokens = _params(paper.tokens) + " tokens" if paper and paper.tokens else "tokens: see it"
    cited = ("-" if paper is None else
             f"{_params(paper.params)}, {tokens}, {paper.result} [{paper.cite}]")
    out.append(f"| {r.name} | {measured or 'not measured'} | "
               f"{'-' if slope is None else f'{100 * slope:+.1f} points'} | {cited} |")
  return out


def render(result, other_dtypes: Sequence[str] = ()) -> str:
  """The plan as text: the recommendation, the tables, where each figure comes from."""
  w, device = result.world, result.device
  lines = [f"Plan for {result.about}: {result.params:,} parameters (float32 gradients), W = {w} "
           f"data-parallel devices ({device.about}), links of "
           + ", ".join(f"{g:g} Gbit/s" for g in result.gbits) + " per worker.", ""]
  if other_dtypes:
    lines.insert(1, f"(Leaves of {', '.join(other_dtypes)} are counted as float32 gradients.)")
  for g in result.gbits:
    lines += recommendation(result, result.recommendations[g]) + [""]
  compiled, cached, took = result.compiles
  lines += [f"Compute: the model's step {result.model_note}. Each entry's update compiled at this "
            f"model's layer shapes ({compiled} shape groups compiled, {cached} read from the "
            f"cache, {took:.1f} s) and timed on {device.describe()}.", ""]
  lines += _entry_table(result)
  for g in result.gbits:
    lines += ["", f"At {g:g} Gbit/s per worker (α-β model, W = {w}, α = "
              f"{1e6 * result.alpha:g} µs):", ""]
    lines += _link_table(result, g)
  lines += ["", "Steps to target, by model size, and what the papers report:", ""]
  lines += _evidence_table(result)
  lines += ["", fsdp_plan.render(result.fsdp, w, result.gbits, result.alpha, result.device_gib)]
  lines += sources(result)
  return "\n".join(lines)


def sources(result) -> list:
  """Where each figure comes from."""
  low, high = network.MEASURED_RATIOS
  out = [
      "", "Where each figure comes from:",
      "* bytes: exact, from each algorithm's definition at this model's layer shapes "
      "(jaxcomp/train/wire.py, whose formulas the tests hold equal to the compiled step's "
      "comm_report), ring algorithm, bf16 as bfloat16; \"no formula\": "
      "benchmarks/bytes.py --compressors NAME measures it.",
      "* compute: each entry's update (its transformation, optax.sgd, the parameters' update) "
      "compiled for this model's layer shapes per shape group on this process's "
      "backend (jaxcomp/train/compute.py), its kernels' FLOPs and bytes read from the compiled "
      "program (jaxcomp/train/hlo_cost.py) and timed by the device's roofline, max(FLOPs / peak, "
      f"bytes / bandwidth) + {1e6 * result.device.launch:.3g} µs a kernel "
      "(jaxcomp/train/devices.py): a lower bound of what the kernels take; the decode of what "
      "W devices gathered is costed at W = 1. benchmarks/plan_check.py checks the step ratios "
      "against measured steps (BENCHMARKS.md, \"Planner: predicted against measured\").",
      "* comm: the α-β model of a switched network (jaxcomp/train/network.py): the faster of the "
      "ring and recursive doubling per collective; checked only in its shared-medium form, "
      f"over a rate-limited loopback: predicted / measured {low:.2f}–{high:.2f} "
      "(benchmarks/slow_link.py).",
      "* overlap credited (an assumption, shown with and without): a dense mean hides behind "
      "the backward pass (2/3 of the model's step) up to its length; Streaming DiLoCo hides "
      "each piece's exchange behind one inner step; the other entries hide nothing.",
      "* steps to target: the largest model size measured (jaxcomp/train/evidence.py); \"> \": "
      "not reached, a lower bound; the papers' figures are shown, not ranked on."]
  for key, run in result.sources.items():
    out.append(f"* [{key}] steps to target, measured on {run['model']}, {run['devices']}, "
               f"{run['steps']} steps (target: allreduce's held-out loss {run['target']}), "
               f"{run['date']}: `{run['command']}` ({run['source']}).")
  return out


def figure(result):
  """The "where compression pays off" plot of a ``planner.Plan``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
  styles = dict(zip(result.curves, line_styles(len(result.curves))))
  plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
  name = result.about.split(" (")[0]
  for ax, key, what in ((axes[0], "step", "per step"), (axes[1], "target", "to target")):
    curves = {n: c[key] for n, c in result.curves.items() if c.get(key) is not None}
    draw_payoff(ax, result.speeds, curves, styles, f"projected time {what} / allreduce's",
                f"{name}, W = {result.world}, {result.device.name}: {what} (projected)"
                + ("\n(the entries that reached the target where measured)"
                   if key == "target" else ""))
    for g in result.gbits:
      ax.axvline(g, color="grey", lw=0.8, ls=":")
    ax.grid(alpha=0.3)
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(plain)
      axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  fig.legend(*axes[0].get_legend_handles_labels(), loc="center left",
             bbox_to_anchor=(0.79, 0.5), fontsize=7)
  fig.tight_layout(rect=(0, 0, 0.79, 1))
  return fig
