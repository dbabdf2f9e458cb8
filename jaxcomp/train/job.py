"""The main job: train a Flax model once per compressor and compare them (``python -m jaxcomp.train``).

Every compressor trains the same model from the same initial parameters on the same batches, on N
data-parallel devices (simulated CPU devices unless the host has accelerators), with
``optax.chain(compressor, clip_by_global_norm(1), sgd(lr, momentum=0.9))`` (DGC applies the momentum
itself, so it is followed by plain SGD, and so is EF-SignSGD, as in its paper; 1-bit Adam is a whole
optimizer with its own learning rate, so nothing follows it); local SGD and DiLoCo wrap
``chain(clip_by_global_norm(1), sgd(lr, momentum=0.9))`` as their inner optimizer, and their bytes per
step are those of a sync step divided by its period. Each compressor runs the recipe of
``jaxcomp.train.registry`` for the run's length (PowerSGD's ``start_iter`` and DGC's warm-up over the
first 10% of the steps, 1-bit Adam's dense Adam over the first 20%); the bytes are those of a
compressed step. The compressors advance
side by side — step t of every compressor before step t + 1 of any — so their step times are measured
under the same load.

Outputs: a table on stdout (also ``OUT/results.md``; raw numbers in ``OUT/results.json``) with, per
compressor, the bytes each device sends per step (``jaxcomp.report`` reading the step's HLO: the ring
algorithm's bytes in the wire dtypes jaxcomp asks for; a note says where XLA widens them), the
compression ratio and step-time ratio against ``allreduce``, and the final held-out loss and accuracy;
and ``OUT/loss.png``, the training loss against step and against cumulative bytes sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np

from jaxcomp.train import registry

AXIS = "batch"


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line on stderr and exit status 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


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
           "source text; digits: an MLP on scikit-learn's bundled 8x8 digits (needs scikit-learn)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per compressor (default 300, or 20 with --quick)")
  parser.add_argument(
      "--devices", type=int, default=8,
      help="data-parallel devices; on CPU this many devices are simulated "
           "(jax_num_cpu_devices), on a GPU/TPU host at most the devices it has")
  parser.add_argument(
      "--compressors", default=",".join(registry.DEFAULT),
      help="comma-separated compressors to compare, allreduce first if present; choose from: "
           + "; ".join(f"{k} ({v.about})" for k, v in registry.REGISTRY.items()).replace("%", "%%"))
  parser.add_argument("--out", default="jaxcomp_train_out",
                      help="folder for results.md, results.json and loss.png (created if missing)")
  parser.add_argument(
      "--batch-size", type=int, default=None,
      help="global batch per step, split evenly over the devices (default: 32 sequences of 64 "
           "characters for chars, 128 images for digits)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and of the batch order")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny run for CI: smaller model and eval set, 20 steps unless --steps")
  args = parser.parse_args(argv)

  if args.steps is None:
    args.steps = 20 if args.quick else 300
  if args.steps <= 0:
    parser.error(f"--steps must be a positive number of steps; got {args.steps}")
  if args.devices <= 0:
    parser.error(f"--devices must be a positive number of devices; got {args.devices}")
  if args.batch_size is None:
    args.batch_size = {"chars": 32, "digits": 128}[args.task]
  if args.batch_size <= 0 or args.batch_size % args.devices:
    parser.error(f"--batch-size must be a positive multiple of --devices {args.devices} (each "
                 f"device gets an equal share); got {args.batch_size}")
  names = [n.strip() for n in args.compressors.split(",") if n.strip()]
  unknown = [n for n in names if n not in registry.REGISTRY]
  if unknown or not names:
    parser.error(f"--compressors: unknown compressor {', '.join(map(repr, unknown)) or '(none)'}; "
                 f"choose from {', '.join(registry.REGISTRY)}")
  if len(set(names)) != len(names):
    parser.error(f"--compressors lists a compressor twice: {args.compressors}")
  args.compressors = names
  return args


def setup_devices(count: int) -> list:
  """Asks JAX for ``count`` CPU devices (before it starts) and returns the first ``count`` devices.

  Raises:
    RuntimeError: when fewer than ``count`` devices are available.
  """
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    pass  # JAX has already started (a notebook, a test): use the devices it has.
  devices = jax.devices()
  if len(devices) < count:
    raise RuntimeError(f"--devices {count}: only {len(devices)} {devices[0].platform} devices are "
                       "available")
  return devices[:count]


@dataclasses.dataclass
class Run:
  """What one compressor's training produced."""
  name: str
  bytes_per_step: float
  wire_note: str
  losses: list
  step_seconds: list
  eval_loss: float = float("nan")
  accuracy: float = float("nan")

  @property
  def median_step_seconds(self) -> float:
    timed = self.step_seconds[2:] or self.step_seconds  # the first steps include compilation
    return float(np.median(timed))


def _replicate(tree, n):
  import jax
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + np.shape(x)), tree)


def make_step(task, tx):
  """The data-parallel training step: per-device loss and gradient, then the optax chain."""
  import jax
  import optax

  def step(params, opt_state, inputs, targets):
    loss, grads = jax.value_and_grad(task.loss)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def train(task, names: Sequence[str], *, steps: int, devices: list, batch_size: int, seed: int,
          progress: bool = True) -> list:
  """Trains ``task`` once per compressor in ``names``, side by side, and returns a ``Run`` each."""
  import jax
  import optax
  import tqdm

  from jaxcomp._src.report import parse_hlo

  n = len(devices)
  params0 = task.init(seed)
  runs, states = [], []
  x0, y0 = task.batch(seed, 0, batch_size)
  shard = lambda a: a.reshape((n, -1) + a.shape[1:])
  def optimizer(entry, **recipe):
    inner = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.sgd(task.learning_rate, momentum=entry.sgd_momentum))
    return entry.optimizer(inner, AXIS, **recipe)

  for name in tqdm.tqdm(names, desc="compiling", disable=not progress, file=sys.stderr):
    entry = registry.REGISTRY[name]
    tx = optimizer(entry, steps=steps)
    step = jax.pmap(make_step(task, tx), axis_name=AXIS, devices=devices, donate_argnums=(0, 1))
    params = _replicate(params0, n)
    opt_state = jax.pmap(tx.init, devices=devices)(params)
    # Bytes per step: comm_report's reading of the steady-state (compressing) step, in the wire
    # dtypes jaxcomp asks for (lowered) and as XLA compiles them.
    steady = optimizer(entry)
    lowered = jax.pmap(make_step(task, steady), axis_name=AXIS, devices=devices).lower(
        params, jax.pmap(steady.init, devices=devices)(params), shard(x0), shard(y0))
    requested = entry.bytes_per_step(parse_hlo(lowered.as_text(dialect="hlo"), n))
    sent = entry.bytes_per_step(parse_hlo(lowered.compile().as_text(), n))
    note = "" if sent == requested else (
        f"{name}: XLA:{devices[0].platform.upper()} sends {_bytes(sent)} after "
        "compiling (it widens the wire dtype)")
    runs.append(Run(name, requested, note, [], []))
    states.append([step, params, opt_state])

  bar = tqdm.tqdm(total=steps * len(names), desc=f"{task.name} x{len(names)}", unit="step",
                  disable=not progress, file=sys.stderr, mininterval=0.5)
  for t in range(steps):
    inputs, targets = (shard(a) for a in task.batch(seed, t, batch_size))
    for run, state in zip(runs, states):
      start = time.perf_counter()
      state[1], state[2], loss = state[0](state[1], state[2], inputs, targets)
      loss = float(np.mean(jax.device_get(loss)))  # blocks every step (XLA:CPU needs it)
      run.step_seconds.append(time.perf_counter() - start)
      run.losses.append(loss)
      bar.set_postfix_str(f"{run.name} loss {loss:.3f}", refresh=False)
      bar.update()
  bar.close()
  for run, state in zip(runs, states):
    run.eval_loss, run.accuracy = task.evaluate(jax.tree.map(lambda x: x[0], state[1]))
  return runs


def _bytes(b: float) -> str:
  for unit, size in (("MB", 1e6), ("kB", 1e3)):
    if b >= size:
      return f"{b / size:.1f} {unit}"
  return f"{b:.0f} B"


def table(runs: Sequence[Run]) -> str:
  """The results as a Markdown table; ratios are against ``allreduce`` (or the first run)."""
  base = next((r for r in runs if r.name == "allreduce"), runs[0])
  rows = ["| compressor | sent/step/device | compression | step time | loss | accuracy |",
          "|---|---:|---:|---:|---:|---:|"]
  for r in runs:
    ratio = base.bytes_per_step / r.bytes_per_step if r.bytes_per_step else float("inf")
    rows.append(f"| {r.name} | {_bytes(r.bytes_per_step)} | {ratio:.1f}x | "
                f"{r.median_step_seconds / base.median_step_seconds:.2f}x | {r.eval_loss:.3f} | "
                f"{100 * r.accuracy:.1f}% |")
  notes = [r.wire_note for r in runs if r.wire_note]
  return "\n".join(rows + ([""] + notes if notes else []))


def plot(runs: Sequence[Run], path: str, title: str) -> None:
  """Saves the training loss (smoothed) against step and against cumulative bytes sent."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for r in runs:
    smooth = _ema(r.losses, 0.9)
    steps = np.arange(1, len(r.losses) + 1)
    by_step.plot(steps, smooth, label=r.name)
    by_bytes.plot(steps * r.bytes_per_step / 1e6, smooth, label=r.name)
  by_step.set(xlabel="step", ylabel="training loss (EMA 0.9)", title=title)
  by_bytes.set(xlabel="cumulative MB sent per device", xscale="log", title="loss against bytes")
  by_step.legend()
  for ax in (by_step, by_bytes):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _ema(values, decay):
  out, avg = [], values[0]
  for v in values:
    avg = decay * avg + (1 - decay) * v
    out.append(avg)
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
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
  header = (f"task {args.task} ({num_params:,} parameters), {args.steps} steps, {len(devices)} "
            f"{devices[0].platform} devices, global batch {args.batch_size}, seed {args.seed}")
  print(header, flush=True)
  start = time.perf_counter()
  runs = train(task, args.compressors, steps=args.steps, devices=devices,
               batch_size=args.batch_size, seed=args.seed)
  result = table(runs)
  print(result)
  print(f"({time.perf_counter() - start:.0f} s; loss and accuracy on held-out data; step time is "
        "the median, as a ratio to allreduce's)")

  os.makedirs(args.out, exist_ok=True)
  command = "python -m jaxcomp.train " + " ".join(sys.argv[1:] if argv is None else argv)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(f"`{command.strip()}`\n\n{header}\n\n{result}\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"command": command.strip(), "task": args.task, "steps": args.steps,
               "devices": len(devices), "batch_size": args.batch_size, "seed": args.seed,
               "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
  plot(runs, os.path.join(args.out, "loss.png"), f"{args.task}, {len(devices)} devices")
  print(f"wrote {args.out}/results.md, results.json, loss.png")
  return 0
