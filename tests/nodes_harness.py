"""Several nodes on one mesh ``("replica", "data")``: the compositions the tests run in one process
(8 simulated devices) and in two (``tests/workers/several_nodes.py``), and their references.

* ``exact_inside``: an optimizer over ``"replica"`` (DiLoCo, SparseLoCo, Streaming DiLoCo) whose
  inner steps are exact data parallel inside a node: ``data_parallel`` maps ``"replica"``, the batch
  is split over both axes, and the partitioner averages the gradient over ``"data"``;
* ``reference``: the same optimizer on one device per replica (a one-axis mesh), each device fed
  its replica's whole batch: its gradient is the replica's pre-averaged one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxcomp

IN, HIDDEN, OUT = 8, 16, 4
ROWS = 32  # global batch: every (2, 4), (4, 2) and (2, 2) mesh splits it evenly


def init_params():
  rng = np.random.default_rng(0)
  return {"hidden": {"w": rng.normal(0, 0.5, (IN, HIDDEN)).astype(np.float32),
                     "b": np.zeros(HIDDEN, np.float32)},
          "out": {"w": rng.normal(0, 0.5, (HIDDEN, OUT)).astype(np.float32),
                  "b": np.zeros(OUT, np.float32)}}


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
  return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def batch(step):
  """The global batch of ``step``: replica r's rows are its r-th block."""
  rng = np.random.default_rng(1000 + step)
  return (rng.normal(size=(ROWS, IN)).astype(np.float32),
          rng.normal(size=(ROWS, OUT)).astype(np.float32))


def inner():
  return optax.sgd(0.05, momentum=0.9)


ALGORITHMS = {
    "diloco": lambda axis: jaxcomp.diloco(inner(), sync_every=3, axis_name=axis),
    "sparseloco": lambda axis: jaxcomp.sparseloco(inner(), sync_every=3, k=8, chunk=32, bits=4,
                                                  axis_name=axis),
    "streaming_diloco": lambda axis: jaxcomp.streaming_diloco(
        inner(), sync_every=4, fragments=2, delay=1, axis_name=axis),
}


def node_mesh(shape, devices=None):
  """The ``("replica", "data")`` mesh of ``shape`` over ``devices`` (default: the first ones)."""
  devices = jax.devices()[:shape[0] * shape[1]] if devices is None else devices
  return Mesh(np.asarray(devices).reshape(shape), ("replica", "data"),
              axis_types=(AxisType.Auto,) * 2)


def exact_inside(name, mesh, steps, place=None):
  """``steps`` steps of algorithm ``name`` over ``"replica"``, exact inside a node: the parameters
  after each (global arrays, one copy per replica). ``place(global_array, sharding)`` puts a batch
  on the mesh (default ``jax.device_put``; several processes pass their own rows)."""
  dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="replica", tx=ALGORITHMS[name]("replica"))
  return run(dp, mesh, steps, place)


def through_the_hierarchical_mean(mesh):
  """DiLoCo over ``"replica"``, its inner step averaging the gradient over ``"data"`` and its
  pseudo-gradient averaged by ``jaxcomp.hierarchical``: the step, over both axes."""
  tx = jaxcomp.diloco(optax.chain(jaxcomp.allreduce(axis_name="data"), inner()), sync_every=3,
                      axis_name="replica", compressor=jaxcomp.hierarchical(
                          jaxcomp.allreduce(axis_name="replica"), fast_axis="data"))
  return jaxcomp.data_parallel(loss_fn, mesh, axis_name=("replica", "data"), tx=tx)


def run(dp, mesh, steps, place=None):
  """``steps`` steps of ``dp`` from ``init_params()``, each replica fed its rows (``place``, as
  ``exact_inside``): the parameters after each."""
  place = place or jax.device_put
  opt_state, params = dp.make_state(init_params()), dp.make_params(init_params())
  split = NamedSharding(mesh, P(("replica", "data")))
  history = []
  for t in range(steps):
    params, opt_state, loss = dp.step(params, opt_state,
                                      *(place(x, split) for x in batch(t)))
    jax.block_until_ready(loss)
    history.append(params)
  return history


def reference(name, replicas, steps):
  """``steps`` steps of algorithm ``name`` on ``replicas`` devices, one per replica, each fed its
  replica's rows: the parameters after each, NumPy ``(replicas, ...)``."""
  mesh = Mesh(np.asarray(jax.devices()[:replicas]), ("batch",), axis_types=(AxisType.Auto,))
  dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="batch", tx=ALGORITHMS[name]("batch"))
  opt_state, params = dp.make_state(init_params()), dp.make_params(init_params())
  history = []
  for t in range(steps):
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard(batch(t)))
    jax.block_until_ready(loss)
    history.append(jax.tree.map(np.asarray, params))
  return history


def fsdp_mesh(shape, devices=None):
  """The ``("replica", "fsdp")`` mesh of ``shape``: each replica fully sharded inside a node."""
  devices = jax.devices()[:shape[0] * shape[1]] if devices is None else devices
  return Mesh(np.asarray(devices).reshape(shape), ("replica", "fsdp"),
              axis_types=(AxisType.Auto,) * 2)


def fully_sharded_inside(name, mesh, steps, place=None):
  """``steps`` steps of algorithm ``name`` over ``"replica"``, each replica fully sharded over
  ``"fsdp"`` (``jaxcomp.fully_sharded``): ``(fs, the state after each step)``."""
  place = place or jax.device_put
  fs = jaxcomp.fully_sharded(lambda p, x, y: loss_fn(jaxcomp.gather_layer(p), x, y), mesh,
                             jaxcomp.allreduce(axis_name="fsdp"), ALGORITHMS[name]("replica"),
                             axis_name="fsdp")
  state = fs.make_state(init_params())
  split = NamedSharding(mesh, P(("replica", "fsdp")))
  history = []
  for t in range(steps):
    state, loss = fs.step(state, *(place(x, split) for x in batch(t)))
    jax.block_until_ready(loss)
    history.append(state)
  return fs, history
