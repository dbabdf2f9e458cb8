"""The planner: which compressor pays off for YOUR model, devices and link, without a training run.

``python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25`` (or ``--params N``,
or ``plan(params_or_shapes, devices=..., gbits=...)`` for a Flax model's parameters) projects the
main job's measurements to another model and cluster. For every registry entry:

* **bytes** each device sends per step at the model's real layer shapes, exact, from each
  algorithm's definition (``jaxcomp.train.wire``: the formulas the tests hold equal to the compiled
  step's ``comm_report``), ring algorithm;
* **communication time** under the α-β model (``jaxcomp.train.network``) on W devices at each link
  speed: the ring, recursive doubling (the tree-shaped algorithm) and the faster of the two per
  collective, which the projection uses; no overlap with compute is assumed;
* **compute overhead**: (step ratio − 1) × the compute time per step, the step ratio measured by
  ``benchmarks/step_time.py`` on a small MLP on simulated CPU devices (``measured.json`` names the
  model, the devices, the command and the date): not measured on this model;
* **steps to target**: the steps the entry took to reach allreduce's final held-out loss, over
  allreduce's, in a run of the main job on its 120,704-parameter transformer: not measured on this
  model, and biased against compression (below);
* **projected step time and time to target**, against allreduce's and bf16's: steps × (compute ×
  step ratio + communication), phase by phase (a warm-up that sends what allreduce sends is costed
  as allreduce's step, as the job does);
* **crossover link speed**: below it the entry's projected time beats allreduce's, per step and to
  the target.

A "Fully sharded" table follows (``jaxcomp.train.fsdp_plan``): memory per device against bytes per
step for DDP, ZeRO-1/2 and ``jaxcomp.fully_sharded``'s gathers and scatters (``device_gib``,
``--device-gib``: which fit).

The compute time per step is ``--step-ms`` (the user's measurement: forward, backward and optimizer
of one device's batch, without communication), or else an estimate that says so: 3 × the forward
FLOPs of ``shapes.Model``'s examples per device at ``RATE`` FLOP/s.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import fsdp_plan, measured, network, registry, shapes, units, wire
from jaxcomp.train.plots import draw_payoff, line_styles

RATE = 400e12
"""FLOP/s of the compute estimate: 40% of an H100's 989 TFLOP/s dense bfloat16 peak."""
SPEEDS = (1e-3, 1e5)
"""The link speeds (Gbit/s) a crossover is looked for in."""


@dataclasses.dataclass
class Row:
  """One registry entry's projection (None where a figure is not available).

  Attributes:
    name: the registry name.
    sent: bytes each device sends per step, ring algorithm (None: not computed without compiling).
    compression: allreduce's ``sent`` over this one's.
    step_ratio: its measured step time over allreduce's (``measured.json``'s step_time).
    overhead_ms: (step_ratio − 1) × the compute per step.
    steps_ratio: steps to allreduce's held-out loss over allreduce's, measured by the job; where the
      entry did not reach it, the steps it ran over allreduce's (a lower bound: ``steps_bound``).
    outcome: the job's ``{"steps": s}``, ``{"not_in": s}`` or ``{"diverged": True}``.
    steps_source: the tag of the run it comes from (``Plan.sources``).
    comm_ms: ``{gbits: {"ring": ms, "doubling": ms, "best": ms}}`` per step.
    step_ms: ``{gbits: projected ms per step}``: compute × step ratio + communication, steady
      state.
    to_target: ``{gbits: projected time to target / allreduce's}`` (a lower bound where
      ``steps_bound``).
    to_target_bf16: the same over bf16's.
    crossover_step, crossover_target: ``(kind, gbits)``: ``("below", g)`` (it wins below g),
      ``("above", g)``, ``("always", None)``, ``("never", None)``.
  """
  name: str
  sent: Optional[float] = None
  compression: Optional[float] = None
  step_ratio: Optional[float] = None
  overhead_ms: Optional[float] = None
  steps_ratio: Optional[float] = None
  steps_bound: bool = False
  outcome: Optional[dict] = None
  steps_source: Optional[str] = None
  comm_ms: dict = dataclasses.field(default_factory=dict)
  step_ms: dict = dataclasses.field(default_factory=dict)
  to_target: dict = dataclasses.field(default_factory=dict)
  to_target_bf16: dict = dataclasses.field(default_factory=dict)
  crossover_step: Optional[tuple] = None
  crossover_target: Optional[tuple] = None


@dataclasses.dataclass
class Plan:
  """What ``plan`` returns.

  Attributes:
    model: what the model is; params: its parameter count; world: W; gbits: the link speeds.
    compute_ms, compute_note: the compute per step and where it comes from.
    rows: a ``Row`` per registry entry, in the registry's order (allreduce and bf16 first when
      ``names`` left them out).
    sources: ``{tag: measurement}``: ``S`` the step ratios, ``J1``, ``J2``, ... the runs of the
      job whose steps to target the rows cite.
    text: the tables and the sources of every figure (print it).
    speeds, curves: the plot's link speeds and ``{name: {"step": [...], "target": [...]}}``, the
      projected times over allreduce's at each.
    fsdp: the "Fully sharded" table's ``fsdp_plan.FsdpRow``\\ s (DDP, ZeRO-1/2, FSDP variants).
  """
  model: str
  params: int
  world: int
  gbits: tuple
  compute_ms: float
  compute_note: str
  rows: list
  sources: dict
  text: str = ""
  speeds: tuple = ()
  curves: dict = dataclasses.field(default_factory=dict)
  fsdp: list = dataclasses.field(default_factory=list)

  def figure(self):
    """The "where compression pays off" plot (``plots.draw_payoff``, as the job draws it) for this
    model: projected time per step and to the target over allreduce's, against the link speed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    styles = dict(zip(self.curves, line_styles(len(self.curves))))
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    name = self.model.split(" (")[0]
    for ax, key, what in ((axes[0], "step", "per step"), (axes[1], "target", "to target")):
      curves = {n: c[key] for n, c in self.curves.items() if c.get(key) is not None}
      draw_payoff(ax, self.speeds, curves, styles, f"projected time {what} / allreduce's",
                  f"{name}, W = {self.world}: {what} (projected)"
                  + ("\n(the entries that reached the target in the job)"
                     if key == "target" else ""))
      for g in self.gbits:
        ax.axvline(g, color="grey", lw=0.8, ls=":")
      ax.grid(alpha=0.3)
      for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center left",
               bbox_to_anchor=(0.79, 0.5), fontsize=7)
    fig.tight_layout(rect=(0, 0, 0.79, 1))
    return fig


def compute_estimate(model: shapes.Model, n: int) -> tuple:
  """``(ms, note)``: 3 × the forward FLOPs of ``model.examples`` examples at ``RATE``."""
  flops = 3 * model.flops_per_example(n) * model.examples
  ms = 1e3 * flops / RATE
  per = ("2 per parameter per token" if model.unit == "tokens"
         else f"{model.flops_per_example(n) / 1e9:g} GFLOP per image")
  seldom = "" if model.unit == "tokens" else ", which convnets seldom sustain"
  return ms, (f"{ms:.1f} ms, ESTIMATED, not measured: 3 × forward FLOPs ({per}) × "
              f"{model.examples:,} {model.unit} per device at {RATE / 1e12:g} TFLOP/s (40% of an "
              f"H100's dense bf16 peak{seldom}); pass --step-ms (step_ms=) with your model's "
              "measured step, forward + backward + optimizer without communication")


def _programs(name: str, tree, world: int, data: dict, run: dict, steps: int) -> Optional[list]:
  """``[(steps, compute ratio, operands)]`` of ``name``'s phases over a run that reaches the
  target (or stops) after ``steps`` steps, its recipe the measured ``run``'s."""
  entry = registry.REGISTRY[name]
  ratio = measured_step_ratio(data, name)
  phases = entry.phases(run["steps"])
  out = []
  for i, phase in enumerate(phases):
    end = phases[i + 1].first_step if i + 1 < len(phases) else steps
    length = max(0, min(end, steps) - phase.first_step)
    if not length:
      continue
    sent = wire.messages(phase.name, tree, world, phase.settings)
    if sent is None:
      return None
    own = ratio if phase.name == name else measured_step_ratio(data, phase.name)
    out.append((length, own, wire.operands(sent, world)))
  return out


def measured_step_ratio(data: dict, name: str) -> Optional[float]:
  """The step ratio the projection uses: ``measured.json``'s (1 for allreduce by definition)."""
  return 1.0 if name == "allreduce" else measured.step_ratio(data, name)


def seconds(programs: Sequence, compute_s: float, world: int, alpha: float, gbits: float,
            algorithm: str = "best") -> float:
  """Seconds of ``programs`` (``[(steps, step ratio, operands)]``): steps × (compute × ratio + the
  α-β model's communication at ``gbits``), summed."""
  beta = network.gbits_to_beta(gbits)
  return sum(n * (compute_s * ratio + network.step_time(ops, world, alpha, beta, algorithm))
             for n, ratio, ops in programs)


def crossover(programs: Sequence, base: Sequence, compute_s: float, world: int,
              alpha: float = network.ALPHA) -> tuple:
  """Where ``programs`` (``[(steps, step ratio, operands)]``) take as long as ``base``: ``("below",
  g)`` when they are faster below ``g`` Gbit/s and slower above, ``("above", g)`` the other way,
  ``("always", None)`` / ``("never", None)`` when faster / not faster throughout ``SPEEDS``."""
  def gap(log_g):
    g = 10.0**log_g
    return (seconds(programs, compute_s, world, alpha, g)
            - seconds(base, compute_s, world, alpha, g))
  grid = np.linspace(math.log10(SPEEDS[0]), math.log10(SPEEDS[1]), 161)
  signs = [gap(x) < 0 for x in grid]
  if all(signs):
    return ("always", None)
  if not any(signs):
    return ("never", None)
  i = next(i for i in range(len(grid) - 1) if signs[i] != signs[i + 1])
  low, high = grid[i], grid[i + 1]
  for _ in range(60):  # bisection in log speed
    mid = (low + high) / 2
    if (gap(mid) < 0) == signs[i]:
      low = mid
    else:
      high = mid
  return ("below" if signs[i] else "above", 10.0 ** ((low + high) / 2))


def _tag(kind: str, index: int) -> str:
  return f"{kind}{index + 1}"


def plan(params_or_shapes=None, *, devices: int = 64, gbits: Sequence[float] = (25.0,),
         step_ms: Optional[float] = None, model: Optional[str] = None,
         names: Optional[Sequence[str]] = None, alpha: float = network.ALPHA,
         data: Optional[dict] = None, about: Optional[str] = None,
         device_gib: Optional[float] = None) -> Plan:
  """Projects every registry entry (or ``names``) to a model on ``devices`` workers whose links run
  at each of ``gbits`` Gbit/s.

  Args:
    params_or_shapes: the model's parameters (arrays, or ``jax.ShapeDtypeStruct`` leaves, e.g.
      ``jax.eval_shape(model.init, rng, x)["params"]``); or None with ``model``.
    devices: W, the data-parallel workers.
    gbits: link speeds per worker.
    step_ms: the measured compute time per step (forward, backward, optimizer; no communication);
      None: estimated (``compute_estimate``; as a transformer for ``params_or_shapes``).
    model: a preset of ``shapes.MODELS`` instead of ``params_or_shapes``.
    names: the registry entries to project (default: all, allreduce and bf16 always among them).
    alpha: the α-β model's latency per message (seconds).
    data: the measurements (default: the packaged ``measured.json``).
    about: what the model is, for the text.
    device_gib: GiB per device: the "Fully sharded" table marks which ways to train hold their
      parameters, Adam's state and the exchange's state in it (``fsdp_plan``).

  Returns:
    A ``Plan``: ``rows`` (one ``Row`` per entry), ``fsdp`` (the "Fully sharded" table's rows),
    ``text`` and ``figure()``.
  """
  import jax
  if (params_or_shapes is None) == (model is None):
    raise ValueError("give the model's parameters (or shapes), or model=, not both")
  if model is not None:
    if model not in shapes.MODELS:
      raise ValueError(f"unknown model {model!r}; choose from {', '.join(shapes.MODELS)}")
    preset = shapes.MODELS[model]
    tree, about = preset.build(), preset.about
  else:
    preset = shapes.Model("", lambda: None, shapes.per_token, shapes.TOKENS, "tokens")
    tree = params_or_shapes
    about = about or "the model given"
  if not (isinstance(devices, numbers.Integral) and devices >= 2):
    raise ValueError(f"devices must be a whole number of at least 2; got {devices!r}")
  gbits = tuple(float(g) for g in gbits)
  if not gbits or not all(0 < g < float("inf") for g in gbits):
    raise ValueError(f"gbits must be positive link speeds; got {gbits!r}")
  if step_ms is not None and not 0 < step_ms < float("inf"):
    raise ValueError(f"step_ms must be a positive number of milliseconds; got {step_ms!r}")
  leaves = wire.leaves(tree)
  n = sum(math.prod(shape) for _, shape in leaves)
  if not n:
    raise ValueError("the model has no floating-point parameters")
  fsdp_rows = fsdp_plan.rows(tree, devices, gbits, alpha, device_gib)
  other = sorted({str(x.dtype) for x in jax.tree.leaves(tree)
                  if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)} - {"float32"})
  if step_ms is None:
    compute_ms, compute_note = compute_estimate(preset, n)
  else:
    compute_ms, compute_note = float(step_ms), f"{step_ms:g} ms, your measurement (--step-ms)"
  data = data or measured.load()
  names = list(names or registry.REGISTRY)
  for must in ("bf16", "allreduce"):
    if must not in names:
      names.insert(0, must)
  unknown = [x for x in names if x not in registry.REGISTRY]
  if unknown:
    raise ValueError(f"unknown registry entries {unknown}; choose from "
                     f"{', '.join(registry.REGISTRY)}")
  compute_s = compute_ms / 1e3
  runs = data["steps_to_target"]
  sources = {"S": data["step_time"], **{_tag("J", i): run for i, run in enumerate(runs)}}

  rows = {}
  for name in names:
    row = Row(name)
    sent = wire.messages(name, tree, devices)
    if sent is not None:
      row.sent = wire.ring_bytes(sent, devices)
      for g in gbits:
        beta = network.gbits_to_beta(g)
        ops = wire.operands(sent, devices)
        row.comm_ms[g] = {a: 1e3 * network.step_time(ops, devices, alpha, beta, a)
                          for a in network.ALGORITHMS}
    row.step_ratio = measured_step_ratio(data, name)
    if row.step_ratio is not None:
      row.overhead_ms = (row.step_ratio - 1) * compute_ms
      for g in row.comm_ms:
        row.step_ms[g] = compute_ms * row.step_ratio + row.comm_ms[g]["best"]
    run, outcome = measured.steps_to_target(data, name)
    if run is not None:
      row.outcome, row.steps_source = outcome, _tag("J", runs.index(run))
      if "steps" in outcome:
        row.steps_ratio = outcome["steps"] / run["base_steps"]
      elif "not_in" in outcome:
        row.steps_ratio, row.steps_bound = outcome["not_in"] / run["base_steps"], True
    rows[name] = row

  base = rows["allreduce"]
  speeds = np.geomspace(min(gbits) / 100, max(gbits) * 100, 41)
  base_step = [(1, 1.0, wire.operands(wire.messages("allreduce", tree, devices), devices))]
  curves = {}
  for row in rows.values():
    if row.sent is not None:
      row.compression = base.sent / row.sent if row.sent else float("inf")
    if row.sent is None or row.step_ratio is None:
      continue
    steady = [(1, row.step_ratio, wire.operands(wire.messages(row.name, tree, devices), devices))]
    row.crossover_step = crossover(steady, base_step, compute_s, devices, alpha)
    curves[row.name] = {"step": [seconds(steady, compute_s, devices, alpha, g)
                                 / seconds(base_step, compute_s, devices, alpha, g)
                                 for g in speeds]}
    if row.steps_ratio is None:
      continue
    run = sources[row.steps_source]
    mine = _programs(row.name, tree, devices, data, run,
                     round(row.steps_ratio * run["base_steps"]))
    theirs = _programs("allreduce", tree, devices, data, run, run["base_steps"])
    if mine is None:
      continue
    row.crossover_target = crossover(mine, theirs, compute_s, devices, alpha)
    for g in gbits:
      row.to_target[g] = (seconds(mine, compute_s, devices, alpha, g)
                          / seconds(theirs, compute_s, devices, alpha, g))
    if not row.steps_bound:
      curves[row.name]["target"] = [seconds(mine, compute_s, devices, alpha, g)
                                    / seconds(theirs, compute_s, devices, alpha, g)
                                    for g in speeds]
  bf16 = rows["bf16"]
  for row in rows.values():
    for g in row.to_target:
      if g in bf16.to_target:
        row.to_target_bf16[g] = row.to_target[g] / bf16.to_target[g]

  result = Plan(about, n, int(devices), gbits, compute_ms, compute_note, list(rows.values()),
                sources, speeds=tuple(speeds), curves=curves, fsdp=fsdp_rows)
  result.text = render(result, alpha, other) + "\n" + fsdp_plan.render(
      fsdp_rows, result.world, gbits, alpha, device_gib)
  return result


# ----------------------------------------------------------------------------------------- text


def _speed(kind_g: Optional[tuple], bound: bool = False) -> str:
  if kind_g is None:
    return "-"
  kind, g = kind_g
  if kind == "always":
    return f"wins at {SPEEDS[0]:g}–{SPEEDS[1]:,.0f} Gbit/s"
  if kind == "never":
    return f"never in {SPEEDS[0]:g}–{SPEEDS[1]:,.0f} Gbit/s"
  speed = (f"{g:,.0f} Gbit/s" if g >= 100 else f"{g:.3g} Gbit/s" if g >= 1
           else f"{1e3 * g:.3g} Mbit/s")
  if bound:  # the entry needs at least its steps ratio: it wins below at most this speed
    return f"below at most {speed}" if kind == "below" else f"above at least {speed}"
  return f"{kind} {speed}"


def _steps(row: Row) -> str:
  if row.outcome is None:
    return "not measured"
  tag = f" [{row.steps_source}]"
  if row.outcome.get("diverged"):
    return "diverged" + tag
  if row.steps_bound:
    return f"> {row.steps_ratio:.2f}x (not reached in {row.outcome['not_in']})" + tag
  return f"{row.steps_ratio:.2f}x" + tag


def render(result: Plan, alpha: float, other_dtypes: Sequence[str] = ()) -> str:
  """The plan as text: a header, a table of the figures that do not depend on the link, one table
  per link speed, and where each figure comes from."""
  w = result.world
  lines = [f"Plan for {result.model}: {result.params:,} parameters (float32 gradients), "
           f"W = {w} data-parallel devices, links of "
           + ", ".join(f"{g:g} Gbit/s" for g in result.gbits) + " per worker.",
           f"Compute per step: {result.compute_note}.", ""]
  if other_dtypes:
    lines.insert(1, f"(Leaves of {', '.join(other_dtypes)} are counted as float32 gradients.)")
  head = ["entry", "sent/step/device", "compression", "step ratio [S]", "compute overhead",
          "steps to target [J]", "crossover vs allreduce, per step", "crossover, to target"]
  rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for r in result.rows:
    sent = "not computed without compiling" if r.sent is None else units.human_bytes(r.sent)
    compression = "-" if r.compression is None else f"{r.compression:.1f}x"
    ratio = "not measured" if r.step_ratio is None else f"{r.step_ratio:.2f}"
    overhead = "-" if r.overhead_ms is None else f"{r.overhead_ms:+.1f} ms"
    crossings = ([_speed(r.crossover_step), _speed(r.crossover_target, r.steps_bound)]
                 if r.name != "allreduce" else ["-", "-"])
    cells = [r.name, sent, compression, ratio, overhead, _steps(r)] + crossings
    rows.append("| " + " | ".join(cells) + " |")
  lines += rows
  for g in result.gbits:
    lines += ["", f"At {g:g} Gbit/s per worker (α-β model, W = {w}, α = {1e6 * alpha:g} µs):", ""]
    head = ["entry", "comm/step, ring", "comm/step, tree", "step (projected)", "step / allreduce's",
            "step / bf16's", "time to target / allreduce's", "time to target / bf16's"]
    table = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    base = next(r for r in result.rows if r.name == "allreduce")
    bf16 = next(r for r in result.rows if r.name == "bf16")
    for r in result.rows:
      ring = tree = step = vs = vs16 = target = target16 = "-"
      if g in r.comm_ms:
        ring, tree = units.human_ms(r.comm_ms[g]["ring"]), units.human_ms(r.comm_ms[g]["doubling"])
      if g in r.step_ms:
        step = units.human_ms(r.step_ms[g])
        vs = f"{r.step_ms[g] / base.step_ms[g]:.2f}x"
        if g in bf16.step_ms:
          vs16 = f"{r.step_ms[g] / bf16.step_ms[g]:.2f}x"
      bound = "> " if r.steps_bound else ""
      if g in r.to_target:
        target = f"{bound}{r.to_target[g]:.2f}x"
      if g in r.to_target_bf16:
        target16 = f"{bound}{r.to_target_bf16[g]:.2f}x"
      table.append("| " + " | ".join([r.name, ring, tree, step, vs, vs16, target, target16]) + " |")
    lines += table
  step = result.sources["S"]
  low, high = network.MEASURED_RATIOS
  lines += [
      "", "Where each figure comes from:",
      "* bytes: exact, from each algorithm's definition at this model's layer shapes "
      "(jaxcomp/train/wire.py, whose formulas the tests hold equal to the compiled step's "
      "comm_report): what each device sends per step under the ring algorithm, bf16 as bfloat16 "
      "(XLA:CPU widens it to float32; GPUs keep it); \"not computed\": no formula for that entry "
      "(benchmarks/bytes.py --compressors NAME measures it).",
      "* comm: the α-β model of a switched network (jaxcomp/train/network.py): ring, and tree "
      "(recursive doubling, ⌈log2 W⌉ messages); the projected step takes the faster of the two "
      "per collective and overlaps no communication with compute (Streaming DiLoCo's overlap of "
      "its exchange with inner steps is not credited). Checked only in its shared-medium form, "
      f"over a rate-limited loopback: predicted / measured {low:.2f}–{high:.2f} "
      "(benchmarks/slow_link.py); this switched form is unmeasured.",
      f"* [S] step ratios, measured on {step['model']}, {step['devices']}, global batch "
      f"{step['global_batch']}, {step['date']}: `{step['command']}` ({step['source']}). NOT "
      "measured on this model or device: the compute overhead is (ratio − 1) × the compute per "
      "step; a compressor's work grows with the parameters and the step's with parameters × "
      f"examples, so with more examples per device than that MLP's "
      f"{step['global_batch'] // step['world']} the overhead is likely smaller than shown. "
      "\"not measured\": no step time, so no projection."]
  for key, run in result.sources.items():
    if key.startswith("J"):
      lines.append(f"* [{key}] steps to target, measured on {run['model']}, {run['devices']}, "
                   f"{run['steps']} steps (target: allreduce's held-out loss {run['target']}), "
                   f"{run['date']}: `{run['command']}` ({run['source']}).")
  lines.append("  NOT measured on this model: the compressors' gaps on that small model shrink "
               "with the run's length (BENCHMARKS.md, \"Quality on a transformer\": PowerSGD r4 "
               "from 5.6% to 0.8% above allreduce's held-out loss, 600 to 2,000 steps) and their "
               "papers report none at scale, so these ratios likely overstate the steps a "
               "compressor needs: the time to target is biased against compression. \"> \": not "
               "reached, a lower bound.")
  lines.append("* crossover: the link speed below which the entry's projected time (per step, or "
               "to the target with its steps ratio) is shorter than allreduce's, looked for in "
               f"{SPEEDS[0]:g}–{SPEEDS[1]:,.0f} Gbit/s; to the target \"at most\": from a lower "
               "bound of the steps.")
  return "\n".join(lines)
