"""The planner: which way to train pays off for YOUR model, devices, link and accelerator.

``python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25 --device h100`` (or
``--params N``, ``--model package.module:function`` returning a Flax model's parameters, or
``plan(params_or_shapes, ...)``) opens with one recommendation and its reasons
(``jaxcomp.train.recommend``), then, for every registry entry:

* **bytes** each device sends per step at the model's layer shapes, exact, from each algorithm's
  definition (``jaxcomp.train.wire``, whose formulas the tests hold equal to the compiled step's
  ``comm_report``), ring algorithm;
* **communication time** under the α-β model (``jaxcomp.train.network``): the faster of the ring and
  recursive doubling per collective;
* **compute** from the compiled program: the entry's update (compressor, optimizer, the parameters'
  update) compiled at the model's layer shapes (``jaxcomp.train.compute``) and timed by the
  device's roofline (``jaxcomp.train.devices``), over the model's own step (``--step-ms``, or an
  estimate from its FLOPs at the device's sustained rate);
* **overlap, said**: with the credit and without. A dense mean (allreduce, fp16, bf16, the
  ``comm_hook`` ports, the baselines' mean) is sent bucket by bucket as the backward pass produces
  the gradient, so its communication hides behind the backward pass (``BACKWARD`` of the model's
  step) up to that long; Streaming DiLoCo sends each piece of a fragment while the next inner step
  computes, so each piece's exchange hides behind one step's compute; the other entries need the
  whole gradient (or their own state) before they send, and hide nothing;
* **steps to target** from evidence (``jaxcomp.train.evidence``): the steps ratio at each model
  size it was measured at, the gap's trend with size, and what the entry's paper reports;
* **time per step and to target** against allreduce's and bf16's: steps × (compute + exposed
  communication), phase by phase (a warm-up that sends what allreduce sends is costed as
  allreduce's step, as the job does);
* **crossover link speed**: below it the entry's projected time beats allreduce's.

The fully sharded ways to train follow (``jaxcomp.train.fsdp_plan``); where the model does not fit
a device with DDP, they enter the recommendation's ranking.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import (compute, evidence, fsdp_plan, measured, network, plan_text, recommend,
                           registry, shapes, step_cost, wire)
from jaxcomp.train import devices as accelerators

def overlap(name: str) -> Optional[str]:
  """What entry ``name``'s communication overlaps (module docstring): ``"backward"``,
  ``"inner step"`` or None."""
  entry = registry.REGISTRY[name]
  if entry.is_mean or entry.baseline or name.startswith("hook_"):
    return "backward"
  if name.startswith("streaming_diloco"):
    return "inner step"
  return None


@dataclasses.dataclass
class Row:
  """One registry entry's projection (None or empty where a figure is not available).

  Attributes:
    name: the registry name.
    sent: bytes each device sends per step, ring algorithm (None: no formula).
    compression: allreduce's ``sent`` over this one's.
    update_ms: its update per step on the device, from its compiled program; compute_error: why
      it was not compiled.
    overhead_ms: ``update_ms`` − allreduce's.
    memory: bytes per device with Adam (``compute.memory``).
    points: its ``evidence.Point``\\ s; steps_ratio, steps_bound, steps_source: the largest size's.
    diverged: it diverged where it was measured.
    overlap: what its communication overlaps (``overlap``).
    comm_ms: ``{gbits: {"ring": ms, "doubling": ms, "best": ms}}`` per step.
    hidden_ms: ``{gbits: ms}`` of communication the overlap credit hides.
    step_ms, step_credit_ms: ``{gbits: projected ms per step}`` without and with the credit.
    to_target, to_target_credit: ``{gbits: time to target / allreduce's}`` without and with it
      (a lower bound where ``steps_bound``); to_target_bf16: with it, over bf16's.
    crossover_step, crossover_target: ``(kind, gbits)`` against allreduce, with the credit:
      ``("below", g)``, ``("above", g)``, ``("always", None)``, ``("never", None)``.
  """
  name: str
  sent: Optional[float] = None
  compression: Optional[float] = None
  update_ms: Optional[float] = None
  compute_error: Optional[str] = None
  overhead_ms: Optional[float] = None
  memory: Optional[int] = None
  points: list = dataclasses.field(default_factory=list)
  steps_ratio: Optional[float] = None
  steps_bound: bool = False
  steps_source: Optional[str] = None
  diverged: bool = False
  overlap: Optional[str] = None
  comm_ms: dict = dataclasses.field(default_factory=dict)
  hidden_ms: dict = dataclasses.field(default_factory=dict)
  step_ms: dict = dataclasses.field(default_factory=dict)
  step_credit_ms: dict = dataclasses.field(default_factory=dict)
  to_target: dict = dataclasses.field(default_factory=dict)
  to_target_credit: dict = dataclasses.field(default_factory=dict)
  to_target_bf16: dict = dataclasses.field(default_factory=dict)
  crossover_step: Optional[tuple] = None
  crossover_target: Optional[tuple] = None


@dataclasses.dataclass
class Plan:
  """What ``plan`` returns.

  Attributes:
    model, about: the command line's name of the model (``--model gpt2-small``) and what it is.
    params: its parameter count; world: W; gbits: the link speeds; alpha: the α-β model's latency.
    device: the ``jaxcomp.train.devices.Device``; device_gib: the memory per device the plan
      checks (None: none).
    model_ms, model_note: the model's step per device (forward, backward) and where it comes from.
    rows: a ``Row`` per registry entry, in the registry's order (allreduce and bf16 first when
      ``names`` left them out).
    sources: ``{tag: measurement}``: ``J1``, ``J2``, ... the runs of the job the rows cite.
    fsdp: the "Fully sharded" table's ``fsdp_plan.FsdpRow``\\ s.
    recommendations: ``{gbits: recommend.Recommendation}``.
    compiles: ``(compiled, cached, seconds)``: the shape groups compiled, read from the cache, and
      the seconds the update costs took.
    text: the recommendation, the tables and the source of every figure (print it).
    speeds, curves: the plot's link speeds and ``{name: {"step": [...], "target": [...]}}``.
  """
  model: str
  about: str
  params: int
  world: int
  gbits: tuple
  alpha: float
  device: accelerators.Device
  device_gib: Optional[float]
  model_ms: float
  model_note: str
  rows: list
  sources: dict
  fsdp: list
  recommendations: dict = dataclasses.field(default_factory=dict)
  compiles: tuple = (0, 0, 0.0)
  text: str = ""
  speeds: tuple = ()
  curves: dict = dataclasses.field(default_factory=dict)

  def row(self, name: str) -> Row:
    return next(r for r in self.rows if r.name == name)

  def figure(self):
    """The "where compression pays off" plot: projected time per step and to the target over
    allreduce's (overlap credited), against the link speed."""
    return plan_text.figure(self)


@dataclasses.dataclass
class Context:
  """What the programs of every entry share: the tree, W, the model's step, each entry's update
  seconds, the run whose recipe the phases follow."""
  tree: object
  world: int
  model_s: float
  update_s: dict

  def programs(self, name: str, run: Optional[dict], steps: int) -> Optional[list]:
    """``[(steps, compute seconds, operands, overlap)]`` of ``name``'s phases over ``steps`` steps
    of a run whose recipe is ``run``'s (None: the steady state only)."""
    entry = registry.REGISTRY[name]
    phases = entry.phases(run["steps"]) if run else (registry.Phase(0, name, {}),)
    out = []
    for i, phase in enumerate(phases):
      end = phases[i + 1].first_step if i + 1 < len(phases) else steps
      length = max(0, min(end, steps) - phase.first_step)
      if not length:
        continue
      sent = wire.messages(phase.name, self.tree, self.world, phase.settings)
      update = self.update_s.get(phase.name)
      if sent is None or update is None:
        return None
      out.append((length, self.model_s + update, wire.operands(sent, self.world),
                  overlap(phase.name)))
    return out


def _check(devices_: int, gbits: Sequence, step_ms: Optional[float]) -> tuple:
  if not (isinstance(devices_, numbers.Integral) and devices_ >= 2):
    raise ValueError(f"devices must be a whole number of at least 2; got {devices_!r}")
  gbits = tuple(float(g) for g in gbits)
  if not gbits or not all(0 < g < float("inf") for g in gbits):
    raise ValueError(f"gbits must be positive link speeds; got {gbits!r}")
  if step_ms is not None and not 0 < step_ms < float("inf"):
    raise ValueError(f"step_ms must be a positive number of milliseconds; got {step_ms!r}")
  return gbits


def plan(params_or_shapes=None, *, devices: int = 64, gbits: Sequence[float] = (25.0,),
         device: str = "h100", step_ms: Optional[float] = None, model: Optional[str] = None,
         names: Optional[Sequence[str]] = None, alpha: float = network.ALPHA,
         data: Optional[dict] = None, about: Optional[str] = None,
         device_gib: Optional[float] = None, cache=True,
         spec: Optional[str] = None) -> Plan:
  """Projects every registry entry (or ``names``) to a model on ``devices`` workers of kind
  ``device`` whose links run at each of ``gbits`` Gbit/s, and recommends one.

  Args:
    params_or_shapes: the model's parameters (arrays, or ``jax.ShapeDtypeStruct`` leaves, e.g.
      ``jax.eval_shape(model.init, rng, x)["params"]``); or None with ``model``.
    devices: W, the data-parallel workers.
    gbits: link speeds per worker.
    device: a ``jaxcomp.train.devices.NAMES`` entry: the accelerator's roofline (``"this-cpu"``:
      this machine, measured now).
    step_ms: the measured model step per device (forward, backward; no communication); None: an
      estimate from the model's FLOPs (as a transformer for ``params_or_shapes``).
    model: a preset of ``shapes.MODELS`` instead of ``params_or_shapes``.
    names: the registry entries to project (default: all; allreduce and bf16 always among them).
    alpha: the α-β model's latency per message (seconds).
    data: the measurements (default: the packaged ``measured.json``).
    about: what the model is, for the text.
    device_gib: GiB per device the plan checks memory against (default: the device's).
    cache: where compiled updates' kernels are kept (True: ``compute.cache_folder()``; a folder;
      None: compile every one).
    spec: how the command line names the model (``--params 1.3e9``, ``--model pkg.mod:fn``), for
      the commands the plan prints (default: ``--model NAME``, or a placeholder).

  Returns:
    A ``Plan``: ``recommendations``, ``rows``, ``fsdp``, ``text`` and ``figure()``.

  Raises:
    ValueError: an unknown model, device or entry, or a value out of range (the message says
      which and what is expected).
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
    tree, about = params_or_shapes, about or "the model given"
  gbits = _check(devices, gbits, step_ms)
  hardware = accelerators.get(device)
  fsdp_plan.check_device_gib(device_gib)
  if device_gib is None:
    device_gib = hardware.memory_gib
  n = sum(math.prod(shape) for _, shape in wire.leaves(tree))
  if not n:
    raise ValueError("the model has no floating-point parameters")
  names = list(registry.REGISTRY) if names is None else list(names)
  for must in ("bf16", "allreduce"):
    if must not in names:
      names.insert(0, must)
  unknown = [x for x in names if x not in registry.REGISTRY]
  if unknown:
    raise ValueError(f"unknown registry entries {unknown}; choose from "
                     f"{', '.join(registry.REGISTRY)}")
  if step_ms is None:
    model_s, model_note = compute.model_step(preset, n, hardware)
  else:
    model_s, model_note = step_ms / 1e3, f"{step_ms:g} ms, your measurement (--step-ms)"
  data = data or measured.load()
  sources = {f"J{i + 1}": run for i, run in enumerate(data["steps_to_target"])}
  costs, took = compute.timed(compute.update_costs, names, tree, cache=cache)
  update_s = {name: None if c.summary is None else hardware.seconds(c.summary)
              for name, c in costs.items()}
  context = Context(tree, int(devices), model_s, update_s)
  rows = {name: _row(name, context, costs[name], data, sources, gbits, alpha) for name in names}
  base, speeds = rows["allreduce"], np.geomspace(min(gbits) / 100, max(gbits) * 100, 41)
  curves = {}
  backward_s = step_cost.BACKWARD * model_s
  theirs_step = context.programs("allreduce", None, 1)
  for row in rows.values():
    if row.sent is not None and base.sent:
      row.compression = base.sent / row.sent if row.sent else float("inf")
    if row.update_ms is not None and base.update_ms is not None:
      row.overhead_ms = row.update_ms - base.update_ms
    mine_step = context.programs(row.name, None, 1)
    if mine_step is None or theirs_step is None:
      continue
    world = context.world
    row.crossover_step = step_cost.crossover(mine_step, theirs_step, world, alpha, backward_s)
    curves[row.name] = {"step": [step_cost.seconds(mine_step, world, alpha, g, backward_s)
                                 / step_cost.seconds(theirs_step, world, alpha, g, backward_s)
                                 for g in speeds]}
    run = sources.get(row.steps_source) if row.steps_source else None
    if row.steps_ratio is None:
      continue
    base_steps = run["base_steps"] if run else 1000
    mine = context.programs(row.name, run, round(row.steps_ratio * base_steps))
    theirs = context.programs("allreduce", run, base_steps)
    if mine is None or theirs is None:
      continue
    row.crossover_target = step_cost.crossover(mine, theirs, world, alpha, backward_s)
    for g in gbits:
      for credit, out in ((False, row.to_target), (True, row.to_target_credit)):
        out[g] = (step_cost.seconds(mine, world, alpha, g, backward_s, credit)
                  / step_cost.seconds(theirs, world, alpha, g, backward_s, credit))
    if not row.steps_bound:
      curves[row.name]["target"] = [step_cost.seconds(mine, world, alpha, g, backward_s)
                                    / step_cost.seconds(theirs, world, alpha, g, backward_s)
                                    for g in speeds]
  bf16 = rows["bf16"]
  for row in rows.values():
    for g in row.to_target_credit:
      if g in bf16.to_target_credit:
        row.to_target_bf16[g] = row.to_target_credit[g] / bf16.to_target_credit[g]
  fsdp_rows = fsdp_plan.rows(tree, int(devices), gbits, alpha, device_gib)
  compiled = sum(c.compiled for c in costs.values())
  cached = sum(c.cached for c in costs.values())
  spec = spec or (f"--model {model}" if model else "--model package.module:function")
  result = Plan(spec, about, n, int(devices), gbits, alpha, hardware, device_gib,
                1e3 * model_s, model_note, list(rows.values()), sources, fsdp_rows,
                compiles=(compiled, cached, took), speeds=tuple(speeds), curves=curves)
  result.recommendations = {g: recommend.recommend(result, context, g) for g in gbits}
  other = sorted({str(x.dtype) for x in jax.tree.leaves(tree)
                  if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)} - {"float32"})
  result.text = plan_text.render(result, other)
  return result


def _row(name: str, context: Context, cost, data: dict, sources: dict, gbits: tuple,
         alpha: float) -> Row:
  """The figures of entry ``name`` that need no other entry's."""
  row = Row(name, overlap=overlap(name))
  sent = wire.messages(name, context.tree, context.world)
  if context.update_s[name] is not None:
    row.update_ms = 1e3 * context.update_s[name]
  row.compute_error = cost.error
  row.memory = None if cost.error else compute.memory(name, context.tree)
  if sent is not None:
    row.sent = wire.ring_bytes(sent, context.world)
    ops = wire.operands(sent, context.world)
    backward_s = step_cost.BACKWARD * context.model_s
    for g in gbits:
      beta = network.gbits_to_beta(g)
      row.comm_ms[g] = {a: 1e3 * network.step_time(ops, context.world, alpha, beta, a)
                        for a in network.ALGORITHMS}
      if row.update_ms is not None:
        compute_s = context.model_s + context.update_s[name]
        row.hidden_ms[g] = 1e3 * step_cost.hidden(compute_s, ops, context.world, alpha, beta,
                                        row.overlap, backward_s)
        row.step_ms[g] = 1e3 * compute_s + row.comm_ms[g]["best"]
        row.step_credit_ms[g] = row.step_ms[g] - row.hidden_ms[g]
  row.points = evidence.points(data, name, sources)
  chosen = evidence.best(row.points)
  if chosen is not None:
    row.diverged = chosen.steps_ratio is None
    row.steps_ratio, row.steps_bound = chosen.steps_ratio, chosen.bound
    row.steps_source = chosen.source
  return row
