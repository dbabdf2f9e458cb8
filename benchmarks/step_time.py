"""Full training step time per compressor, as a ratio to the allreduce step, on simulated devices.

Three models:

* ``mlp``: the MLP of the step-time goals (BENCHMARKS.md), 784-1024-1024-1024-10 (2,913,290
  parameters), on random inputs, batch 64 per device, plain softmax cross-entropy (no Flax);
* ``chars`` and ``chars-wide``: the models of ``python -m jaxcomp.train``'s ``chars`` task (a
  pre-LayerNorm causal transformer on Python standard-library text): the default one and a wider and
  deeper one (3.2M parameters), global batch 64 sequences.

Every step is the main job's data-parallel step (``jaxcomp.train.training_step.make_step``: the step
``jaxcomp.data_parallel`` builds from the loss) — forward, backward, the compressor, then
``optax.sgd`` (momentum 0.9, or none after DGC, which applies momentum itself, and after EF-SignSGD;
nothing after 1-bit Adam, an optimizer; local SGD and DiLoCo around it: ``Compressor.optimizer``) —
over a mesh of W simulated CPU devices (``--devices``,
default 8), run as the main job runs it (not donating its inputs on CPU devices, where XLA:CPU's
all-reduce crashes on a donated step: ``training_step.make_step``). Compressors
compress from the first step (``start_iter=0``). The steps of all compressors run round-robin on the
same batch, each one blocked on; the ratio is the median over rounds of time(compressor) /
time(allreduce) in the same round. ``--compressors all`` runs every registry entry; for local SGD
and DiLoCo, which communicate once every H steps, the median is that of their local steps (a sync
step is one round in H).

On XLA:CPU the W "devices" share the host's cores and a collective is a memory copy (and a barrier
of W threads), so this measures the compute a compressor adds to a step, not what it saves on a
network (see ``network_model.py``).

``chars-768x2`` is a ResNet-18-sized model with GPT-2 small's layer shapes: the chars transformer
768 wide with 12 heads (GPT-2 small's width), 2 of its 12 blocks, context 128 (14.5M parameters;
``tasks.CHARS_SIZES``). ``--platform gpu --devices 1`` times the step on one GPU (``gpu.sh``);
``--hlo-dir`` saves each step's compiled HLO text there (``gpu_schedule.py`` reads which
collectives XLA scheduled asynchronously), ``--out`` the rows as JSON after each model.

``--loop pmap`` times the step as users write it by hand instead: ``jax.pmap`` of loss, gradient,
``tx.update`` and ``optax.apply_updates``, the parameters replicated (stacked W times), nothing
donated; the loop reads each step's loss.

  PYTHONPATH=. python benchmarks/step_time.py [--quick] [--write] [--models mlp] [--devices 1]
      [--compressors all] [--platform gpu] [--out rows.json] [--hlo-dir DIR] [--loop pmap]
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

MAX_DEVICES = 8
device_setup.simulate_cpu_devices(MAX_DEVICES)  # before JAX starts its backends

import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402

MODELS = ("mlp", "chars", "chars-wide", "chars-768x2")


@dataclasses.dataclass(frozen=True)
class MLPTask:
  """The step-time goals' MLP on random data, with the interface of ``jaxcomp.train.tasks.Task``
  that ``training_step.make_step`` and this script use."""
  sizes: tuple = (784, 1024, 1024, 1024, 10)

  def init(self, seed: int):
    rng = np.random.default_rng(seed)
    return {f"dense{i}": {"kernel": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                          "bias": np.zeros((b,), np.float32)}
            for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:]))}

  def loss(self, params, inputs, targets):
    h = inputs
    for i in range(len(self.sizes) - 1):
      layer = params[f"dense{i}"]
      h = h @ layer["kernel"] + layer["bias"]
      h = jax.nn.relu(h) if i < len(self.sizes) - 2 else h
    return optax.softmax_cross_entropy_with_integer_labels(h, targets).mean()

  def batch(self, seed: int, step: int, size: int):
    rng = np.random.default_rng([seed, step])
    return (rng.standard_normal((size, self.sizes[0])).astype(np.float32),
            rng.integers(0, self.sizes[-1], size).astype(np.int32))


def model_tasks(quick: bool, names) -> dict:
  """``{label: (task, global batch for W devices as a function of W)}``."""
  from jaxcomp.train import tasks
  out = {}
  for name in names:
    if name == "mlp":
      task = MLPTask((784, 64, 10)) if quick else MLPTask()
      out["MLP 784-1024×3-10" if not quick else "MLP (quick)"] = (task, lambda w: 64 * w)
    elif name == "chars":
      out["chars transformer" if not quick else "chars (quick)"] = (tasks.chars(quick=quick),
                                                                   lambda w: 64)
    elif name == "chars-wide" and not quick:
      wide = dataclasses.replace(tasks.chars(), model=tasks.CharTransformer(context=64, width=256,
                                                                            depth=4))
      out["chars transformer, width 256, depth 4"] = (wide, lambda w: 64)
    elif name == "chars-768x2":
      label = "chars transformer 768 wide, 2 blocks" if not quick else "chars-768x2 (quick)"
      out[label] = (tasks.chars(quick=quick, size="768x2"), lambda w: 64)
  return out


def make_steps(task, compressor_list, devices, wrap_inner=lambda inner: inner) -> dict:
  """The training step (``training_step.Step``) of each compressor over ``devices``, with
  ``optax.sgd`` (through ``wrap_inner``) as its optimizer."""
  from jaxcomp.train import training_step
  mesh = training_step.make_mesh(devices)
  steps = {}
  for c in compressor_list:
    inner = c.plainest_inner(getattr(task, "learning_rate", 0.01), momentum=c.sgd_momentum)
    steps[c.name] = training_step.make_step(task, c.optimizer(wrap_inner(inner), common.AXIS),
                                            mesh)
  return steps


def step_runners(task, compressor_list, batch, devices, hlo=None, params=None):
  """A function per compressor running one blocked training step on ``batch`` from ``params``
  (default ``task.init(0)``); ``hlo(name, text)``, if given, receives each step's compiled HLO text
  (compiled ahead of the first call, which reuses the executable)."""
  runners = {}
  params = task.init(0) if params is None else params  # once: a Flax init runs op by op
  for name, step in make_steps(task, compressor_list, devices).items():
    inputs, targets = step.dp.shard(batch)
    holder = list(step.start(params))
    if hlo is not None:
      hlo(name, step.run.lower(holder[0], holder[1], inputs, targets).compile().as_text())

    def run(step=step, holder=holder, inputs=inputs, targets=targets):
      holder[0], holder[1], loss = step.run(holder[0], holder[1], inputs, targets)
      jax.block_until_ready((holder, loss))  # XLA:CPU needs every multi-device step blocked on
    runners[name] = run
  return runners


def pmap_runners(task, compressor_list, batch, devices, params=None):
  """``step_runners``' functions for the plain ``jax.pmap`` loop (``--loop pmap``): each runs one
  step of ``jax.pmap(step)`` and reads its loss, nothing donated."""
  import optax  # noqa: PLC0415
  params = task.init(0) if params is None else params
  world = len(devices)
  stacked = jax.tree.map(lambda x: np.stack([x] * world), params)
  inputs, targets = (np.reshape(x, (world, -1) + np.shape(x)[1:]) for x in batch)
  runners = {}
  for c in compressor_list:
    inner = optax.sgd(getattr(task, "learning_rate", 0.01), momentum=c.sgd_momentum)
    tx = c.optimizer(inner, common.AXIS)

    def step(params, opt_state, inputs, targets, tx=tx):
      loss, grads = jax.value_and_grad(task.loss)(params, inputs, targets)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    run_step = jax.pmap(step, axis_name=common.AXIS, devices=devices)
    holder = [stacked, jax.pmap(tx.init, axis_name=common.AXIS, devices=devices)(stacked)]

    def run(run_step=run_step, holder=holder):
      holder[0], holder[1], loss = run_step(holder[0], holder[1], inputs, targets)
      np.asarray(loss)  # read every step: XLA:CPU needs every multi-device step blocked on
    runners[c.name] = run
  return runners


def save_hlo(folder: str, model: str, count: int, name: str, text: str) -> None:
  """Saves a step's compiled HLO text as ``folder/<model>__W<count>__<name>.hlo``, whole (written
  under another name, then renamed: ``gpu.sh`` reads the folder while it fills)."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"{model}__W{count}__{name}.hlo")
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 40, quick 2)")
  p.add_argument("--models", default=None,
                 help=f"comma-separated models, from {', '.join(MODELS)} (default: all; quick: "
                      "the first only)")
  common.add_device_options(p, str(MAX_DEVICES))
  p.add_argument("--hlo-dir", default=None,
                 help="save each step's compiled HLO text in this folder (<model>__<entry>.hlo)")
  p.add_argument("--loop", choices=("data_parallel", "pmap"), default="data_parallel",
                 help="the main job's jaxcomp.data_parallel step (default), or a plain jax.pmap "
                      "loop without donation, as users write it")
  common.add_variant_option(p)
  args = common.parse(p, argv)
  repeats = args.repeats or (2 if args.quick else 40)
  models = [m.strip() for m in (args.models or ",".join(MODELS)).split(",") if m.strip()]
  if args.quick and not args.models:
    models = models[:1]
  counts = [int(d) for d in args.devices.split(",")]
  if set(models) - set(MODELS) or not all(1 <= d <= MAX_DEVICES for d in counts):
    p.error(f"--models takes {', '.join(MODELS)}; --devices 1 to {MAX_DEVICES}")
  compressor_list = common.compressors(args.compressors, args.variant)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  header = ["model", "compressor", "settings", "step ms", "step / allreduce", "W", "global batch"]
  rows, keys = [], []
  for count in counts:
    devices = common.devices(count, args.platform)
    for key, (model, (task, batch_size)) in [(m, t) for m in models
                                             for t in model_tasks(args.quick, [m]).items()]:
      params = task.init(0)
      n = sum(np.size(x) for x in jax.tree.leaves(params))
      size = batch_size(count)
      hlo = functools.partial(save_hlo, args.hlo_dir, key, count) if args.hlo_dir else None
      batch = task.batch(0, 0, size)
      runners = (pmap_runners(task, compressor_list, batch, devices, params)
                 if args.loop == "pmap" else
                 step_runners(task, compressor_list, batch, devices, hlo, params))
      times = common.interleaved(runners, repeats, warmup=2)
      for c in compressor_list:
        rows.append([f"{model} ({n:,} params)", c.name, c.about,
                     f"{1e3 * common.median(times[c.name]):.1f}",
                     f"{common.ratio(times, c.name, 'allreduce'):.2f}", f"{count}", f"{size}"])
        keys.append(key)
        print(f"  {model} W={count} {c.name}: {rows[-1][4]}", file=sys.stderr, flush=True)
      del runners
      common.write_out(args.out, "step_time.py", args.argv, header, rows, False, keys=keys,
                       repeats=repeats, platform=devices[0].platform)
  common.write_out(args.out, "step_time.py", args.argv, header, rows, True, keys=keys,
                   repeats=repeats, platform=devices[0].platform)
  table = common.markdown_table(header, rows, "lllrrrr")
  where = ("W simulated devices" if devices[0].platform == "cpu" else
           f"W {devices[0].platform.upper()} devices ({devices[0].device_kind})")
  how = ("a plain `jax.pmap` loop, nothing donated, as users write it" if args.loop == "pmap"
         else "`jaxcomp.data_parallel`, as the main job runs it: on CPU devices without donation")
  body = (f"{where} ({how}); median of {repeats} interleaved per-round ratios. "
          + ("The ms column is for scale only: the devices share the machine's cores."
             if devices[0].platform == "cpu" else "")
          + (" Local SGD and DiLoCo communicate once every H steps: their figure is the median "
             "step, a local one." if any(c.wraps_optimizer for c in compressor_list) else "")
          + "\n\n" + table)
  common.emit(args, "step_time", "Training step time against allreduce", "step_time.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
