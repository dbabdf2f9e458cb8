"""Memory per compressor: state bytes and peak temporaries, as multiples of the gradient size.

For ResNet-18, ResNet-50 and GPT-2 small shaped gradients (shapes only), each compressor's
``update`` is compiled under ``jax.pmap`` over W = 8 simulated devices with the gradient and the
state donated, as in a training step, where the gradient is dead once the update has it and the new
state may reuse the old one's buffers (the update alone, not a ``jaxcomp.data_parallel`` step: a
model's forward and backward passes would add their temporaries to every compressor's and hide
them). (Donating the state alone misleads: JAX pairs donated inputs with outputs of the same shape
in output order, so the update — the first output — would take the error's or the momentum's buffer,
and XLA would copy the state before overwriting it.) Per device:

* state: the bytes of the compressor's state (``jax.eval_shape`` of ``init``);
* temporaries: ``temp_size_in_bytes`` of the compiled program's memory analysis — the peak of the
  buffers XLA allocates besides arguments and outputs;
* extra: state + temporaries − allreduce's temporaries, the memory a compressor costs over the plain
  mean (its gradient input and averaged output are the same as allreduce's).

``--compressors all`` measures every registry entry. Local SGD and DiLoCo wrap the optimizer: their
update (around plain SGD) holds the local step and the sync step in one program, and their state
holds the parameters they average (state / grad ≥ 1 by design).

All three are divided by the gradient's size (4 bytes per element). The state of each compressor
here is the state its algorithm must keep (PowerSGD's error, DGC's u and v), so the project's goal,
state beyond that plus temporaries ≤ 1× the gradient, reads as temp / grad ≤ 1.

A second table shows the optimizer state per device with and without sharding it
(``jaxcomp.sharded_optimizer``, ZeRO-1/2): AdamW after each exchange (int8: ``quantized(8)``, its
reduce-scatter an all-to-all of codes, ZeRO++'s qgZ; an int8 gather, qwZ), the whole update
(exchange, optimizer, gather) compiled the same way. ``opt state`` is the optimizer's state per
device (AdamW's moments and count), ``bound`` the unsharded state ÷ W plus one padding value per
leaf and state array (the goal: opt state ≤ bound), ``exchange state`` the compressor's
own (8-bit error feedback), and ``ring B vs f32`` the bytes each device sends per step against a
float32 all-reduce of the gradient (the requested dtypes, before XLA:CPU widens bfloat16). A lossy
gather's float32 master of the device's shard is shown apart (``master``): it is the price of
keeping the parameters exact while the gathered copy is rounded.

``--models mlp,resnet18`` picks the shape pytrees (``common.SHAPE_MODELS``), ``--platform gpu
--devices 1`` compiles for one GPU (``gpu.sh``), ``--no-sharded`` leaves out the second table and
``--out`` writes the first one's rows as JSON.

  PYTHONPATH=. python benchmarks/memory.py [--quick] [--write] [--compressors all]
      [--models mlp,resnet18] [--platform gpu] [--devices 1] [--no-sharded] [--out rows.json]
"""

from __future__ import annotations

import gc
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

W = 8
device_setup.simulate_cpu_devices(W)  # before JAX starts its backends

from benchmarks import common  # noqa: E402


def nbytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def transformation(compressor):
  """What ``measure`` compiles: the entry's transformation; local SGD and DiLoCo (which wrap the
  optimizer) around plain SGD, whose state is empty (DES-LOC around Adam: ``plainest_inner``)."""
  if compressor.wraps_optimizer:
    return compressor.optimizer(compressor.plainest_inner(0.01), common.AXIS)
  return compressor.make(common.AXIS)


def measure(compressor, tree, devices=None) -> tuple:
  """``(state bytes, temporary bytes)`` per device of one update on ``devices`` (default: the first
  W devices), gradient and state donated (the parameters, which the wrappers of the optimizer read,
  are not)."""
  devices = devices or jax.devices()[:W]
  tx = transformation(compressor)
  state = jax.eval_shape(tx.init, tree)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS,
                  devices=devices, donate_argnums=(0, 1))
  params = common.stacked(tree, len(devices))
  compiled = step.lower(params, common.stacked(state, len(devices)), params).compile()
  temporaries = compiled.memory_analysis().temp_size_in_bytes
  del compiled
  release()
  return nbytes(state), temporaries


def release() -> None:
  """Frees the code of the programs no longer referenced: each holds memory mappings of its own,
  and the dozens of programs of ``--compressors all`` otherwise exhaust the process's
  (``vm.max_map_count``; LLVM then fails with "Unable to allocate section memory")."""
  jax.clear_caches()
  gc.collect()


# (name, exchange factory, gather dtype or None for the unsharded chain, "" for an exact gather)
SHARDED = (("allreduce, unsharded", "allreduce", None),
           ("allreduce, sharded", "allreduce", ""),
           ("bf16 + bf16 gather, sharded", "bf16", "bfloat16"),
           ("int8 + bf16 gather, sharded", "quantized_int8", "bfloat16"),
           ("int8 + int8 gather, sharded", "quantized_int8", "int8"))


def _per_device(tree) -> int:
  """Bytes per device of a state whose leaves are stacked over W devices (pmap's layout)."""
  return nbytes(tree) // W


def measure_sharded(exchange, gather, tree) -> tuple:
  """``(optimizer state, master, exchange state, temporaries, ring bytes)`` per device of one AdamW
  update after ``exchange`` on W devices, sharded unless ``gather`` is None; gradient and state
  donated."""
  import optax  # noqa: PLC0415
  import jaxcomp  # noqa: PLC0415
  from jaxcomp._src import report  # noqa: PLC0415
  adamw = optax.adamw(1e-3, weight_decay=0.01)
  if gather is None:
    tx = optax.chain(exchange.make(common.AXIS), adamw)
    parts = lambda s: (s[1], (), s[0])  # noqa: E731
  else:
    tx = jaxcomp.sharded_optimizer(exchange.make(common.AXIS), adamw, gather_dtype=gather or None,
                                   axis_name=common.AXIS)
    parts = lambda s: (s.inner, s.master, s.exchange)  # noqa: E731
  devices = jax.devices("cpu")[:W]  # simulated CPU devices, whatever the default backend
  params = common.stacked(tree, W)
  state = jax.eval_shape(jax.pmap(tx.init, axis_name=common.AXIS, devices=devices), params)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS, devices=devices,
                  donate_argnums=(0, 1))
  lowered = step.lower(params, state, params)
  ring = report.parse_hlo(lowered.as_text(dialect="hlo", debug_info=True), W).ring_bytes
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  release()
  return (*(nbytes(part) // W for part in parts(state)), temp, ring)


def sharded_table(models: dict) -> str:
  """The second table: optimizer state per device, unsharded and sharded."""
  registry = {c.name: c for c in common.compressors(",".join({n for _, n, _ in SHARDED}))}
  rows = []
  for model, tree in models.items():
    grad = nbytes(tree)
    allreduce_ring = 2 * (W - 1) / W * grad
    bound = None
    for name, exchange, gather in SHARDED:
      opt, master, exchange_state, temp, ring = measure_sharded(registry[exchange], gather, tree)
      if bound is None:  # the unsharded moments ÷ W, + one padding value per leaf in mu and nu
        unsharded, bound = opt, opt // W + 2 * 4 * len(jax.tree.leaves(tree))
      rows.append([model, name, f"{opt:,}", f"{opt / unsharded:.4f}",
                   "" if gather is None else f"{bound:,} ({'met' if opt <= bound else 'MISSED'})",
                   common.human(master), common.human(exchange_state), f"{temp / grad:.2f}",
                   f"{ring / allreduce_ring:.4f}"])
      print(f"  {model} {name}: opt state {rows[-1][3]}× unsharded", file=sys.stderr, flush=True)
  return common.markdown_table(
      ["model", "AdamW after", "opt state B", "÷ unsharded", "bound B", "master", "exchange state",
       "temp / grad", "ring B vs f32"], rows, "llrrrrrrr")


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--models", default=None,
                 help=f"comma-separated shape pytrees, from {', '.join(common.SHAPE_MODELS)} "
                      "(default: ResNet-18, ResNet-50, GPT-2 small)")
  p.add_argument("--no-sharded", action="store_true",
                 help="leave out the second table (the sharded optimizer's state, W = 8)")
  common.add_device_options(p, str(W))
  common.add_variant_option(p)
  args = common.parse(p, argv)
  devices = common.devices(int(args.devices), args.platform)
  compressor_list = common.compressors(args.compressors, args.variant)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  header = ["model", "compressor", "state", "temporaries", "state / grad", "temp / grad",
            "extra / grad"]
  rows, keys = [], []
  models = common.shape_models(args.models, args.quick)
  names = args.models.split(",") if args.models else list(models)
  for key, (model, tree) in zip(names, models.items()):
    grad = nbytes(tree)
    base = None
    for c in compressor_list:
      state, temp = measure(c, tree, devices)
      base = temp if base is None else base
      rows.append([model, c.name, common.human(state), common.human(temp),
                   f"{state / grad:.2f}", f"{temp / grad:.2f}",
                   f"{(state + temp - base) / grad:.2f}"])
      keys.append(key.strip())
      print(f"  {model} {c.name}: extra {rows[-1][-1]}× the gradient", file=sys.stderr, flush=True)
      common.write_out(args.out, "memory.py", args.argv, header, rows, False, keys=keys,
                       platform=devices[0].platform)
  common.write_out(args.out, "memory.py", args.argv, header, rows, True, keys=keys,
                   platform=devices[0].platform)
  table = common.markdown_table(header, rows, "llrrrrr")
  where = "" if devices[0].platform == "cpu" else f" {devices[0].device_kind},"
  body = (f"Per device, W = {len(devices)}{where} (`jax.pmap`, gradient and state donated); "
          "grad = 4 bytes per element. extra = state + temporaries − allreduce's temporaries. "
          "Goal: state beyond the algorithm's plus temporaries ≤ 1, i.e. temp / grad ≤ 1.\n\n"
          + table)
  if not args.no_sharded:
    body += (f"\n\nOptimizer state per device, W = {W}, AdamW (goal: sharded ≤ bound = "
             "unsharded ÷ W + one padding value per leaf in each moment):\n\n"
             + sharded_table(common.shape_models(args.models, args.quick)))
  common.emit(args, "memory", "Memory: state and peak temporaries", "memory.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
