"""The backend workarounds of ``jaxcomp._src.kernels`` for the compressed exchanges, PowerSGD and
the non-finite policy, and the float16 sum over devices of ``jaxcomp._src.axis`` (``sum_in_rows``),
each against the obvious form it replaces.

Each row compiles a compressor's update twice, once as it is and once with the kernel swapped for
its obvious form (``OBVIOUS``), and runs the two round-robin: the MLP gradient of
``step_time.py`` (784-1024×3-10, 2,913,290 parameters; ``--quick``: a tiny pytree), W = 8
simulated devices, ``jax.pmap``, the gradient and the state donated as in a training step. Reported:
the median update time of each (for scale: the devices share the machine's cores), the median of the
per-round ratios obvious / kernel, the temporaries of each compiled update per gradient
(``memory.py``'s measure), and whether the outputs are bit-identical after the last round. (The DGC
kernels have their own measurement: ``dgc_selection.py --kernels``.)

``--platform gpu --devices 1`` runs the same rows on one GPU (``gpu.sh``; where a kernel is
XLA:CPU's alone, ``lax.platform_dependent`` picks the obvious form there, and both columns run the
same program); ``--out`` writes the rows as JSON.

  PYTHONPATH=. python benchmarks/kernels.py [--quick] [--write] [--repeats N] [--compressors ...]
      [--platform gpu] [--devices 1] [--out rows.json]
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

W = 8
device_setup.simulate_cpu_devices(W)  # before JAX starts its backends

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp._src import axis, kernels  # noqa: E402
from jaxcomp._src import tree as tree_lib  # noqa: E402


def _joined_row(arrays, row, owner):
  """``row_update_arrays`` as the flat layout's join of W rows, all zero but the owner's."""
  shapes = [x.shape for x in arrays]
  length = sum(math.prod(s) for s in shapes)
  rows = -(-length // row.shape[0])
  full = jnp.where(jnp.arange(rows)[:, None] == owner, row[None], 0.0)
  return tree_lib.unflatten(full.reshape(-1)[:length], shapes)


def _split_row(arrays, owner, length, rows):
  """``row_of_arrays`` as the flat layout's split of the arrays into rows, then row ``owner``."""
  flat = tree_lib.flatten(list(arrays))
  split = jnp.pad(flat, (0, rows * length - flat.size)).reshape(rows, length)
  return lax.dynamic_index_in_dim(split, owner, keepdims=False)


def _all_reduce(x, axis_name):
  """``axis.sum_in_rows`` (float16 sums over devices on XLA:CPU) as the all-reduce it stands for."""
  name = axis.bound_axis(axis_name)
  return x if name is None else lax.psum(x, name)


def _stacked_mean(term, world):
  """``device_mean`` as the mean of the W devices' terms stacked along a new axis."""
  return [jnp.mean(jnp.stack(xs), axis=0) for xs in zip(*[term(w) for w in range(world)])]


def _padded(arrays, size):
  """``zero_padded`` as ``jnp.pad`` of the concatenation."""
  flat = tree_lib.flatten(list(arrays))
  return jnp.pad(flat, (0, size - flat.size))


# label: (replacements of kernels' functions, the registry entries whose update shows them)
OBVIOUS = {
    "where (non-finite policy)": (
        {"where": lambda pred, new, old: jnp.where(pred, new, old)},
        ("quantized_int8", "sign", "onebit_adam")),
    "to/from_float8_e4m3fn": (
        {"to_float8_e4m3fn": lambda y: lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn),
                                                                jnp.uint8),
         "from_float8_e4m3fn": lambda b: lax.bitcast_convert_type(
             b, jnp.float8_e4m3fn).astype(jnp.float32)},
        ("quantized_fp8",)),
    "row_update_arrays": ({"row_update_arrays": _joined_row}, ("quantized_int8", "onebit_adam")),
    "row_of_arrays": ({"row_of_arrays": _split_row}, ("quantized_int8", "onebit_adam")),
    "device_mean": ({"device_mean": _stacked_mean}, ("quantized_int8", "sign")),
    "transposed_product": ({"transposed_product": lambda m, p: sum(jnp.swapaxes(t, -1, -2) @ p
                                                                   for t in m.terms)},
                           ("powersgd_r1", "powersgd_r4")),
    "axis.sum_in_rows (float16 psum)": ({"axis.sum_in_rows": _all_reduce},
                                        ("fp16", "hook_fp16_allreduce")),
    "zero_padded": ({"zero_padded": _padded}, ("batched_powersgd_r1",)),
    "in_place": ({"in_place": lambda update, old, *operands: update(old, *operands)},
                 ("batched_powersgd_r1", "powersgd_r1")),
}


@contextlib.contextmanager
def _patched(replacements: dict):
  """A context in which ``kernels`` holds ``replacements`` (``{name: function}``; ``"axis.name"``:
  ``axis``'s)."""
  with contextlib.ExitStack() as stack:
    for name, fn in replacements.items():
      module, _, attribute = name.rpartition(".")
      stack.enter_context(mock.patch.object(axis if module == "axis" else kernels, attribute, fn))
    yield


class Update:
  """One compiled update of a compressor, its state carried from call to call."""

  def __init__(self, compressor, grads, replacements: dict, devices=None):
    tx = compressor.make(common.AXIS)
    devices = devices or jax.devices()[:W]
    with _patched(replacements):
      step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS,
                      devices=devices, donate_argnums=(0, 1))
      self.state = jax.pmap(tx.init, axis_name=common.AXIS, devices=devices)(grads)
      self.compiled = step.lower(grads, self.state, grads).compile()
    self.grads, self.out = grads, None

  def temporaries(self) -> int:
    return self.compiled.memory_analysis().temp_size_in_bytes

  def __call__(self) -> float:
    """Seconds of one update (the donated gradient's copy made before the clock starts)."""
    grads = jax.block_until_ready(jax.tree.map(jnp.copy, self.grads))
    start = time.perf_counter()
    self.out, self.state = jax.block_until_ready(self.compiled(grads, self.state, self.grads))
    return time.perf_counter() - start


def mlp_gradient(quick: bool, world: int = W) -> dict:
  """``step_time.py``'s MLP (or a tiny pytree) as random float32 gradients stacked over
  ``world``."""
  tree = common.mlp((784, 64, 10) if quick else (784, 1024, 1024, 1024, 10))
  return common.random_like(common.stacked(tree, world))


def compare(compressor, grads, replacements: dict, repeats: int, devices=None) -> list:
  """The cells of one row: ms with the kernel and obvious, the ratio, temporaries, identical."""
  devices = devices or jax.devices()[:W]
  updates = {"kernel": Update(compressor, grads, {}, devices),
             "obvious": Update(compressor, grads, replacements, devices)}
  times = {name: [] for name in updates}
  for r in range(repeats + 1):  # the first round warms up
    for name in (list(updates) if r % 2 else list(updates)[::-1]):
      seconds = updates[name]()
      if r:
        times[name].append(seconds)
  grad = sum(x.size for x in jax.tree.leaves(grads)) // len(devices) * 4
  same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in
             zip(jax.tree.leaves(updates["kernel"].out), jax.tree.leaves(updates["obvious"].out)))
  return [f"{1e3 * common.median(times['kernel']):.1f}",
          f"{1e3 * common.median(times['obvious']):.1f}",
          f"{common.ratio(times, 'obvious', 'kernel'):.2f}",
          f"{updates['kernel'].temporaries() / grad:.2f}",
          f"{updates['obvious'].temporaries() / grad:.2f}", "yes" if same else "no"]


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 10, quick 1)")
  common.add_device_options(p, str(W))
  args = common.parse(p, argv)
  repeats = args.repeats or (1 if args.quick else 10)
  devices = common.devices(int(args.devices), args.platform)
  wanted = {c.name for c in common.compressors(args.compressors)} if args.compressors else None
  grads = mlp_gradient(args.quick, len(devices))
  header = ["kernel", "update of", "kernel ms", "obvious ms", "obvious / kernel", "temp / grad",
            "obvious temp / grad", "same output"]
  rows = []
  for label, (replacements, names) in OBVIOUS.items():
    for c in common.compressors(",".join(names)):
      if wanted is None or c.name in wanted:
        rows.append([label, c.name] + compare(c, grads, replacements, repeats, devices))
        print(f"  {label} {c.name}: obvious / kernel {rows[-1][4]}", file=sys.stderr, flush=True)
        common.write_out(args.out, "kernels.py", args.argv, header, rows, False,
                         repeats=repeats, platform=devices[0].platform)
  common.write_out(args.out, "kernels.py", args.argv, header, rows, True, repeats=repeats,
                   platform=devices[0].platform)
  table = common.markdown_table(header, rows, "llrrrrrl")
  model = "tiny MLP 784-64-10" if args.quick else "MLP 784-1024×3-10"
  cpu = devices[0].platform == "cpu"
  body = (f"Each kernel of `jaxcomp._src.kernels` (and `axis.sum_in_rows`, the float16 sum "
          f"over devices) against the obvious form it replaces, in a "
          f"compressor's update of the {model} gradient (W = {len(devices)}"
          f"{'' if cpu else ' ' + devices[0].device_kind}, `jax.pmap`, gradient and state "
          f"donated); median of {repeats} interleaved rounds."
          + (" The ms columns are for scale only: the devices share the machine's cores."
             if cpu else "") + "\n\n" + table)
  common.emit(args, "kernels", "Kernels against their obvious forms", "kernels.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
