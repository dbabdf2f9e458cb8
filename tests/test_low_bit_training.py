"""End to end: 8-bit quantization, EF-SignSGD and 1-bit Adam on a (data, model) mesh, and on
scikit-learn's digits with 8 devices.

On the 2-D mesh each runs under ``jaxcomp.data_parallel`` with parameters sharded over the model
axis: only codes and scales may cross the mesh, and each output is what its errors say it must be.
On digits each trains the task's MLP (``jaxcomp.train.tasks.digits``) for the same steps on the same
batches as the plain mean with SGD (momentum 0.9), through the registry entry the main job uses,
with its paper's recipe: ``quantized_int8`` none; ``sign`` SGD without momentum (EF-SignSGD's
experiments); ``onebit_adam`` dense Adam for the first 20% of the steps (DeepSpeed: 15–25%),
learning rate 1e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp.train import registry, tasks
from helpers import replicate, rounding_tol
from training import pmap_step

W, PER_DEVICE, STEPS = 8, 16, 600


def batch(task, t):
  inputs, targets = task.batch(0, t, W * PER_DEVICE)
  return inputs.reshape(W, PER_DEVICE, -1), targets.reshape(W, PER_DEVICE)


def chain(task, entry, steps=None):
  """The main job's optimizer for a registry entry (``jaxcomp.train.tasks.Task.optimizer``)."""
  tx = entry.make("batch", steps=steps)
  if entry.is_optimizer:
    return tx
  return optax.chain(tx, optax.sgd(task.learning_rate, momentum=entry.sgd_momentum))


def accuracy(task, tx):
  step = pmap_step(task.loss, tx, W)
  params = task.init(0)
  params, state = replicate(params, W), replicate(tx.init(params), W)
  for t in range(STEPS):
    params, state, _ = step(params, state, *batch(task, t))
    jax.block_until_ready(params)  # unblocked multi-device loops deadlock XLA:CPU on 2 cores
  return task.evaluate(jax.tree.map(lambda x: x[0], params))[1]


def step_report(task, tx):
  params = task.init(0)
  return jaxcomp.comm_report(pmap_step(task.loss, tx, W), replicate(params, W),
                             replicate(tx.init(params), W), *batch(task, 0))


@pytest.mark.slow
def test_8_bit_and_1_bit_compression_match_allreduce_accuracy_on_digits():
  task = tasks.digits()
  baseline = accuracy(task, chain(task, registry.REGISTRY["allreduce"]))
  dense_bytes = step_report(task, chain(task, registry.REGISTRY["allreduce"])).ring_bytes
  lines = [f"digits, {STEPS} steps on {W} devices: allreduce {baseline:.4f}, "
           f"{dense_bytes:,.0f} B/step/device (ring)"]
  assert baseline > 0.95
  for name, wire in (("quantized_int8", "s8"), ("sign", "u8"), ("onebit_adam", "u8")):
    entry = registry.REGISTRY[name]
    compressed = accuracy(task, chain(task, entry, STEPS))
    # The steady (compressing) step: only narrow collectives and their float32 scales, no
    # finiteness flag (a non-finite gradient shows in the scales every device receives).
    report = step_report(task, chain(task, entry))
    lines.append(f"{name}: {compressed:.4f}, {report.ring_bytes:,.0f} B/step/device (ring, "
                 f"{dense_bytes / report.ring_bytes:.1f}x less)")
    assert {c.dtypes[0] for c in report.collectives} <= {wire, "f32", "s32"}
    assert [c for c in report.collectives if c.op == "all-reduce"] == []
    assert sum(c.payload_bytes for c in report.collectives if "f32" in c.dtypes) < 0.02 * sum(
        c.payload_bytes for c in report.collectives)  # scales only
    assert compressed >= baseline - 0.01, (name, compressed, baseline)
  print("\n" + "\n".join(lines))


# ------------------------------------------------------------------------- a (data, model) mesh

DATA = 4
SHARDED = {"w1": ((16, 64), P(None, "model")), "b1": ((64,), P("model")),
           "w2": ((64, 8), P("model", None)), "scale": ((), P())}
ON_MESH = {  # each with a momentum-free SGD of rate 1: the update is minus the compressor's output
    "quantized": (lambda: optax.chain(jaxcomp.quantized(8, axis_name="data"), optax.sgd(1.0)),
                  "s8"),
    # 2 bits: 4 codes a byte; w2's rows of 2 values an owner are padded to a byte each
    "quantized_int2": (lambda: optax.chain(jaxcomp.quantized(2, axis_name="data"),
                                           optax.sgd(1.0)), "u8"),
    "sign": (lambda: optax.chain(jaxcomp.sign_compress(axis_name="data"), optax.sgd(1.0)), "u8"),
    "onebit_adam": (lambda: jaxcomp.onebit_adam(1.0, freeze_steps=0, axis_name="data",
                                                bias_correction=False), "u8"),
}


def linear_loss(params, grads):
  """A loss whose gradient on each device is that device's slice of the batch ``grads``."""
  return sum(jnp.sum(params[k] * grads[k][0]) for k in SHARDED)


@pytest.mark.numeric
@pytest.mark.parametrize("name", sorted(ON_MESH))
def test_on_a_data_model_mesh_only_codes_and_scales_cross_it_and_errors_account_for_the_mean(name):
  """Sharded over model, leaves raveled into one flat vector moved float32 values across the mesh
  (quantized: 2.6 times the dense gradient's bytes across model, 0.7 times across both axes); laid
  out leaf by leaf, only codes and scales cross either axis. Each device's output is the mean of
  what it encoded less its new worker error, plus what the owners' server errors gave back:
  ``mean_d(p_d − e'_d) + Σ_d (s_d − s'_d)``, whatever the layout.

  Auto axes: on an Explicit mesh ``data_parallel`` pins the per-device state replicated over model,
  which moves the (float32, gradient-sized) errors across model every step: data_parallel's part."""
  make, wire = ON_MESH[name]
  mesh = jax.make_mesh((DATA, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(7)
  params = {k: jax.device_put(rng.normal(size=shape).astype(np.float32), NamedSharding(mesh, spec))
            for k, (shape, spec) in SHARDED.items()}
  dense = 4 * sum(np.size(x) for x in params.values())
  dp = jaxcomp.data_parallel(linear_loss, mesh, axis_name="data", tx=make())
  state = dp.make_state(params)
  grads = [{k: (rng.normal(size=(DATA,) + shape) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
            for k, (shape, _) in SHARDED.items()} for _ in range(3)]
  report = jaxcomp.comm_report(dp.step, params, state, dp.shard(grads[0])).by_axes(mesh)
  assert set(report) == {("data",), ("model",)}, report.keys()  # nothing crosses both axes
  over_data = report[("data",)].bytes_by_dtype()
  assert set(over_data) <= {wire, "f32", "s32"} and over_data.get("f32", 0) < 0.05 * dense
  # Over model: the forward pass's float32 all-reduce (4x8 activations) and the scales; the codes,
  # which XLA replicates over model before every all-to-all and all-gather over data.
  over_model = report[("model",)]
  assert over_model.bytes_by_dtype().get("f32", 0) <= 4 * 4 * 8 + 0.05 * dense
  assert over_model.payload_bytes < dense / 2
  for g in grads:
    compressor_state = lambda s: s if name == "onebit_adam" else s[0]  # noqa: E731 (a chain's)
    before, old = params, compressor_state(state)
    params, state, _ = jax.block_until_ready(dp.step(params, state, dp.shard(g)))
    new = compressor_state(state)
    for k in SHARDED:
      sent, worker, server, out = sent_and_errors(name, k, g, old, new, before, params)
      expected = (sent - worker).mean(0) + (server[0] - server[1]).sum(0)
      # Rounding: the W terms of the means and, for SGD's output, the parameters' own (about 3).
      scale = max(np.abs(sent).max(), 0 if name == "onebit_adam" else np.abs(before[k]).max())
      np.testing.assert_allclose(out, expected, **rounding_tol(4 * DATA, scale))
      if server[1].any():  # device d's server error lies on its own row: last-axis index j, j%W = d
        owner = np.arange(server[1].shape[-1] if server[1].ndim > 1 else 1) % DATA
        rows = np.moveaxis(server[1].reshape((DATA, -1, owner.size)), 0, -1) != 0
        assert (rows <= (owner[:, None] == np.arange(DATA))).all()


def sent_and_errors(name, k, g, old, new, before, after) -> tuple:
  """Leaf ``k`` of one step: what each device encoded, its new worker error, the (old, new) server
  errors (zero for sign, which has none) and the exchange's output, as float64 NumPy arrays."""
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  if name == "onebit_adam":  # the momentum crosses the wire; its mean is the new momentum
    sent = 0.9 * f64(old.mu[k]) + 0.1 * f64(g[k]) + f64(old.worker_error[k])
    return (sent, f64(new.worker_error[k]),
            (f64(old.server_error[k]), f64(new.server_error[k])), f64(new.mu[k]))
  out = f64(before[k]) - f64(after[k])  # SGD of rate 1
  if name == "sign":
    zero = np.zeros_like(f64(new.error[k]))
    return f64(g[k]) + f64(old.error[k]), f64(new.error[k]), (zero, zero), out
  return (f64(g[k]) + f64(old.worker_error[k]), f64(new.worker_error[k]),
          (f64(old.server_error[k]), f64(new.server_error[k])), out)
