"""One process of a 2-process job (2 CPU devices each, jax.distributed on 127.0.0.1) that trains
with ``jaxcomp.fully_sharded`` over all 4 devices — exactly, and with int8 both ways — and with the
unsharded ``optax.chain`` of the same exchange and optimizer under ``jaxcomp.data_parallel`` for
reference.

Writes to ``--out``: the whole parameters after each run as this process reads them
(``gather_params`` for the sharded runs), and its local shards of the first layer's kernel (one row
per local device, with the device's index along the axis).

    python tests/workers/fully_sharded.py --coordinator 127.0.0.1:PORT --process-id I --out F
"""

from two_processes import join, local_rows

args = join()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxcomp  # noqa: E402

W = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Explicit,))
rng = np.random.default_rng(0)  # the same parameters on every process
start = {"dense0": {"w": rng.normal(size=(5, 7)).astype(np.float32),
                    "b": rng.normal(size=(7,)).astype(np.float32)},
         "dense1": {"w": rng.normal(size=(7, 3)).astype(np.float32)},
         "scale": np.float32(0.5)}  # 0-d: replicated


def loss_fn(params, x, y):
  first = jaxcomp.gather_layer(params["dense0"])
  h = jnp.tanh(x @ first["w"] + first["b"])
  scale = jaxcomp.gather_layer(params["scale"])  # replicated: as it is
  return jnp.mean((h @ jaxcomp.gather_layer(params["dense1"])["w"] * scale - y) ** 2)


data = np.random.default_rng(7)
batches = [(data.normal(size=(4 * W, 5)).astype(np.float32),
            data.normal(size=(4 * W, 3)).astype(np.float32)) for _ in range(3)]
local = jax.local_device_count()
mine = slice(jax.process_index() * 4 * local, (jax.process_index() + 1) * 4 * local)


def whole(tree, name, results):
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    results[f"{name}/params/{key}"] = np.asarray(leaf.addressable_shards[0].data)


results = {}
dp = jaxcomp.data_parallel(loss_fn, mesh, tx=optax.chain(jaxcomp.allreduce(), optax.adamw(0.05)))
params, opt_state = dp.make_params(start), dp.make_state(start)
for x, y in batches:  # each process passes its own part of the batch
  params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x[mine], y[mine])))
  jax.block_until_ready(loss)
whole(params, "unsharded", results)
for name, exchange, gather_dtype in (("exact", jaxcomp.allreduce(), None),
                                     ("int8", jaxcomp.quantized(8), "int8")):
  fs = jaxcomp.fully_sharded(loss_fn, mesh, exchange, optax.adamw(0.05), gather_dtype=gather_dtype)
  state = fs.make_state(start)
  for x, y in batches:
    state, loss = fs.step(state, *fs.shard((x[mine], y[mine])))
    jax.block_until_ready(loss)
  whole(fs.gather_params(state), name, results)
  results[f"{name}/shards/dense0/w"] = local_rows(state.params["dense0"]["w"])
  results["device_index"] = np.array([mesh.devices.tolist().index(s.device) for s in sorted(
      state.params["dense0"]["w"].addressable_shards, key=lambda s: s.device.id)])
np.savez(args.out, **results)
print(f"process {jax.process_index()}: done", flush=True)
