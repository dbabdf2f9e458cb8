"""Fully sharded (ZeRO-3 / FSDP, ``jaxcomp.fully_sharded``) against DDP and ZeRO-1/2 on an MLP.

``step_time.py``'s MLP (784-1024×3-10, 2,913,290 parameters; ``--quick``: 784-256×3-10), Adam,
W = 8 simulated CPU devices, global batch 64. For each way to train, per device:

* memory: the parameters' and the optimizer state's bytes (the state's arrays as each device
  holds them: a stacked per-device leaf's one entry, a replicated leaf whole), and the exchange's
  state (error feedback) apart;
* bytes per step: ``jaxcomp.comm_report``'s payload (stage "lowered": the program as requested) and
  the ring bytes each device sends, and the payload against FSDP with bfloat16 both ways (a
  bfloat16 all-gather and a bfloat16 reduce-scatter of every parameter);
* temporaries: the compiled FSDP step's ``temp_size_in_bytes`` (the peak of what it allocates
  besides its inputs and outputs) as the loss gathers every layer at its start, a layer at a time,
  a layer at a time under ``jax.checkpoint``, or a layer at a time through ``call_layer``;
* step time (not with ``--no-time``): every step timed side by side, round-robin
  (``common.interleaved``), as the median over rounds of its time ÷ DDP's (allreduce) time.

``--quality STEPS`` instead trains the main job's transformer (``jaxcomp.train.tasks.chars``,
120,704 parameters; its recipe: clip the global norm to 1, SGD with momentum 0.9, global batch 32,
W = 8) unsharded (``optax.chain(jaxcomp.allreduce(), ...)``) and fully sharded
(``sharded_clip_by_global_norm``) — exactly, int8 both ways (with and without error feedback),
and each int8 half alone — its Linen model unchanged: the loss gathers every layer at its start
(``task.loss(jaxcomp.gather_layer(params), ...)``), so the numbers are FSDP's, not its memory per
layer. For each seed (``--seeds N``: 0 to N − 1, the initialisation and the batches) it prints the
held-out loss as the main job reports it (the mean of the last 5 of 30 evaluations) and its
difference from the unsharded run's of the same seed.

  PYTHONPATH=. python benchmarks/fsdp.py [--quick] [--rounds N] [--no-time]
  PYTHONPATH=. python benchmarks/fsdp.py --quality 400 [--seeds N]
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

W = 8
device_setup.simulate_cpu_devices(W)  # before JAX starts its backends

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcomp  # noqa: E402
from benchmarks import common  # noqa: E402
from jaxcomp._src.sharding import per_device_mask  # noqa: E402
from jaxcomp.train.runs import WINDOW  # noqa: E402
from jaxcomp.train.training_loop import EVALUATIONS  # noqa: E402

BATCH = 64


def loss_fn(params, x, y, remat=False, at_start=False, called=False):
  """The MLP, a layer gathered at a time (``gather_layer`` passes unsharded parameters through);
  each layer under ``jax.checkpoint`` (``remat``), through ``call_layer`` (``called``), or every
  layer gathered at the start."""
  params = jaxcomp.gather_layer(params) if at_start else params
  names = sorted(params, key=lambda n: int(n[5:]))

  def compute(layer, x, last):
    x = x @ layer["kernel"] + layer["bias"]
    return x if last else jax.nn.relu(x)

  def dense(layer, x, last):
    if called:
      return jaxcomp.call_layer(lambda whole, x: compute(whole, x, last), layer, x)
    return compute(jaxcomp.gather_layer(layer), x, last)

  dense = jax.checkpoint(dense, static_argnums=2) if remat else dense
  for name in names:
    x = dense(params[name], x, name == names[-1])
  return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def temporaries(mesh, params, batch) -> str:
  """The compiled FSDP step's temporaries per device (exact exchange and gather) as the loss
  gathers: every layer at its start, a layer at a time, a layer at a time under jax.checkpoint."""
  rows = []
  for name, kwargs in (("every layer at the start", dict(at_start=True)),
                       ("a layer at a time", {}),
                       ("a layer at a time, jax.checkpoint", dict(remat=True)),
                       ("a layer at a time, call_layer", dict(called=True))):
    fs = jaxcomp.fully_sharded(lambda p, x, y, kwargs=kwargs: loss_fn(p, x, y, **kwargs), mesh,
                               jaxcomp.allreduce(), optax.adam(1e-3))
    compiled = fs.step.lower(fs.make_state(params), *fs.shard(batch)).compile()
    rows.append([name, common.human(compiled.memory_analysis().temp_size_in_bytes)])
  largest = max(sum(x.size * 4 for x in jax.tree.leaves(layer)) for layer in params.values())
  return (f"largest layer, whole: {common.human(largest)}; all parameters: "
          f"{common.human(4 * common.num_params(params))}\n\n"
          + common.markdown_table(["FSDP exact, the loss gathers", "temporaries / device"], rows))


def nbytes(tree, mask) -> int:
  """Bytes of ``tree`` on one device: a per-device leaf (``mask``) is stacked, one entry each."""
  return sum((math.prod(x.shape[1:]) if m else x.size) * x.dtype.itemsize
             for x, m in zip(jax.tree.leaves(tree), jax.tree.leaves(mask)))


def ways(mesh):
  """name: (build, kind); build() -> (step, state_args, memory) for each way to train."""
  adam = lambda: optax.adam(1e-3)  # noqa: E731

  def ddp(tx):
    def build(params):
      dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
      opt_state = dp.make_state(params)
      mask = per_device_mask(opt_state)  # a chain's (exchange, inner), or a sharded state
      pick = lambda t, field, i: getattr(t, field) if hasattr(t, field) else t[i]  # noqa: E731
      memory = (nbytes(params, jax.tree.map(lambda _: False, params)),
                nbytes(pick(opt_state, "inner", 1), pick(mask, "inner", 1)),
                nbytes(pick(opt_state, "exchange", 0), pick(mask, "exchange", 0)))
      return dp.step, (params, opt_state), dp.shard, memory
    return build

  def fsdp(exchange, gather_dtype, called=False):
    def build(params):
      fs = jaxcomp.fully_sharded(lambda p, x, y: loss_fn(p, x, y, called=called), mesh,
                                 exchange(), adam(), gather_dtype=gather_dtype)
      state = fs.make_state(params)
      every = lambda t: jax.tree.map(lambda _: True, t)  # noqa: E731
      memory = (nbytes(state.params, every(state.params)), nbytes(state.inner, every(state.inner)),
                nbytes(state.exchange, every(state.exchange)))
      return fs.step, (state,), fs.shard, memory
    return build

  return {
      "DDP allreduce": ddp(optax.chain(jaxcomp.allreduce(), adam())),
      "ZeRO-1/2 exact": ddp(jaxcomp.sharded_optimizer(jaxcomp.allreduce(), adam())),
      "ZeRO-1/2 bf16 both ways": ddp(jaxcomp.sharded_optimizer(
          jaxcomp.bf16_compress(), adam(), gather_dtype="bfloat16")),
      "ZeRO-1/2 int8 both ways": ddp(jaxcomp.sharded_optimizer(
          jaxcomp.quantized(8), adam(), gather_dtype="int8")),
      # The int8 ways taken apart: which half costs the time.
      "ZeRO-1/2 int8 scatter only": ddp(jaxcomp.sharded_optimizer(jaxcomp.quantized(8), adam())),
      "ZeRO-1/2 int8 scatter only, no error feedback": ddp(jaxcomp.sharded_optimizer(
          jaxcomp.quantized(8, error_feedback=False), adam())),
      "ZeRO-1/2 int8 gather only": ddp(jaxcomp.sharded_optimizer(
          jaxcomp.allreduce(), adam(), gather_dtype="int8")),
      "FSDP exact": fsdp(jaxcomp.allreduce, None),
      "FSDP bf16 both ways": fsdp(jaxcomp.bf16_compress, "bfloat16"),
      "FSDP int8 both ways": fsdp(lambda: jaxcomp.quantized(8), "int8"),
      "FSDP fp8 gather, int8 scatter": fsdp(lambda: jaxcomp.quantized(8), "float8_e4m3fn"),
      "FSDP int8 both ways, no error feedback": fsdp(
          lambda: jaxcomp.quantized(8, error_feedback=False), "int8"),
      "FSDP exact, call_layer": fsdp(jaxcomp.allreduce, None, called=True),
      "FSDP int8 both ways, call_layer": fsdp(lambda: jaxcomp.quantized(8), "int8", called=True),
  }


def quality(steps: int, seeds: int) -> str:
  """The held-out losses of ``--quality``'s runs (the module docstring)."""
  from jaxcomp.train import tasks  # noqa: PLC0415 (Flax: only for this mode)
  task = tasks.chars()
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  sgd = lambda: optax.sgd(task.learning_rate, momentum=0.9)  # noqa: E731
  every = max(steps // EVALUATIONS, 1)
  loss_fn = lambda p, x, y: task.loss(jaxcomp.gather_layer(p), x, y)  # noqa: E731

  def unsharded():
    dp = jaxcomp.data_parallel(task.loss, mesh, tx=optax.chain(
        jaxcomp.allreduce(), optax.clip_by_global_norm(1.0), sgd()))
    step = lambda state, batch: common.block(dp.step(*state, *dp.shard(batch)))[:2]  # noqa: E731
    return lambda params: (params, dp.make_state(params)), step, lambda state: state[0]

  def sharded(exchange, gather_dtype):
    fs = jaxcomp.fully_sharded(loss_fn, mesh, exchange, optax.chain(
        jaxcomp.sharded_clip_by_global_norm(1.0), sgd()), gather_dtype=gather_dtype)
    step = lambda state, batch: common.block(fs.step(state, *fs.shard(batch)))[0]  # noqa: E731
    return fs.make_state, step, fs.gather_params

  runs = {"allreduce, unsharded": unsharded(),  # (make_state, step, params_of) of each run
          "FSDP exact": sharded(jaxcomp.allreduce(), None),
          "FSDP int8 both ways": sharded(jaxcomp.quantized(8), "int8"),
          "FSDP int8 gather only": sharded(jaxcomp.allreduce(), "int8"),
          "FSDP int8 scatter only": sharded(jaxcomp.quantized(8), None),
          "FSDP int8 both ways, no error feedback": sharded(
              jaxcomp.quantized(8, error_feedback=False), "int8")}
  losses = {name: [] for name in runs}  # per run, the held-out loss of each seed
  for seed in range(seeds):
    for name, (make_state, step, params_of) in runs.items():
      state, evaluations = make_state(task.init(seed)), []
      for t in range(1, steps + 1):
        state = step(state, task.batch(seed, t - 1, 32))
        if t % every == 0:
          evaluations.append(task.evaluate(params_of(state))[0])
      losses[name].append(float(np.mean(evaluations[-WINDOW:])))
      print(f"  seed {seed}, {name}: {losses[name][-1]:.4f}", file=sys.stderr, flush=True)
  reference = np.array(losses["allreduce, unsharded"])
  rows = []
  for name, held_out in losses.items():
    change = (np.array(held_out) / reference - 1) * 100
    rows.append([name, " ".join(f"{x:.4f}" for x in held_out), f"{np.mean(held_out):.4f}",
                 "" if name == "allreduce, unsharded" else
                 " ".join(f"{x:+.2f}%" for x in change) + f" (mean {np.mean(change):+.2f}%)"])
  return common.markdown_table(
      [f"run ({steps} steps)", f"held-out loss, seeds 0–{seeds - 1}", "mean",
       "vs unsharded, same seed"], rows)


def main(argv=None) -> None:
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=10, help="timing rounds (default 10)")
  p.add_argument("--no-time", action="store_true", help="memory and bytes only")
  p.add_argument("--quality", type=int, default=None, metavar="STEPS",
                 help="train the main job's transformer STEPS steps instead (held-out loss)")
  p.add_argument("--seeds", type=int, default=1,
                 help="with --quality: seeds 0 to N-1 (initialisation and batches; default 1)")
  args = common.parse(p, argv)
  if args.write or args.compressors:
    p.error("--write and --compressors do not apply: fsdp.py prints its tables, and "
            "BENCHMARKS.md's section quotes them with the command")
  if args.quality is not None:
    print(f"command: {common.command('fsdp.py', argv)}")
    print(quality(args.quality, args.seeds))
    return
  sizes = (784, 256, 256, 256, 10) if args.quick else (784, 1024, 1024, 1024, 10)
  params = common.random_like(common.mlp(sizes))
  params = jax.tree.map(lambda x: (x * 0.05).astype(jnp.float32), params)
  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(BATCH, sizes[0])).astype(np.float32),
           rng.integers(0, sizes[-1], size=BATCH).astype(np.int32))
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  n = common.num_params(params)
  print(f"MLP {'-'.join(map(str, sizes))}, {n:,} parameters, Adam, W = {W}, global batch {BATCH}; "
        f"{common.machine()}")
  print(f"command: {common.command('fsdp.py', argv)}")
  rows, steps = [], {}
  built = {name: build(params) for name, build in ways(mesh).items()}
  reports = {name: jaxcomp.comm_report(step, *state, *shard(batch), stage="lowered")
             for name, (step, state, shard, _) in built.items()}
  base = reports["FSDP bf16 both ways"].payload_bytes
  for name, (step, state, shard, (p_bytes, o_bytes, e_bytes)) in built.items():
    r = reports[name]
    rows.append([name, common.human(p_bytes), common.human(o_bytes), common.human(e_bytes),
                 f"{(p_bytes + o_bytes) / (3 * 4 * n):.4f}", common.human(r.payload_bytes),
                 common.human(r.ring_bytes), f"{r.payload_bytes / base:.3f}"])
    sharded_batch = shard(batch)

    def run(step=step, state=state, sharded_batch=sharded_batch):
      return common.block(step(*state, *sharded_batch))
    steps[name] = run
  header = ["way", "params / device", "Adam state / device", "exchange state / device",
            "(params + Adam) vs DDP", "payload / step", "ring / step", "payload vs FSDP bf16"]
  if not args.no_time:
    times = common.interleaved(steps, args.rounds, warmup=2)
    header.append("step vs DDP")
    for row in rows:
      row.append(f"{common.ratio(times, row[0], 'DDP allreduce'):.2f}")
    print(f"DDP allreduce step: {common.median(times['DDP allreduce']) * 1e3:.1f} ms "
          f"(median of {args.rounds} rounds)")
  print(common.markdown_table(header, rows))
  print()
  print(temporaries(mesh, params, batch))


if __name__ == "__main__":
  main()
