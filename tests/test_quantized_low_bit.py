"""quantized's 4- and 2-bit codes (symmetric int4, ternary, float4 E2M1 and E3M0) and its decaying
worker error, against the NumPy reference (``quantized_reference``): the packed codes and the
scales on the wire bit for bit, the decayed error step for step, unbiased stochastic rounding, the
non-finite policy, the bytes. The registry's ``quantized_int4`` and ``quantized_int2`` run through
every registry-wide test (pmap, shard_map, data_parallel, faults, resume) as every entry does."""

import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import exchange
from jaxcomp._src import quantized as quantized_lib
from helpers import replicate, run_updates
from quantized_reference import (LEVELS, TABLES, WIDTH, gradients, recorded_exchange, ref_step,
                                 table_fields)

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
NARROW = (4, 2, "e2m1", "e3m0")
EPS = float(np.finfo(np.float32).eps)


def test_the_levels_and_the_reference_agree_on_the_codes_definition():
  assert quantized_lib.LEVELS == {k: tuple(float(v) for v in t) for k, t in TABLES.items()}
  assert {b: quantized_lib.width(b) for b in quantized_lib.BITS} == WIDTH
  # Ties go to the even index: 2.5 between 2 and 3 → 2; E2M1's 1.25 between 1 and 1.5 → 1;
  # E3M0's 3 between 2 and 4 → 2 (index 2); no negative zero.
  assert table_fields(np.array([2.5, 3.5, -0.2]), 4).tolist() == [2, 4, 0]
  assert table_fields(np.array([1.25, 1.75, -6.0]), "e2m1").tolist() == [2, 4, 8 | 7]


@pytest.mark.parametrize("bits", NARROW)
def test_packed_codes_and_scales_equal_the_reference_two_phase_average_exactly(bits):
  """Step after step, from the same gradient and errors, the same bytes of codes and the same
  scales on the wire (each step's reference starts from jaxcomp's errors, as the 8-bit test's)."""
  block, length, steps = 32, 300, 4  # 300 = 3 full shards of 96 and a partial one
  run = recorded_exchange(quantized_lib.QuantizedConfig(bits=bits, block_size=block), W)
  grads = gradients(W, np.random.default_rng(0), steps, length)
  worker = np.zeros((W, length), np.float32)
  server = np.zeros((W, length), np.float32)
  for t in range(steps):
    ref_mean, ref_worker, ref_server, phase1, phase2 = ref_step(grads[t], worker, server, block,
                                                                bits)
    mean, worker, server, ((codes1, scales1), (codes2, scales2)) = jax.block_until_ready(
        run(grads[t], worker, server))
    assert np.asarray(codes1).dtype == np.uint8
    assert np.asarray(codes1).shape[-1] == 96 * WIDTH[bits] // 8  # a row of S values, packed
    for d in range(W):
      np.testing.assert_array_equal(codes1[d], phase1[d][0], err_msg=f"step {t}")
      np.testing.assert_array_equal(scales1[d].reshape(W, -1), phase1[d][1], err_msg=f"step {t}")
      np.testing.assert_array_equal(codes2[d].reshape(1, -1), phase2[d][0], err_msg=f"step {t}")
      np.testing.assert_array_equal(scales2[d].reshape(1, -1), phase2[d][1], err_msg=f"step {t}")
      np.testing.assert_allclose(mean[d], ref_mean, rtol=0, atol=4 * EPS * np.abs(ref_mean).max())
    top = np.abs(grads[t]).max()
    np.testing.assert_allclose(worker, ref_worker, rtol=0, atol=4 * EPS * top)
    np.testing.assert_allclose(server, ref_server, rtol=0, atol=4 * EPS * top)


def test_a_decaying_worker_error_follows_the_reference_step_for_step():
  """MuLoCo's accumulator: p = g + β·e, e ← p − decode(code(p)), β = 0.9, in 2 bits."""
  grads = gradients(W, np.random.default_rng(1), 4, 3 * 70)
  tx = jaxcomp.quantized(2, block_size=64, error_decay=0.9)
  outs, states = run_updates(tx, [{"w": g.reshape(W, 3, 70)} for g in grads], W)
  worker = server = np.zeros((W, grads.shape[-1]), np.float32)
  for t in range(4):
    ref_mean, worker, server, _, _ = ref_step(grads[t], worker, server, 64, 2, decay=0.9)
    top = np.abs(grads[: t + 1]).max()
    np.testing.assert_allclose(np.asarray(outs[t]["w"]).reshape(W, -1), np.stack([ref_mean] * W),
                               rtol=0, atol=8 * EPS * top)
    np.testing.assert_allclose(states[t].worker_error["w"].reshape(W, -1), worker, rtol=0,
                               atol=8 * EPS * top)
  assert np.abs(worker).max() > 0


@pytest.mark.parametrize("bits, between", [(4, (2, 3)), (2, (0, 1)), ("e2m1", (1, 1.5)),
                                           ("e3m0", (4, 8))])
def test_stochastic_rounding_is_unbiased_where_rounding_to_the_nearest_is_not(bits, between):
  # Every device holds the same block: one value at the block's maximum (scale 1/Q), the rest
  # three tenths of the way from one level to the next.
  low, high = between
  scale = 1.0 / LEVELS[bits]
  value = (low + 0.3 * (high - low)) * scale
  g = np.full((W, 16), value, np.float32)
  g[:, 0] = 1.0
  nearest = jaxcomp.quantized(bits, block_size=16, error_feedback=False)
  (out,), _ = run_updates(nearest, [{"g": g}], W)
  bias = float(out["g"][0, 1]) - value
  assert abs(bias) >= 0.25 * (high - low) * scale  # the nearest level is biased
  tx = jaxcomp.quantized(bits, block_size=16, error_feedback=False, stochastic_rounding=True)
  outs, _ = run_updates(tx, [{"g": g}] * 300, W)
  outputs = np.asarray([np.asarray(o["g"][0, 1:], np.float64) for o in outs])
  assert set(np.unique(np.round(outputs / scale, 6))) <= {low, high}  # one of the two neighbours
  assert abs(outputs.mean() - value) < 0.25 * (high - low) * scale < abs(bias)


@pytest.mark.parametrize("bits", [4, 2])
def test_a_non_finite_step_keeps_the_undecayed_state_and_gives_nan(bits):
  rng = np.random.default_rng(4)
  tx = jaxcomp.quantized(bits, block_size=32, error_decay=0.9, stochastic_rounding=True)
  g = {"w": rng.standard_normal((W, 70)).astype(np.float32)}
  bad = {"w": g["w"].copy()}
  bad["w"][2, 5] = np.inf
  (_, out), (state, kept) = run_updates(tx, [g, bad], W)
  assert np.isnan(np.asarray(out["w"])).all()
  assert np.abs(np.asarray(state.worker_error["w"])).max() > 0
  jax.tree.map(np.testing.assert_array_equal, kept, state)


@pytest.mark.parametrize("bits", NARROW)
def test_comm_report_shows_packed_codes_and_the_minimum_bytes(bits):
  length, block = 1000, 64
  tx = jaxcomp.quantized(bits, block_size=block)
  grads = {"w": np.zeros((W, length), np.float32)}
  state = replicate(tx.init({"w": grads["w"][0]}), W)
  report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W]),
                               grads, state, num_devices=W)
  padded = exchange.shard_length(length, W, block) * W
  codes = padded * WIDTH[bits] // 8
  assert report.bytes_by_dtype() == {"u8": 2 * codes, "f32": 2 * 4 * padded // block}
  assert sorted(c.op for c in report.collectives if c.dtypes[0] == "u8") == ["all-gather",
                                                                              "all-to-all"]


def test_bad_settings_are_refused_with_the_choices():
  with pytest.raises(ValueError, match="bits must be 8 .* 4, 2, 'e2m1' or 'e3m0'"):
    jaxcomp.quantized(3)
  with pytest.raises(ValueError, match="error_decay"):
    jaxcomp.quantized(2, error_decay=1.5)
