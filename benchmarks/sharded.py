"""Sharded optimizer state (ZeRO-1/2): step time and held-out quality against the unsharded step.

Both on the main job's task (``jaxcomp.train.tasks.chars``: the character transformer), W = 8
simulated CPU devices, ``jaxcomp.data_parallel``, global batch 32, the main job's optimizer
(``clip_by_global_norm(1)`` and SGD 0.3 with momentum 0.9; sharded: its
``sharded_clip_by_global_norm``):

* ``time``: for each exchange, the unsharded step (``optax.chain(exchange, clip, sgd)``) and the
  sharded one (``sharded_optimizer(exchange, chain(clip, sgd), gather_dtype=...)``), timed side by
  side, round-robin (``common.interleaved``: the machine is shared), as the median over rounds of
  sharded ÷ unsharded (the goal: ≤ 1.3);
* ``packing``: the reduce-scatter and all-gather of every leaf of the model's gradient, one pair per
  leaf against one pair for all leaves (``shards.mean_scatter`` / ``shards.gather``): XLA:CPU
  combines neither collective, so packing them is ``shards``' choice;
* ``quality``: the held-out loss (the mean of the last 10 of 60 evaluations, as the main job
  reports it) of allreduce unsharded and of each sharded exchange after the same number of steps,
  and the first step at which each reaches allreduce's final held-out loss.

  PYTHONPATH=. python benchmarks/sharded.py time [--quick] [--rounds N] [--exchanges A,B]
  PYTHONPATH=. python benchmarks/sharded.py packing [--quick] [--rounds N]
  PYTHONPATH=. python benchmarks/sharded.py quality [--quick] [--steps N] [--exchanges A,B]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

W = 8
device_setup.simulate_cpu_devices(W)  # before JAX starts its backends

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxcomp  # noqa: E402
from benchmarks import common  # noqa: E402
from jaxcomp.train import tasks  # noqa: E402
from jaxcomp.train.runs import WINDOW  # noqa: E402
from jaxcomp.train.training_loop import EVALUATIONS  # noqa: E402

BATCH = 32
# name: (exchange factory, gather dtype of the sharded step)
EXCHANGES = {
    "allreduce": (lambda: jaxcomp.allreduce(), None),
    "bf16 (bf16 gather)": (lambda: jaxcomp.bf16_compress(), "bfloat16"),
    "int8 (bf16 gather)": (lambda: jaxcomp.quantized(8), "bfloat16"),
    "int8 (int8 gather)": (lambda: jaxcomp.quantized(8), "int8"),
}


def optimizers(task, exchange: str) -> tuple:
  """``(unsharded, sharded)`` optimizers of the main job's recipe after ``exchange``."""
  make, gather = EXCHANGES[exchange]
  sgd = lambda: optax.sgd(task.learning_rate, momentum=0.9)  # noqa: E731
  unsharded = optax.chain(make(), optax.clip_by_global_norm(1.0), sgd())
  sharded = jaxcomp.sharded_optimizer(
      make(), optax.chain(jaxcomp.sharded_clip_by_global_norm(1.0), sgd()), gather_dtype=gather)
  return unsharded, sharded


def runner(task, tx, mesh, seed: int = 0):
  """A function that takes one step (and blocks), and the state it advances."""
  dp = jaxcomp.data_parallel(task.loss, mesh, tx=tx)
  params = task.init(seed)
  box = {"params": params, "opt_state": dp.make_state(params), "step": 0}

  def step():
    batch = dp.shard(task.batch(seed, box["step"], BATCH))
    box["params"], box["opt_state"], loss = dp.step(box["params"], box["opt_state"], *batch)
    box["step"] += 1
    return common.block(loss)

  return step, box


def time_table(quick: bool, rounds: int, exchanges: list) -> str:
  task = tasks.chars(quick)
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  rows = []
  for exchange in exchanges:
    unsharded, sharded = optimizers(task, exchange)
    fns = {"unsharded": runner(task, unsharded, mesh)[0], "sharded": runner(task, sharded, mesh)[0]}
    times = common.interleaved(fns, rounds, warmup=2)
    rows.append([exchange, f"{common.median(times['unsharded']) * 1e3:.1f}",
                 f"{common.median(times['sharded']) * 1e3:.1f}",
                 f"{common.ratio(times, 'sharded', 'unsharded'):.2f}"])
    print(f"  {exchange}: sharded ÷ unsharded {rows[-1][-1]}", file=sys.stderr, flush=True)
  return common.markdown_table(["exchange", "unsharded ms", "sharded ms", "sharded ÷ unsharded"],
                               rows)


def packing_table(quick: bool, rounds: int) -> str:
  from jax import lax  # noqa: PLC0415
  from jax.sharding import PartitionSpec  # noqa: PLC0415
  from jaxcomp._src import axis, shards  # noqa: PLC0415
  leaves = jax.tree.leaves(tasks.chars(quick).init(0))
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  cut = shards.Layout(W)
  vary = lambda xs: [lax.pcast(x, "batch", to="varying") for x in xs]  # noqa: E731

  def per_leaf(*xs):
    owned = [lax.psum_scatter(cut.split(x), "batch", scatter_dimension=0, tiled=False)
             for x in vary(xs)]
    return [cut.join(axis.all_gather(o, "batch"), x.shape) for o, x in zip(owned, xs)]

  def packed(*xs):
    return shards.gather(shards.mean_scatter(vary(xs), "batch"), [x.shape for x in xs], "batch")

  fns = {}
  for name, f in (("one pair per leaf", per_leaf), ("packed", packed)):
    mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec(),
                                   out_specs=PartitionSpec()))
    fns[name] = lambda mapped=mapped: common.block(mapped(*leaves))
  times = common.interleaved(fns, rounds, warmup=2)
  rows = [[name, f"{common.median(t) * 1e3:.1f}",
           f"{common.ratio(times, name, 'packed'):.2f}"] for name, t in times.items()]
  return (f"{len(leaves)} leaves, {common.num_params(leaves):,} values, W = {W}\n\n"
          + common.markdown_table(["collectives", "ms", "÷ packed"], rows))


def train(task, tx, mesh, steps: int, seed: int = 0) -> list:
  """``[(step, held-out loss)]`` every ``steps // EVALUATIONS`` steps, step 0 first."""
  step, box = runner(task, tx, mesh, seed)
  every = max(steps // EVALUATIONS, 1)
  evals = [(0, task.evaluate(box["params"])[0])]
  for t in range(1, steps + 1):
    step()
    if t % every == 0:
      evals.append((t, task.evaluate(box["params"])[0]))
  return evals


def held_out(evals: list, step: int) -> float:
  """The main job's held-out loss at ``step``: the mean of the last ``WINDOW`` evaluations."""
  done = [e for e in evals[1:] if e[0] <= step] or evals[:1]
  return float(np.mean([loss for _, loss in done[-WINDOW:]]))


def quality_table(quick: bool, steps: int, exchanges: list) -> str:
  task = tasks.chars(quick)
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  reference = train(task, optimizers(task, "allreduce")[0], mesh, steps)
  target = held_out(reference, steps)
  rows = [["allreduce, unsharded", f"{target:.3f}", str(steps)]]
  for exchange in exchanges:
    evals = train(task, optimizers(task, exchange)[1], mesh, steps)
    reached = next((s for s, _ in evals[1:] if held_out(evals, s) <= target), None)
    rows.append([f"{exchange}, sharded", f"{held_out(evals, steps):.3f}",
                 str(reached) if reached else f"not in {steps}"])
    print(f"  {exchange}: {rows[-1][1]} (allreduce {target:.3f})", file=sys.stderr, flush=True)
  return common.markdown_table(["run", f"held-out loss at {steps}",
                                "steps to allreduce's final loss"], rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("what", choices=("time", "packing", "quality"))
  parser.add_argument("--quick", action="store_true", help="the task's small model")
  parser.add_argument("--rounds", type=int, default=30, help="timing rounds (time, packing)")
  parser.add_argument("--steps", type=int, default=400, help="training steps (quality)")
  parser.add_argument("--exchanges", default=",".join(EXCHANGES),
                      help=f"comma-separated, of: {', '.join(EXCHANGES)} (time, quality)")
  args = parser.parse_args(argv)
  exchanges = [e.strip() for e in args.exchanges.split(",") if e.strip()]
  unknown = [e for e in exchanges if e not in EXCHANGES]
  if unknown:
    parser.error(f"--exchanges: unknown {', '.join(unknown)}")
  if args.what == "time":
    print(time_table(args.quick, args.rounds, exchanges))
  elif args.what == "packing":
    print(packing_table(args.quick, args.rounds))
  else:
    print(quality_table(args.quick, args.steps, exchanges))
  return 0


if __name__ == "__main__":
  sys.exit(main())
