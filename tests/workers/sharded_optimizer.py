"""One process of a 2-process job (2 CPU devices each, jax.distributed on 127.0.0.1) that trains
with ``jaxcomp.sharded_optimizer`` under ``jaxcomp.data_parallel`` over all 4 devices, and with the
unsharded ``optax.chain`` of the same exchange and optimizer for reference.

Writes to ``--out``: this process's local copies of the parameters after each run, and its local
shards of AdamW's first moment (one row per local device, with the device's index along the axis).

    python tests/workers/sharded_optimizer.py --coordinator 127.0.0.1:PORT --process-id I --out F
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
start = {"w": rng.normal(size=(5, 7)).astype(np.float32), "b": np.float32(0.5)}


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


data = np.random.default_rng(7)
batches = [(data.normal(size=(4 * W, 5)).astype(np.float32),
            data.normal(size=(4 * W, 7)).astype(np.float32)) for _ in range(3)]
local = jax.local_device_count()
mine = slice(jax.process_index() * 4 * local, (jax.process_index() + 1) * 4 * local)


results = {}
for name, tx in (("unsharded", optax.chain(jaxcomp.allreduce(), optax.adamw(0.05))),
                 ("sharded", jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adamw(0.05)))):
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  params = dp.make_params(start)
  opt_state = dp.make_state(start)
  for x, y in batches:  # each process passes its own part of the batch
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x[mine], y[mine])))
    jax.block_until_ready(loss)
  for key, leaf in params.items():
    results[f"{name}/params/{key}"] = local_rows(leaf)
  if name == "sharded":
    results["sharded/mu/w"] = local_rows(opt_state.inner[0].mu["w"])
    results["device_index"] = np.array([mesh.devices.tolist().index(s.device) for s in sorted(
        opt_state.inner[0].mu["w"].addressable_shards, key=lambda s: s.device.id)])
np.savez(args.out, **results)
print(f"process {jax.process_index()}: done", flush=True)
