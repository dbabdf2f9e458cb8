"""DGC's step against the NumPy reference of dgc_reference.py, step for step, on real devices:
exact top-k with momentum correction and masking, Nesterov momentum, local clipping, the
warm-up's dense stage, and coarse DGC's chunks."""

import math

import jax
import numpy as np
import pytest

import jaxcomp

from dgc_reference import RefDGC, device_grads, make_params, zero_at
from helpers import assert_identical_across_devices, pmapped_update, replicate, rounding_tol

pytestmark = pytest.mark.numeric
W = 4


def run_against_reference(tx, ref, steps, world=W, seed=0):
  # NumPy's float32 order against XLA's: per step the momentum, v and the sum over the devices each
  # round; unit-scale gradients (v, which keeps what was not sent, grows to ~20: rtol covers that).
  tol = rounding_tol(steps * (world + 3))
  params = make_params()
  rng = np.random.default_rng(seed)
  state = replicate(tx.init(params), world)
  update = pmapped_update(tx, world)
  for _ in range(steps):
    grads = device_grads(rng, params, world)
    out, state = jax.block_until_ready(update(grads, state))
    expected = ref.step([{k: grads[k][w] for k in grads if k != "steps"} for w in range(world)])
    assert_identical_across_devices(out)
    np.testing.assert_array_equal(out["steps"], grads["steps"])
    for key, value in expected.items():
      np.testing.assert_allclose(out[key][0], value, **tol, err_msg=key)
    for w in range(world):
      for key in ref.u[w]:
        np.testing.assert_allclose(state.u[key][w], ref.u[w][key], **tol)
        np.testing.assert_allclose(state.v[key][w], ref.v[w][key], **tol)
    for key in ref.dense_u:
      np.testing.assert_allclose(state.dense_u[key][0], ref.dense_u[key], **tol)
  return state



@pytest.mark.parametrize("nesterov,masking,clip_norm", [(False, True, None), (True, False, 20.0)])
def test_exact_mode_matches_numpy_reference_step_for_step(nesterov, masking, clip_norm):
  tx = jaxcomp.dgc(0.05, selection="exact", nesterov=nesterov, momentum_masking=masking,
                   clip_norm=clip_norm)
  ref = RefDGC(make_params(), W, 0.05, nesterov=nesterov, masking=masking, clip_norm=clip_norm)
  state = run_against_reference(tx, ref, steps=25)
  assert int(state.count[0]) == 25


def test_warmup_with_a_dense_stage_matches_reference():
  # W = 4: density 0.25 sends more than a dense all-reduce (4·0.25·2 = 2 >= 1), 0.1 does not.
  warmup = ((4, 0.25), (8, 0.1))
  tx = jaxcomp.dgc(0.05, selection="exact", warmup=warmup)
  ref = RefDGC(make_params(), W, 0.05, warmup=warmup)
  run_against_reference(tx, ref, steps=12, seed=1)


def test_coarse_dgc_matches_numpy_reference():
  world, chunk, ratio, m = W, 16, 0.25, 0.9
  tx = jaxcomp.coarse_dgc(ratio, chunk_size=chunk)
  params = make_params()
  rng = np.random.default_rng(2)
  state = replicate(tx.init(params), world)
  update = pmapped_update(tx, world)
  u = [{k: np.zeros_like(params[k]) for k in ("w1", "w2")} for _ in range(world)]
  v = [{k: np.zeros_like(params[k]) for k in ("w1", "w2")} for _ in range(world)]
  steps = 10
  tol = rounding_tol(steps * (world + 3))  # as in run_against_reference
  for _ in range(steps):
    grads = device_grads(rng, params, world)
    out, state = jax.block_until_ready(update(grads, state))
    assert_identical_across_devices(out)
    for key in ("w1", "w2"):
      n = params[key].size
      chunks = []
      for w in range(world):
        u[w][key] = np.float32(m) * u[w][key] + grads[key][w]
        v[w][key] = v[w][key] + u[w][key]
        chunks.append(v[w][key].reshape(-1, chunk))
      norms = sum(np.abs(c).sum(1) for c in chunks)
      chosen = np.argsort(-norms, kind="stable")[:math.ceil(n // chunk * ratio)]
      expected = np.zeros((n // chunk, chunk), np.float32)
      expected[chosen] = sum(c[chosen] / np.float32(world) for c in chunks)
      for w in range(world):
        v[w][key] = zero_at(v[w][key], (chosen[:, None] * chunk + np.arange(chunk)).ravel())
        u[w][key] = zero_at(u[w][key], (chosen[:, None] * chunk + np.arange(chunk)).ravel())
        np.testing.assert_allclose(state.u[key][w], u[w][key], **tol)
        np.testing.assert_allclose(state.v[key][w], v[w][key], **tol)
      np.testing.assert_allclose(out[key][0], expected.reshape(params[key].shape), **tol)
