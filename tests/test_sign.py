"""sign_compress: EF-SignSGD's scaled sign against a NumPy reference of the paper's Algorithm 1."""

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import hooks
from helpers import replicate, run_updates

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
EPS = float(np.finfo(np.float32).eps)


class RefEFSign:
  """EF-SGD with the scaled sign compressor (Karimireddy et al. 2019, Alg. 1), W workers.

  Per worker and leaf: ``p = g + e``; ``C(p) = ‖p‖₁/d · sign(p)`` (a zero counts as +);
  ``e ← p − C(p)``; the output is the mean of the workers' ``C(p)``.
  """

  def __init__(self, shapes, error_feedback=True):
    self.errors = {k: np.zeros((W,) + s) for k, s in shapes.items()}
    self.error_feedback = error_feedback

  def step(self, grads):
    out = {}
    for k, g in grads.items():
      p = g.astype(np.float64) + self.errors[k]
      flat = p.reshape(W, -1)
      scale = np.abs(flat).mean(1)
      compressed = (scale[:, None] * np.where(flat >= 0, 1.0, -1.0)).reshape(p.shape)
      if self.error_feedback:
        self.errors[k] = p - compressed
      out[k] = compressed.mean(0)
    return out


def trees(rng, steps):
  return [{"b": rng.standard_normal((W, 7)).astype(np.float32),
           "w": (rng.standard_normal((W, 13, 11)) * 0.05 + 0.01).astype(np.float32),
           "n": np.arange(W, dtype=np.int32)} for _ in range(steps)]


@pytest.mark.parametrize("error_feedback", [True, False])
def test_matches_the_ef_signsgd_reference_step_for_step(error_feedback):
  steps = 40
  grads = trees(np.random.default_rng(0), steps)
  outs, states = run_updates(jaxcomp.sign_compress(error_feedback=error_feedback), grads, W)
  ref = RefEFSign({"b": (7,), "w": (13, 11)}, error_feedback)
  for t in range(steps):
    expected = ref.step({k: grads[t][k] for k in ("b", "w")})
    for k in ("b", "w"):
      bound = 16 * EPS * np.abs(expected[k]).max()
      for d in range(W):
        np.testing.assert_allclose(outs[t][k][d], expected[k], rtol=0, atol=bound,
                                   err_msg=f"step {t} leaf {k}")
      if error_feedback:
        np.testing.assert_allclose(states[t].error[k], ref.errors[k], rtol=0,
                                   atol=16 * EPS * np.abs(ref.errors[k]).max())
    np.testing.assert_array_equal(outs[t]["n"], grads[t]["n"])
  if not error_feedback:
    assert isinstance(states[-1].error["w"], optax.MaskedNode)
    return
  # Error feedback telescopes: Σ outputs = Σ mean gradients − the mean final error.
  for k in ("b", "w"):
    total_out = sum(np.asarray(out[k][0], np.float64) for out in outs)
    total_mean = sum(g[k].astype(np.float64).mean(0) for g in grads)
    final = np.asarray(states[-1].error[k], np.float64).mean(0)
    np.testing.assert_allclose(total_out, total_mean - final, rtol=0,
                               atol=steps * 16 * EPS * np.abs(total_mean).max())


def test_vmap_with_an_axis_name_gives_the_reference_mean():
  """``jax.vmap(tx.update, axis_name=...)`` runs the devices on one (its all-gather: no pvary)."""
  grads = trees(np.random.default_rng(5), 2)
  tx = jaxcomp.sign_compress()
  update = jax.jit(jax.vmap(tx.update, axis_name="batch"))
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads[0])), W)
  ref = RefEFSign({"b": (7,), "w": (13, 11)})
  for g in grads:
    out, state = jax.block_until_ready(update(g, state))
    expected = ref.step({k: g[k] for k in ("b", "w")})
    for k in ("b", "w"):
      np.testing.assert_allclose(out[k], np.stack([expected[k]] * W), rtol=0,
                                 atol=16 * EPS * np.abs(expected[k]).max())


def test_the_hook_gives_the_transformation_s_mean():
  grads = trees(np.random.default_rng(1), 5)
  outs, _ = run_updates(jaxcomp.sign_compress(), grads, W)
  hook_outs, _ = run_updates(jaxcomp.comm_hook(hooks.sign_hook, hooks.sign_state()), grads, W)
  for out, hook_out in zip(outs, hook_outs):
    for k in ("b", "w"):  # one scale per parameter in the hook too
      np.testing.assert_allclose(hook_out[k], out[k], rtol=0,
                                 atol=16 * EPS * np.abs(np.asarray(out[k])).max())


@pytest.mark.parametrize("magnitude", [1e30, 0.0])
def test_huge_and_all_zero_gradients_at_w8_stay_finite(magnitude):
  rng = np.random.default_rng(2)
  grads = {"w": (rng.standard_normal((8, 40, 30)) * magnitude).astype(np.float32),
           "b": np.full((8, 30), magnitude, np.float32)}
  outs, states = run_updates(jaxcomp.sign_compress(), [grads] * 3, 8)
  for out, state in zip(outs, states):
    for leaf in jax.tree.leaves((out, state.error)):
      assert np.isfinite(np.asarray(leaf)).all()
  np.testing.assert_allclose(outs[0]["b"], magnitude, rtol=1e-6)  # equal values: sent exactly
  if magnitude == 0:
    for leaf in jax.tree.leaves(outs):
      np.testing.assert_array_equal(leaf, 0)


def test_a_non_finite_step_keeps_the_state_and_gives_nan():
  g = trees(np.random.default_rng(3), 1)[0]
  bad = {k: v.copy() for k, v in g.items()}
  bad["w"][1, 2, 3] = np.inf
  (_, out), (state, kept) = run_updates(jaxcomp.sign_compress(), [g, bad], W)
  assert np.isnan(np.asarray(out["w"])).all() and np.isnan(np.asarray(out["b"])).all()
  jax.tree.map(np.testing.assert_array_equal, kept, state)


def test_comm_report_shows_packed_sign_bits_and_per_leaf_scales():
  grads = trees(np.random.default_rng(4), 1)[0]
  tx = jaxcomp.sign_compress()
  state = jax.tree.map(lambda x: np.stack([x] * W),
                       tx.init(jax.tree.map(lambda g: g[0], grads)))
  report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W]),
                               grads, state, num_devices=W)
  length = 7 + 13 * 11
  by_dtype = {c.dtypes[0]: c for c in report.collectives}
  assert sorted(by_dtype) == ["f32", "u8"]  # no finiteness flag: the scales tell
  assert by_dtype["u8"].op == "all-gather" and by_dtype["u8"].payload_bytes == W * -(-length // 8)
  assert by_dtype["f32"].op == "all-gather" and by_dtype["f32"].payload_bytes == W * 4 * 2
  assert report.payload_bytes == W * -(-length // 8) + W * 4 * 2


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_one_non_finite_value_in_a_large_leaf_is_seen_from_the_scales(bad):
  # XLA:CPU's max over 256 values or more drops NaN: the scale's sum of |p| does not.
  rng = np.random.default_rng(5)
  g = {"w": rng.standard_normal((W, 80, 64)).astype(np.float32)}
  poisoned = {"w": g["w"].copy()}
  poisoned["w"][2, 41, 17] = bad
  (_, out), (state, kept) = run_updates(jaxcomp.sign_compress(), [g, poisoned], W)
  assert np.isnan(np.asarray(out["w"])).all()
  jax.tree.map(np.testing.assert_array_equal, kept, state)
