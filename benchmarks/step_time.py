"""Full training step time per compressor, as a ratio to the allreduce step, on 8 simulated devices.

The real models of ``python -m jaxcomp.train``'s ``chars`` task (a pre-LayerNorm causal transformer
on Python standard-library text): the default one, and a wider and deeper one. Every step is the
data-parallel step of ``jaxcomp.train.job.make_step`` — forward, backward, the compressor, then
``optax.sgd`` (momentum 0.9, or none after DGC, which applies momentum itself, and EF-SignSGD;
nothing after 1-bit Adam, an optimizer) — jitted under ``jax.pmap`` over W = 8 simulated CPU
devices. Compressors compress from the first step (``start_iter=0``). The steps of all compressors
run round-robin on the same batch, each one blocked on; the ratio is the median over rounds of time(compressor) / time(allreduce) in the same round.

On XLA:CPU the 8 "devices" share the host's cores and a collective is a memory copy, so this measures
the compute a compressor adds to a step, not what it saves on a network (see ``network_model.py``).

  PYTHONPATH=. python benchmarks/step_time.py [--quick] [--write]
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

W = 8
jax.config.update("jax_num_cpu_devices", W)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402


def model_tasks(quick: bool) -> dict:
  from jaxcomp.train import tasks
  task = tasks.chars(quick=quick)
  if quick:
    return {"chars (quick)": task}
  wide = dataclasses.replace(task, model=tasks.CharTransformer(context=64, width=256, depth=4))
  return {"chars transformer": task, "chars transformer, width 256, depth 4": wide}


def step_runners(task, compressor_list, batch):
  """A function per compressor running one blocked pmapped training step on ``batch``."""
  from jaxcomp.train.job import make_step
  devices = jax.devices()[:W]
  # On the devices already, on a mesh axis of the step's name, as the step returns them: other
  # inputs would compile the step a second time.
  on_devices = jax.pmap(lambda x: x, axis_name=common.AXIS, devices=devices)
  params0 = on_devices(jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (W,) + x.shape),
                                    task.init(0)))
  inputs, targets = on_devices([a.reshape((W, -1) + a.shape[1:]) for a in batch])
  runners = {}
  for c in compressor_list:
    tx = c.make(common.AXIS) if c.is_optimizer else optax.chain(
        c.make(common.AXIS), optax.sgd(task.learning_rate, momentum=c.sgd_momentum))
    step = jax.pmap(make_step(task, tx), axis_name=common.AXIS, devices=devices)
    holder = [params0, jax.pmap(tx.init, axis_name=common.AXIS, devices=devices)(params0)]

    def run(step=step, holder=holder):
      holder[0], holder[1], loss = step(holder[0], holder[1], inputs, targets)
      jax.block_until_ready((holder, loss))  # XLA:CPU needs every multi-device step blocked on
    runners[c.name] = run
  return runners


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 40, quick 2)")
  p.add_argument("--batch-size", type=int, default=64, help="global batch, split over 8 devices")
  args = common.parse(p, argv)
  repeats = args.repeats or (2 if args.quick else 40)
  compressor_list = common.compressors(args.compressors)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  rows = []
  for model, task in model_tasks(args.quick).items():
    n = sum(x.size for x in jax.tree.leaves(task.init(0)))
    runners = step_runners(task, compressor_list, task.batch(0, 0, args.batch_size))
    times = common.interleaved(runners, repeats, warmup=2)
    for c in compressor_list:
      rows.append([f"{model} ({n:,} params)", c.name, c.about,
                   f"{1e3 * common.median(times[c.name]):.1f}",
                   f"{common.ratio(times, c.name, 'allreduce'):.2f}"])
      print(f"  {model} {c.name}: {rows[-1][-1]}", file=sys.stderr, flush=True)
  table = common.markdown_table(["model", "compressor", "settings", "step ms", "step / allreduce"],
                                rows, "lllrr")
  body = (f"W = {W} simulated devices (`jax.pmap`), global batch {args.batch_size} sequences; median "
          f"of {repeats} interleaved per-round ratios (target for powersgd_r1: ≤ 1.10). The ms column "
          "is for scale only: the 8 devices share the machine's cores.\n\n" + table)
  common.emit(args, "step_time", "Training step time against allreduce", "step_time.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
