"""Where a training step's time goes, per phase, from a ``jax.profiler`` trace of the step.

The step is ``step_time.py``'s (the main job's ``jaxcomp.data_parallel`` step over W simulated CPU
devices, then ``optax.sgd``), traced for ``--repeats`` steps per registry entry, one step of each
entry after the other (round-robin, as ``step_time.py`` times them). XLA:CPU records one
event per executed HLO instruction per device; each is given a phase from the instruction's opcode
and its ``op_name`` (the JAX name scopes it was traced under, read from the compiled HLO):

* ``forward+backward``: the loss and its gradient (``jvp(…)`` / ``transpose(…)`` in the name);
* ``collectives``: every all-reduce, all-gather, all-to-all, reduce-scatter, collective-permute (the
  finiteness flag's 4-byte all-reduce too), counted on each device as the least time any device
  spent in the same collective: the device that arrives last waits for nobody;
* ``waiting at collectives``: the rest of the collectives' time, spent waiting for the slowest
  device (on simulated devices, which share the host's cores, mostly for the others' compute);
* ``encode``, ``decode/mean``, ``error feedback``, ``rows layout``, ``non-finite gate``: the name
  scopes ``jaxcomp.<part>`` that the exchange (``exchange.py``, ``kernels.device_mean``) and the
  compressor adapter (``compressor.py``) put around their parts;
* ``compressor, rest``: the rest of the compressor's update (``jaxcomp.update``): the algorithm's
  own math outside those parts (DGC's selection, 1-bit Adam's moments, the dense casts);
* ``optimizer``: the optimizer after (or, for local SGD and DiLoCo, inside) the compressor, which
  this script runs under a ``profile.optimizer`` scope;
* ``other``: the rest of the step (copies, the loss's mean, the parameters' update; local SGD's and
  DiLoCo's local update, whose fusions end in it).

The innermost scope decides. A fusion carries the ``op_name`` of the instruction it was built
around (its root), so work XLA fused across parts (``p = g + e`` into the encoding) counts in the
root's part; one without (a reduction XLA rewrote) takes that of an instruction inside it, and
another instruction without one (a dot XLA split off) that of its user, else of its operand. Control
flow (``conditional``, ``while``, ``call``) is not counted itself: the instructions inside it are.
Each phase is given in ms per device and step (the events' durations summed over the devices, ÷W,
averaged over the traced steps) and as a share of their sum; ``step (wall clock)`` is the median
wall-clock time of a traced step, ``step / allreduce`` the median of the per-round ratios. The
devices share the host's cores, so a device's ops take longer than on a core of its own: compare
shares and compressors, not the ms with another machine's.

A second table gives the bytes each phase moves per device and step, in passes over the gradient
(bytes ÷ the gradient's float32 bytes): every executed instruction's operands read and output
written, from the shapes in the compiled HLO, as many times as it ran (an instruction inside a
conditional branch or a loop counts each time it executed, not at all where it did not), counted
by ``jaxcomp.train.hlo_cost.bytes_moved`` (the planner's count, with its two refinements for what
XLA:CPU does in place or computes in part). An
algorithm that reads the gradient and its state once and writes its state and output once moves
2 + 2·state / gradient; the plain mean moves 4 (the all-reduce's input and output, the ÷W).

A third table counts the kernels each phase runs per device and step: every executed instruction
but control flow (fusions, custom calls, collectives, the dots and copies XLA left alone), each
time it ran. On a GPU each is one kernel launch: where a step is short, their count, not their
bytes, sets its time. Like the passes, the count does not depend on the machine's load.

``--layers 2,16,128`` runs the leaf-count sweep instead: the same MLP of L same-shape hidden layers
(64 wide: L kernels of 64 × 64 and L biases) for each L, and gives each entry's kernels per step,
the compressor's own (``OWN``: the phases between the gradient and the optimizer) and the whole
step's, and how the compressor's grow from one L to the next. A compressor that handles
same-shape leaves together runs about as many kernels at 128 layers as at 16.

  PYTHONPATH=. python benchmarks/step_profile.py [--quick] [--compressors allreduce,quantized_int8]
      [--devices 8] [--repeats 4] [--layers 2,16,128]

``STEP_PROFILE_TREE=/tmp/before`` profiles the steps of another checkout (``TREE``) with this
script's counting: the passes and kernels before and after a change, side by side.
"""

from __future__ import annotations

import collections
import glob
import importlib.util
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.path.abspath(os.environ.get("STEP_PROFILE_TREE", ROOT))
"""The checkout whose ``jaxcomp`` and ``benchmarks`` helpers build the profiled steps: this one, or
another commit's (``git worktree add /tmp/before <commit>``, then ``STEP_PROFILE_TREE=/tmp/before``)
so that the tree before a change is counted by this script's own counting."""
sys.path.insert(0, TREE)

from benchmarks import step_time  # noqa: E402  (configures the simulated devices first)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from benchmarks import common  # noqa: E402
# The planner's count of bytes, shared; from this checkout, whichever TREE is profiled.
_spec = importlib.util.spec_from_file_location(
    "step_profile_hlo_cost", os.path.join(ROOT, "jaxcomp", "train", "hlo_cost.py"))
hlo_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hlo_cost)
bytes_moved, parse = hlo_cost.bytes_moved, hlo_cost.parse

OPTIMIZER_SCOPE = "profile.optimizer"
# The parts the jaxcomp plumbing names (``jax.named_scope("jaxcomp.<part>")``), as the table calls
# them.
PARTS = {"jaxcomp.encode": "encode", "jaxcomp.decode": "decode/mean",
         "jaxcomp.error_feedback": "error feedback", "jaxcomp.layout": "rows layout",
         "jaxcomp.nonfinite": "non-finite gate", "jaxcomp.update": "compressor, rest",
         OPTIMIZER_SCOPE: "optimizer"}
PHASES = ("forward+backward", "encode", "collectives", "waiting at collectives", "decode/mean",
          "error feedback", "rows layout", "non-finite gate", "compressor, rest", "optimizer",
          "other")
OWN = ("encode", "collectives", "decode/mean", "error feedback", "rows layout", "non-finite gate",
       "compressor, rest")
"""The compressor's own phases."""
SWEEP_WIDTH = 64
_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_CONTROL = ("conditional", "while", "call")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_SCOPE = re.compile("|".join(re.escape(s) for s in PARTS) + r"|\b(?:jvp|transpose)\(")
def scoped(tx: optax.GradientTransformation, name: str) -> optax.GradientTransformation:
  """``tx`` with its ``init`` and ``update`` traced under the name scope ``name``."""
  def init(params):
    with jax.named_scope(name):
      return tx.init(params)

  def update(updates, state, params=None):
    with jax.named_scope(name):
      return tx.update(updates, state, params)
  return optax.GradientTransformation(init, update)


def instructions(hlo_text: str) -> dict:
  """``{instruction name: (opcode, op_name)}`` of every instruction of a compiled HLO module. A
  fusion that XLA left without an ``op_name`` (a reduction it rewrote) takes the last one among the
  instructions it calls; another instruction without one (a dot XLA split off a larger one) takes
  that of its first user that has one, else of its first operand that has one."""
  out, called, inside, computation = {}, {}, {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group("name")
    m = _INSTRUCTION.match(line)
    if m:
      op_name = _OP_NAME.search(line)
      op_name = op_name.group("op_name") if op_name else ""
      out[m.group("name")] = (m.group("op"), op_name)
      if op_name:
        inside[computation] = op_name
      calls = _CALLS.search(line)
      if calls and not op_name:
        called[m.group("name")] = calls.group(1)
  for name, computation in called.items():
    out[name] = (out[name][0], inside.get(computation, ""))
  users = collections.defaultdict(list)
  operands = {}
  for key, computation in parse(hlo_text).items():
    if key == "ENTRY":  # the entry computation again, under its own name too
      continue
    for name, i in computation.items():
      operands[name] = i.operands
      for o in i.operands:
        users[o].append(name)
  for name, (opcode, op_name) in list(out.items()):
    if not op_name and opcode not in ("parameter", "constant", "tuple", "get-tuple-element"):
      near = [out[n][1] for n in users[name] + operands.get(name, []) if n in out and out[n][1]]
      out[name] = (opcode, near[0] if near else "")
  return out


def phase_of(opcode: str, op_name: str) -> str:
  """The phase of an instruction (the module docstring); ``None`` for control flow."""
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  if base in _COLLECTIVES or base.endswith("-done") and base[:-5] in _COLLECTIVES:
    return "collectives"
  if opcode in _CONTROL:
    return None
  scopes = _SCOPE.findall(op_name)
  if not scopes:
    return "other"
  innermost = scopes[-1]
  return PARTS.get(innermost, "forward+backward")


def events(trace_dir: str, module: str):
  """``(hlo_op, device, start ns, duration ns)`` of every executed instruction of ``module``."""
  path, = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        if stats.get("hlo_module") == module and "hlo_op" in stats:
          yield stats["hlo_op"], stats.get("device_ordinal", 0), e.start_ns, e.duration_ns


def instruction_times(trace, ops: dict, world: int) -> dict:
  """``{(phase, instruction): ms per device}`` from the events of one traced step."""
  total = collections.Counter()
  runs = collections.defaultdict(list)  # collective -> its runs on every device
  for hlo_op, device, start, duration in trace:
    phase = phase_of(*ops.get(hlo_op, ("", "")))
    if phase == "collectives":
      runs[hlo_op].append((device, start, duration))
    elif phase:
      total[phase, hlo_op] += duration
  for hlo_op, calls in runs.items():
    per_device = collections.defaultdict(list)
    for device, _, duration in sorted(calls, key=lambda c: c[1]):
      per_device[device].append(duration)
    for durations in zip(*per_device.values()):  # the k-th run of the collective on every device
      least = min(durations)
      total["collectives", hlo_op] += least * len(durations)
      total["waiting at collectives", hlo_op] += sum(durations) - least * len(durations)
  return {key: ns / 1e6 / world for key, ns in total.items()}


class Traced:
  """One entry's training step (``training_step.Step``), compiled, with its state; ``__call__``
  traces one blocked step."""

  def __init__(self, step, task, batch, world: int):
    self.step, self.world = step, world
    self.args = list(step.start(task.init(0))) + list(step.dp.shard(batch))
    for _ in range(2):  # compile and warm up
      self.run()
    text = step.run.lower(*self.args).compile().as_text()
    self.module = re.match(r"HloModule (\S+?),", text).group(1)
    self.ops, self.moved = instructions(text), bytes_moved(text)

  def run(self):
    self.args[0], self.args[1], loss = self.step.run(*self.args)
    jax.block_until_ready((self.args[0], self.args[1], loss))

  def __call__(self) -> tuple:
    """``({(phase, instruction): ms per device}, {phase: bytes per device}, {phase: kernels per
    device}, wall-clock ms)`` of one traced step."""
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        self.run()
        wall = time.perf_counter() - start
      trace = self.trace = list(events(trace_dir, self.module))
    moved, kernels = collections.Counter(), collections.Counter()
    for hlo_op, *_ in trace:
      phase = phase_of(*self.ops.get(hlo_op, ("", "")))
      moved[phase] += self.moved.get(hlo_op, 0) / self.world
      if phase:  # control flow is no kernel: the instructions inside it are
        kernels[phase] += 1 / self.world
    return instruction_times(trace, self.ops, self.world), moved, kernels, 1e3 * wall


def profile(traced: dict, repeats: int) -> tuple:
  """``({name: {(phase, instruction): ms}}, {name: {phase: bytes}}, {name: {phase: kernels}},
  {name: wall-clock ms}, {name: step / first's})``: the means over ``repeats`` rounds in which
  every entry's step is traced once,
  in an order that rotates from round to round (as ``common.interleaved`` times them); the ratio is
  the median of the per-round ratios of the wall-clock times to the first entry's."""
  names = list(traced)
  costs = {n: collections.Counter() for n in names}
  moved = {n: collections.Counter() for n in names}
  kernels = {n: collections.Counter() for n in names}
  walls = {n: [] for n in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      cost, step_moved, step_kernels, wall = traced[name]()
      costs[name].update(cost)
      moved[name].update(step_moved)
      kernels[name].update(step_kernels)
      walls[name].append(wall)
  first = np.asarray(walls[names[0]])
  mean = lambda counters: {n: {k: v / repeats for k, v in c.items()}  # noqa: E731
                           for n, c in counters.items()}
  return (mean(costs), mean(moved), mean(kernels), {n: common.median(w) for n, w in walls.items()},
          {n: float(np.median(np.asarray(w) / first)) for n, w in walls.items()})


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None,
                 help="traced steps per entry, round-robin (default 4)")
  p.add_argument("--top", type=int, default=0,
                 help="also list each entry's N costliest instructions, with their op_name, and "
                      "the N op_names moving most of its own passes (with --layers: the N with "
                      "most of its own kernels at the last L)")
  p.add_argument("--devices", type=int, default=step_time.MAX_DEVICES,
                 help=f"data-parallel devices, 1 to {step_time.MAX_DEVICES}")
  p.add_argument("--layers", default=None,
                 help="the leaf-count sweep: comma-separated numbers of same-shape hidden layers "
                      "(e.g. 2,16,128); kernels per step only")
  common.add_variant_option(p)
  args = common.parse(p, argv)
  if args.write:
    p.error("the profile is printed, not written to BENCHMARKS.md")
  if not 1 <= args.devices <= step_time.MAX_DEVICES:
    p.error(f"--devices takes 1 to {step_time.MAX_DEVICES}")
  repeats = args.repeats or (1 if args.quick else 4)
  compressor_list = common.compressors(args.compressors, args.variant)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  if args.layers:
    return sweep(args, compressor_list, [int(n) for n in args.layers.split(",")])
  (model, (task, batch_size)), = step_time.model_tasks(args.quick, ["mlp"]).items()
  traced = _traced(task, batch_size(args.devices), compressor_list, args.devices)
  costs, moved, kernels, walls, ratios = profile(traced, repeats)
  columns = {n: {p: sum(ms for (q, _), ms in c.items() if q == p) for p in PHASES}
             for n, c in costs.items()}
  rows = []
  for phase in PHASES:
    if any(columns[n][phase] > 0 for n in columns):
      rows.append([phase] + [_cell(columns[n][phase], sum(columns[n].values())) for n in columns])
  rows.append(["sum of the phases"] + [f"{sum(columns[n].values()):.4g}" for n in columns])
  rows.append(["step (wall clock)"] + [f"{walls[n]:.4g}" for n in columns])
  rows.append(["step / allreduce"] + [f"{ratios[n]:.2f}" for n in columns])
  table = common.markdown_table(["phase, ms per device (share)"] + list(columns), rows)
  body = (f"{model}, W = {args.devices}, {repeats} traced steps per entry, round-robin; each phase "
          "in ms per device and step and as a share of the phases' sum; the wall-clock step is the "
          "median, its ratio the median of the per-round ratios (`benchmarks/step_profile.py`'s "
          "docstring says how events are assigned).\n\n" + table)
  gradient = 4 * common.num_params(task.init(0))
  passes = [[phase] + [f"{moved[n].get(phase, 0) / gradient:.2f}" for n in columns]
            for phase in PHASES if phase != "waiting at collectives"
            and any(moved[n].get(phase, 0) > 0 for n in columns)]
  passes.append(["sum"] + [f"{sum(moved[n].values()) / gradient:.2f}" for n in columns])
  body += ("\n\nBytes moved per device and step, in passes over the gradient (bytes ÷ its float32 "
           "bytes; the docstring says how they are counted):\n\n"
           + common.markdown_table(["phase, passes over the gradient"] + list(columns), passes))
  counts = [[phase] + [f"{kernels[n].get(phase, 0):.0f}" for n in columns] for phase in PHASES
            if any(kernels[n].get(phase, 0) > 0 for n in columns)]
  counts.append(["the compressor's own"] + [f"{_own(kernels[n]):.0f}" for n in columns])
  counts.append(["sum"] + [f"{sum(kernels[n].values()):.0f}" for n in columns])
  body += ("\n\nKernels run per device and step (executed instructions but control flow; the "
           "docstring says which):\n\n"
           + common.markdown_table(["phase, kernels"] + list(columns), counts))
  tops = [[name, phase, hlo_op, f"{ms:.3g}", _short(traced[name].ops.get(hlo_op, ("", ""))[1])]
          for name, c in costs.items()
          for (phase, hlo_op), ms in sorted(c.items(), key=lambda kv: -kv[1])[:args.top]]
  if tops:
    body += "\n\n" + common.markdown_table(["entry", "phase", "instruction", "ms", "op_name"],
                                            tops, "lllrl")
    tops = [[name, f"{b / args.devices / gradient:.2f}", _short(op_name)]
            for name, t in traced.items()
            for op_name, b in _own_op_names(t, bytes_=True).most_common(args.top)]
    body += ("\n\nThe op_names that move most of each entry's own passes (the compressor's "
             "phases, collectives included):\n\n"
             + common.markdown_table(["entry", "passes", "op_name"], tops, "lrl"))
  common.emit(args, "profile", "Where the step's time goes", "step_profile.py", body)
  return 0


def _traced(task, batch_size: int, compressor_list, world: int) -> dict:
  """Each entry's ``Traced`` training step of ``task`` on W = ``world`` devices."""
  batch = task.batch(0, 0, batch_size)
  steps = step_time.make_steps(task, compressor_list, jax.devices()[:world],
                               lambda inner: scoped(inner, OPTIMIZER_SCOPE))
  return {name: Traced(step, task, batch, world) for name, step in steps.items()}


def _own(kernels: dict) -> float:
  return sum(kernels.get(phase, 0) for phase in OWN)


def sweep(args, compressor_list, layers: list) -> int:
  """The leaf-count sweep (the module docstring): one traced step per entry and number of
  layers."""
  own, whole = collections.defaultdict(dict), collections.defaultdict(dict)
  for n in layers:
    task = step_time.MLPTask((SWEEP_WIDTH,) * (n + 1))
    traced = _traced(task, 8 * args.devices, compressor_list, args.devices)
    _, _, kernels, _, _ = profile(traced, 1)
    for name, counts in kernels.items():
      own[name][n], whole[name][n] = _own(counts), sum(counts.values())
    if n == layers[-1]:
      tops = [[name, f"{k / args.devices:.0f}", _short(op_name)]
              for name, t in traced.items()
              for op_name, k in _own_op_names(t).most_common(args.top)]
    del traced
    jax.clear_caches()
  header = (["entry"] + [f"L = {n}: own (step)" for n in layers]
            + [f"own {b} / {a}" for a, b in zip(layers, layers[1:])])
  rows = [[name] + [f"{own[name][n]:.0f} ({whole[name][n]:.0f})" for n in layers]
          + [f"{own[name][b] / max(own[name][a], 1):.2f}" for a, b in zip(layers, layers[1:])]
          for name in own]
  body = (f"MLP of L same-shape hidden layers ({SWEEP_WIDTH} wide), W = {args.devices}, one traced "
          "step per entry: kernels per device and step, the compressor's own phases and, in "
          "parentheses, the whole step's.\n\n" + common.markdown_table(header, rows))
  if tops:
    body += (f"\n\nThe op_names with most of each entry's own kernels at L = {layers[-1]}:\n\n"
             + common.markdown_table(["entry", "kernels", "op_name"], tops, "lrl"))
  common.emit(args, "profile_sweep", "Kernels against the number of leaves", "step_profile.py",
              body)
  return 0


def _own_op_names(traced: Traced, bytes_: bool = False) -> collections.Counter:
  """``{op_name: kernels (or bytes, with bytes_) on all devices}`` of the compressor's own phases
  in ``traced``'s last traced step: an op_name run once per leaf shows up with as many kernels as
  leaves."""
  out = collections.Counter()
  for hlo_op, *_ in traced.trace:
    opcode, op_name = traced.ops.get(hlo_op, ("", ""))
    if phase_of(opcode, op_name) in OWN:
      out[op_name] += traced.moved.get(hlo_op, 0) if bytes_ else 1
  return out


def _short(op_name: str) -> str:
  """``op_name`` without the step's own prefix (``jit(_global_step)/…/shard_map/``)."""
  return op_name.split("shard_map/", 1)[-1][:120]


def _cell(ms: float, total: float) -> str:
  return f"{ms:.3g} ({100 * ms / total:.0f}%)"


if __name__ == "__main__":
  sys.exit(main())
