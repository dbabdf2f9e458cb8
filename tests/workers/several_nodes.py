"""One process of a 2-process job (2 CPU devices each, jax.distributed on 127.0.0.1) on the
``("replica", "data")`` mesh, one row per process: DiLoCo, SparseLoCo and Streaming DiLoCo over
``"replica"`` with exact data parallelism inside the process (``nodes_harness.exact_inside``, each
process feeding its replica's rows), DiLoCo with each replica fully sharded over its process's
devices, and the bytes per axis of the hierarchical and the flat int8 means.

Writes to ``--out``: ``<algorithm>/<step>/<leaf>``, this process's replica's parameters after each
step; ``fsdp/<step>/<leaf>``, the fully sharded run's first replica's whole parameters;
``bytes/<flat|hierarchical>/<axes>``, the int8 codes each exchange sends across each axis.

    python tests/workers/several_nodes.py --coordinator 127.0.0.1:PORT --process-id I --out F
"""

import os
import sys

from two_processes import join

args = join()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcomp  # noqa: E402
import nodes_harness as harness  # noqa: E402

STEPS = 7
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = harness.node_mesh((2, 2), devices)
rows = harness.ROWS // 2
mine = slice(args.process_id * rows, (args.process_id + 1) * rows)


def place(x, sharding):  # this process's rows: its replica's
  return jax.make_array_from_process_local_data(sharding, np.asarray(x)[mine])


out = {}
for name in harness.ALGORITHMS:
  for t, params in enumerate(harness.exact_inside(name, mesh, STEPS, place)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      key = jax.tree_util.keystr(path, simple=True, separator="/")
      out[f"{name}/{t}/{key}"] = np.asarray(leaf.addressable_shards[0].data)[0]

fsdp_mesh = harness.fsdp_mesh((2, 2), devices)
fs, states = harness.fully_sharded_inside("diloco", fsdp_mesh, STEPS, place)
for t, state in enumerate(states):
  for path, leaf in jax.tree_util.tree_leaves_with_path(fs.gather_params(state)):
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    out[f"fsdp/{t}/{key}"] = np.asarray(leaf.addressable_shards[0].data)

int8 = lambda axes: jaxcomp.quantized(8, axis_name=axes)  # noqa: E731
for kind, exchange in [("flat", int8(("replica", "data"))),
                       ("hierarchical", jaxcomp.hierarchical(int8("replica")))]:
  dp = jaxcomp.data_parallel(harness.loss_fn, mesh, axis_name=("replica", "data"),
                             tx=optax.chain(exchange, optax.sgd(0.1)))
  params = harness.init_params()
  state = dp.make_state(params)
  batch = [place(x, dp.batch_sharding) for x in harness.batch(0)]
  for axes, part in jaxcomp.comm_report(dp.step, params, state, *batch).by_axes(mesh).items():
    out[f"bytes/{kind}/{'+'.join(axes)}"] = part.bytes_by_dtype().get("s8", 0)

np.savez(args.out, **out)
jax.distributed.shutdown()
