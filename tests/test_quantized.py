"""quantized: int8 / float8 averaging through all-to-all and all-gather, against a NumPy reference
(``quantized_reference``, written from the definition), whose codes and scales must equal the ones
jaxcomp sends bit for bit. The 4- and 2-bit codes: ``test_quantized_low_bit.py``.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import hooks
from jaxcomp._src import exchange
from jaxcomp._src import quantized as quantized_lib
from helpers import replicate, run_updates
from quantized_reference import LEVELS, gradients, recorded_exchange, ref_step

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
CODE_DTYPES = {8: np.int8, "fp8": np.uint8}  # float8_e4m3fn codes are sent as their bits
EPS = float(np.finfo(np.float32).eps)


def values_of(codes):
  """Codes as numbers (float8 may round a tiny negative value to -0 or to +0: the same code)."""
  codes = np.asarray(codes)
  if codes.dtype == np.uint8:  # float8_e4m3fn bits
    codes = codes.view(ml_dtypes.float8_e4m3fn)
  return np.asarray(codes).astype(np.float32)


@pytest.mark.parametrize("bits", [8, "fp8"])
def test_codes_and_scales_equal_the_reference_two_phase_average_exactly(bits):
  """Step after step, from the same gradient and errors, the same codes and scales on the wire.

  The errors jaxcomp carries into the next step may differ from the reference's at float32 rounding
  (XLA fuses ``p − code·scale`` into one multiply-add), so each step's reference starts from
  jaxcomp's errors: then every code and scale is the same, bit for bit.
  """
  block, length, steps = 32, 300, 6  # 300 = 2 full shards of 128, a partial one and an empty one
  config = quantized_lib.QuantizedConfig(bits=bits, block_size=block)
  run = recorded_exchange(config, W)
  grads = gradients(W, np.random.default_rng(0), steps, length)
  worker = np.zeros((W, length), np.float32)
  server = np.zeros((W, length), np.float32)
  for t in range(steps):
    ref_mean, ref_worker, ref_server, phase1, phase2 = ref_step(grads[t], worker, server, block,
                                                                bits)
    mean, worker, server, ((codes1, scales1), (codes2, scales2)) = jax.block_until_ready(
        run(grads[t], worker, server))
    assert np.asarray(codes1).dtype == CODE_DTYPES[bits]
    for d in range(W):
      np.testing.assert_array_equal(values_of(codes1[d]), values_of(phase1[d][0]),
                                    err_msg=f"step {t}")
      np.testing.assert_array_equal(scales1[d].reshape(W, -1), phase1[d][1], err_msg=f"step {t}")
      np.testing.assert_array_equal(values_of(codes2[d]), values_of(phase2[d][0]),
                                    err_msg=f"step {t}")
      np.testing.assert_array_equal(scales2[d].reshape(1, -1), phase2[d][1], err_msg=f"step {t}")
      np.testing.assert_allclose(mean[d], ref_mean, rtol=0, atol=4 * EPS * np.abs(ref_mean).max())
    top = np.abs(grads[t]).max()
    np.testing.assert_allclose(worker, ref_worker, rtol=0, atol=4 * EPS * top)
    np.testing.assert_allclose(server, ref_server, rtol=0, atol=4 * EPS * top)
    assert np.abs(ref_server).max() > 0 and np.abs(ref_worker).max() > 0


@pytest.mark.parametrize("bits", [8, "fp8"])
def test_the_transformation_and_the_hook_give_the_reference_mean(bits):
  rng = np.random.default_rng(1)
  grads = gradients(W, rng, 3, 5 * 61)
  tx = jaxcomp.quantized(bits, block_size=64)
  hook_tx = jaxcomp.comm_hook(hooks.quantized_hook, hooks.quantized_state(bits, block_size=64))
  trees = [{"w": g.reshape(W, 5, 61)} for g in grads]  # one leaf: the hook's bucket is the same
  outs, states = run_updates(tx, trees, W)
  hook_outs, _ = run_updates(hook_tx, trees, W)
  worker = server = np.zeros((W, grads.shape[-1]), np.float32)
  for t in range(3):
    ref_mean, worker, server, _, _ = ref_step(grads[t], worker, server, 64, bits)
    bound = 4 * EPS * np.abs(ref_mean).max()
    for d in range(W):
      np.testing.assert_allclose(outs[t]["w"][d].ravel(), ref_mean, rtol=0, atol=bound)
      np.testing.assert_allclose(hook_outs[t]["w"][d].ravel(), ref_mean, rtol=0, atol=bound)
    np.testing.assert_allclose(states[t].worker_error["w"].reshape(W, -1), worker, rtol=0,
                               atol=4 * EPS * np.abs(grads[t]).max())


def test_vmap_with_an_axis_name_gives_the_reference_mean():
  """``jax.vmap(tx.update, axis_name=...)`` runs the devices on one (its all-gather: no pvary)."""
  grads = gradients(W, np.random.default_rng(8), 2, 3 * 50)
  tx = jaxcomp.quantized(8, block_size=32)
  update = jax.jit(jax.vmap(tx.update, axis_name="batch"))
  state = replicate(tx.init({"w": grads[0, 0].reshape(3, 50)}), W)
  worker = server = np.zeros((W, grads.shape[-1]), np.float32)
  for t in range(2):
    out, state = jax.block_until_ready(update({"w": grads[t].reshape(W, 3, 50)}, state))
    ref_mean, worker, server, _, _ = ref_step(grads[t], worker, server, 32, 8)
    np.testing.assert_allclose(np.asarray(out["w"]).reshape(W, -1), np.stack([ref_mean] * W),
                               rtol=0, atol=4 * EPS * np.abs(ref_mean).max())


def test_bucket_cap_mb_runs_one_exchange_and_one_state_per_bucket():
  """Leaves of 4,000 and 4,400 bytes with a 4,000-byte cap: two buckets, each its own two-phase
  average (one flat vector of both would put blocks across the leaves' boundary)."""
  rng = np.random.default_rng(9)
  grads = gradients(W, rng, 2, 2100)
  tx = jaxcomp.quantized(8, block_size=64, bucket_cap_mb=4000 / 2**20)
  trees = [{"a": g[:, :1000], "b": g[:, 1000:]} for g in grads]
  outs, states = run_updates(tx, trees, W)
  assert isinstance(states[-1], jaxcomp.CommHookState) and len(states[-1].hook_states) == 2
  assert all(isinstance(s, jaxcomp.QuantizedState) for s in states[-1].hook_states)
  for k in ("a", "b"):  # DDP's buckets: "b" first; each holds one leaf
    worker = server = np.zeros((W, trees[0][k].shape[-1]), np.float32)
    for t in range(2):
      ref_mean, worker, server, _, _ = ref_step(trees[t][k], worker, server, 64, 8)
      np.testing.assert_allclose(outs[t][k], np.stack([ref_mean] * W), rtol=0,
                                 atol=4 * EPS * np.abs(ref_mean).max())


def test_error_feedback_telescopes():
  """Σ outputs = Σ mean gradients − mean of the final worker errors − the final server errors."""
  rng = np.random.default_rng(2)
  steps = 40
  tx = jaxcomp.quantized(8, block_size=32)
  grads = {"b": rng.standard_normal((steps, W, 9)).astype(np.float32),
           "w": (rng.standard_normal((steps, W, 40, 9)) * 0.01).astype(np.float32)}
  outs, states = run_updates(tx, [{k: v[t] for k, v in grads.items()} for t in range(steps)], W)
  total_out = sum(np.concatenate([np.asarray(out[k][0], np.float64).ravel() for k in ("b", "w")])
                  for out in outs)
  state = states[-1]
  total_mean = np.concatenate([grads[k].astype(np.float64).mean(1).sum(0).reshape(-1)
                               for k in ("b", "w")])
  worker = np.concatenate([np.asarray(state.worker_error[k], np.float64).mean(0).ravel()
                           for k in ("b", "w")])
  server = np.concatenate([np.asarray(state.server_error[k], np.float64).sum(0).ravel()
                           for k in ("b", "w")])
  assert np.abs(worker).max() > 1e-4 and np.abs(server).max() > 1e-4  # both errors are in play
  np.testing.assert_allclose(total_out, total_mean - worker - server, rtol=0,
                             atol=steps * 16 * EPS * np.abs(total_mean).max())


@pytest.mark.parametrize("bits", [8, "fp8"])
def test_stochastic_rounding_is_unbiased_where_rounding_to_the_nearest_is_not(bits):
  # Every device holds the same block: one value at the block's maximum, the rest at 0.3 of a
  # quantization step (int8: rounds to 0) or between two float8 values (0.3 lies between 0.28125
  # and 0.3125, nearer the upper).
  gap_low, gap_high = {8: (0.0, 1.0), "fp8": (0.28125, 0.3125)}[bits]
  scale = 1.0 / LEVELS[bits]
  g = np.full((W, 16), 0.3 * scale, np.float32)
  g[:, 0] = 1.0
  steps = 400
  nearest = jaxcomp.quantized(bits, block_size=16, error_feedback=False)
  (out,), _ = run_updates(nearest, [{"g": g}], W)
  bias = float(out["g"][0, 1]) - 0.3 * scale
  assert abs(bias) >= 0.25 * (gap_high - gap_low) * scale  # the nearest level is biased
  tx = jaxcomp.quantized(bits, block_size=16, error_feedback=False, stochastic_rounding=True)
  outs, _ = run_updates(tx, [{"g": g}] * steps, W)
  outputs = [np.asarray(out["g"][0, 1:], np.float64) for out in outs]
  levels = np.unique(np.round(np.asarray(outputs) / scale, 6))
  assert set(levels) <= {gap_low, gap_high}, levels  # always one of the two neighbours
  average = np.mean(outputs)
  assert abs(average - 0.3 * scale) < 0.25 * (gap_high - gap_low) * scale < abs(bias)


@pytest.mark.parametrize("bits", [8, "fp8"])
@pytest.mark.parametrize("magnitude", [1e30, 0.0])
def test_huge_and_all_zero_gradients_at_w8_stay_finite(bits, magnitude):
  rng = np.random.default_rng(3)
  grads = {"w": (rng.standard_normal((8, 33, 17)) * magnitude).astype(np.float32),
           "b": (rng.standard_normal((8, 17)) * 1e-30).astype(np.float32)}
  outs, states = run_updates(jaxcomp.quantized(bits, block_size=64), [grads] * 3, 8)
  for out, state in zip(outs, states):
    for leaf in jax.tree.leaves((out, state.worker_error, state.server_error)):
      assert np.isfinite(np.asarray(leaf)).all()
  out = outs[-1]
  mean = grads["w"].astype(np.float64).mean(0)
  # Within a few quantization steps of the mean (the errors of the last steps hold the rest):
  # int8 steps are max/127; float8 rounds to 1/16 of a value at worst.
  step = np.abs(grads["w"]).max() * (1 / 127 if bits == 8 else 1 / 16)
  np.testing.assert_allclose(out["w"][0], mean, rtol=0, atol=4 * step)
  if magnitude == 0:
    np.testing.assert_array_equal(out["w"], 0)


@pytest.mark.parametrize("bits", [8, "fp8"])
def test_fewer_values_than_devices_under_data_parallel(bits):
  # 4 values on 8 devices: owners 1-7 hold rows of padding alone, whose server error
  # (kernels.row_of_arrays) must have the type of the others' under shard_map. Every device's
  # gradient is the same everywhere (8, then 1.6), which 8-bit codes with a block scale carry.
  mesh = jax.make_mesh((8,), ("batch",))
  tx = optax.chain(jaxcomp.quantized(bits), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
  params = jnp.ones((4, 1))
  opt_state = dp.make_state(params)
  for _ in range(2):  # the second step adds the (zero) server error of the first
    params, opt_state, loss = dp.step(params, opt_state, dp.shard(jnp.ones((16, 4))))
    jax.block_until_ready(loss)
  np.testing.assert_allclose(np.asarray(params), 1 - 0.1 * 8 - 0.1 * 2 * 0.8, atol=1e-6)


def test_a_non_finite_step_keeps_the_state_and_gives_nan():
  rng = np.random.default_rng(4)
  tx = jaxcomp.quantized(8, block_size=32, stochastic_rounding=True)
  g = {"w": rng.standard_normal((W, 70)).astype(np.float32)}
  bad = {"w": g["w"].copy()}
  bad["w"][2, 5] = np.nan
  (_, out), (state, kept) = run_updates(tx, [g, bad], W)
  assert np.isnan(np.asarray(out["w"])).all()
  jax.tree.map(np.testing.assert_array_equal, kept, state)


@pytest.mark.parametrize("bits, wire", [(8, "s8"), ("fp8", "u8")])
def test_comm_report_shows_8_bit_collectives_and_the_minimum_bytes(bits, wire):
  length, block = 1000, 64
  tx = jaxcomp.quantized(bits, block_size=block)
  grads = {"w": np.zeros((W, length), np.float32)}
  state = replicate(tx.init({"w": grads["w"][0]}), W)
  report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W]),
                               grads, state, num_devices=W)
  padded = exchange.shard_length(length, W, block) * W
  codes = [c for c in report.collectives if c.dtypes[0] == wire]
  assert sorted(c.op for c in codes) == ["all-gather", "all-to-all"]
  assert all(c.payload_bytes == padded for c in codes)
  for c in report.collectives:  # the rest: the scales
    assert c in codes or c.payload_bytes == 4 * padded // block, c
    assert not (c.op == "all-reduce" and "f32" in c.dtypes)
  assert report.payload_bytes == 2 * padded + 2 * 4 * padded // block  # no flag: the scales tell
  assert report.ring_bytes < 0.3 * 2 * (W - 1) / W * 4 * length  # about a quarter of f32's


def test_the_state_does_not_depend_on_the_number_of_devices():
  """The errors have the params' structure (so they can be sharded like the parameters)."""
  tx = jaxcomp.quantized(8)
  params = {"w": jnp.zeros((10, 3)), "n": jnp.zeros(4, jnp.int32)}
  state = tx.init(params)
  assert state.worker_error["w"].shape == state.server_error["w"].shape == (10, 3)
  assert isinstance(state.worker_error["n"], optax.MaskedNode)
  assert not jax.tree.leaves(jaxcomp.quantized(8, error_feedback=False).init(params).worker_error)
  specs = jaxcomp.state_partition_specs(tx, params)
  assert specs.worker_error["w"] == specs.server_error["w"] == jax.sharding.PartitionSpec("batch")


