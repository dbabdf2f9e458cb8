"""Quality on a transformer: every registry entry trained for hundreds of steps, against allreduce.

The main job's machinery (``jaxcomp.train.training_loop.train``: the chars task, the registry's
recipes for the run's length, ``jaxcomp.data_parallel``'s step on W simulated CPU devices, every
entry side by side on the same batches from the same initial parameters), with the learning rates on
a schedule (``--schedule``, default warm-up and cosine decay:
``jaxcomp.train.tasks.learning_rate_schedule``). Per entry it prints the final held-out loss (the
mean of the last evaluations, as the main job's) and its ratio to allreduce's, the steps until the
held-out loss first reaches allreduce's final one (the target) and their ratio to allreduce's own,
and the bytes each device sends per step in the steady state (``jaxcomp.report``, ring algorithm,
requested wire dtypes) with allreduce's bytes / the entry's. Entries that have not reached the
target after their steps go on up to ``--max-steps`` (the recipes and the schedule stay those of
their steps, so the rate stays at the schedule's last).

Under a decaying schedule every run's loss falls most as its rate decays, at its own end, so an
entry a little short of the target at ``--steps`` seldom reaches it in the extra steps, at a tenth
of the peak rate. "Does it reach allreduce's loss within F× allreduce's steps?" is answered by
``--stretch F``: every entry but allreduce trains for F × ``--steps`` steps, its recipe and schedule
fitted to that length, as a user with F× the budget would train it.

``--size`` picks a larger chars transformer (``tasks.CHARS_SIZES``: ``768x4`` is 28.6M parameters
on the whole standard library's source), ``--batch-size`` the global batch. On one device
(``gpu.sh`` runs it on one GPU) nothing is sent: the bytes columns are then those of the same steps
lowered for 8 CPU devices (``--bytes-devices``). ``--out`` writes the rows as JSON.

  PYTHONPATH=. python benchmarks/quality.py [--quick] [--write] [--compressors a,b] [--steps N]
      [--stretch F] [--size 768x4] [--batch-size 64] [--devices 1] [--out rows.json]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp.train import device_setup, registry, tasks, training_loop  # noqa: E402
from jaxcomp.train.runs import WINDOW, target_of  # noqa: E402

QUICK = ("allreduce", "fp16")
"""The entries of a ``--quick`` run: the baseline and one compressor."""


def row(run, base, target: float) -> list:
  """One entry's cells: held-out loss (and / the target), steps to the target (and / allreduce's),
  bytes per step (and allreduce's / its)."""
  loss = run.final[0]
  reached = None if run.diverged else run.steps_to(target)
  base_steps = base.steps_to(target) or base.steps
  if run.diverged:
    steps = "diverged"
  elif reached is None:
    steps = f"not in {len(run.losses)}"
  else:
    steps = f"{reached} ({reached / base_steps:.2f}x)"
  fewer = base.bytes_per_step / run.bytes_per_step if run.bytes_per_step else float("inf")
  return [run.name, f"{loss:.3f}", f"{loss / target:.3f}", steps,
          common.human(run.bytes_per_step), f"{fewer:.1f}x"]


HEADER = ["entry", "held-out loss", "/ allreduce's", "steps to allreduce's loss (/ its steps)",
          "sent/step/device", "allreduce's bytes / its"]


def table(runs) -> str:
  """The Markdown table of ``runs`` against allreduce (the first run when allreduce is absent)."""
  base, target = target_of(runs)
  return common.markdown_table(HEADER, [row(r, base, target) for r in runs])


def bytes_over_cpu_devices(task, names, world: int) -> dict:
  """``{entry: bytes each device sends per steady-state step}`` with the same model over ``world``
  CPU devices, read from the step lowered there (as ``training_loop.train`` reads them on its own
  devices)."""
  import jaxcomp  # noqa: PLC0415
  from jaxcomp.train import training_step  # noqa: PLC0415
  cpus = jax.devices("cpu")
  if len(cpus) < world:
    raise RuntimeError(f"--bytes-devices {world}: only {len(cpus)} CPU devices are available")
  mesh = training_step.make_mesh(cpus[:world])
  params0 = task.init(0)
  x0, y0 = task.batch(0, 0, world)
  out = {}
  for name in names:
    entry = registry.REGISTRY[name]
    step = training_step.make_step(task, task.optimizer(entry), mesh)
    lowered = step.lower(*step.start(params0), x0, y0)
    out[name] = entry.bytes_per_step(jaxcomp.comm_report(lowered, stage="lowered",
                                                         num_devices=world))
    del step, lowered
  return out


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=None,
                 help="training steps per entry, and the recipes' length (default 600, quick 6)")
  p.add_argument("--max-steps", type=int, default=None,
                 help="entries short of allreduce's final held-out loss go on up to this many "
                      "steps (default 1.5 x --steps)")
  p.add_argument("--devices", type=int, default=None,
                 help="data-parallel devices: simulated CPU devices, or the default backend's "
                      "when it is not the CPU (default 8, quick 2)")
  p.add_argument("--size", choices=tasks.CHARS_SIZES, default="small",
                 help="the chars transformer's size (tasks.CHARS_SIZES; quick: a tiny one)")
  p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
  p.add_argument("--bytes-devices", type=int, default=8,
                 help="on one device, read the bytes columns from the steps lowered for this many "
                      "CPU devices")
  p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
  p.add_argument("--schedule", choices=tasks.SCHEDULES, default="cosine",
                 help="every learning rate's schedule (tasks.learning_rate_schedule)")
  p.add_argument("--stretch", type=float, default=1.0,
                 help="every entry but allreduce trains for this many times --steps, its recipe "
                      "and schedule fitted to that length (default 1)")
  args = common.parse(p, argv)
  if not args.stretch >= 1:
    p.error(f"--stretch must be at least 1 (times allreduce's steps); got {args.stretch}")
  steps = args.steps or (6 if args.quick else 600)
  own = round(args.stretch * steps)
  max_steps = args.max_steps or own * 3 // 2
  names = [c.name for c in common.compressors(args.compressors or ",".join(
      QUICK if args.quick else registry.REGISTRY))]
  if "allreduce" not in names:
    names.insert(0, "allreduce")
  count = args.devices or (2 if args.quick else 8)
  if count == 1:  # also args.bytes_devices CPU devices, to read the bytes from
    try:
      device_setup.simulate_cpu_devices(args.bytes_devices)
    except RuntimeError:
      pass  # JAX has already started: bytes_over_cpu_devices says if it has too few
    devices = jax.devices()[:1]
  else:
    devices = device_setup.setup_devices(count)
  task = tasks.chars(quick=args.quick, size=args.size)
  start = time.perf_counter()
  runs = training_loop.train(task, names, steps=steps, devices=devices,
                             batch_size=args.batch_size, seed=0, max_steps=max_steps,
                             progress=not args.quick, schedule=args.schedule, stretch=args.stretch)
  trained = time.perf_counter() - start
  world = f"{len(devices)} simulated CPU devices"
  if devices[0].platform != "cpu" or len(devices) == 1:
    world = f"{len(devices)} {devices[0].platform.upper()} device ({devices[0].device_kind})"
  if len(devices) == 1:
    sent = bytes_over_cpu_devices(task, names, args.bytes_devices)
    for run in runs:
      run.bytes_per_step = sent[run.name]
    world += (f"; bytes: the same steps lowered for {args.bytes_devices} CPU devices (one device "
              "sends nothing)")
  base, target = target_of(runs)
  length = (f"{steps} steps with each entry's recipe for {steps}" if own == steps else
            f"allreduce {steps} steps, every other entry {own} ({args.stretch:g}x) with its "
            f"recipe and schedule for {own}")
  rows = [row(r, base, target) for r in runs]
  params = common.num_params(jax.eval_shape(task.init, 0))
  common.write_out(args.out, "quality.py", args.argv, HEADER, rows, True, steps=steps,
                   max_steps=max_steps, seconds=round(trained, 1), params=params, target=target,
                   world=world)
  size = ("" if args.size == "small" else " (quick: a tiny one)" if args.quick else
          f" of size {args.size} (`tasks.CHARS_SIZES`)")
  body = (f"The chars transformer{size} ({params:,} parameters), {length} "
          f"(entries short of the target go on up to "
          f"{max_steps}), {world}, global batch {args.batch_size} × "
          f"{task.model.context} characters, seed 0, learning "
          f"rates {args.schedule} (`tasks.learning_rate_schedule`); "
          f"{trained:.0f} s training on a machine shared with other jobs. "
          f"Held-out loss: the mean of the last {WINDOW} evaluations after the entry's steps; "
          f"target: {base.name}'s, {target:.3f}; bytes: each device's per step in the steady "
          "state (ring algorithm, requested wire dtypes).\n\n" + table(runs))
  common.emit(args, "quality", "Quality on a transformer", "quality.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
