"""onebit_adam: 1-bit Adam against a NumPy reference of the paper's Algorithm 1 and DeepSpeed's
``compressed_allreduce``; plain Adam before the freeze; the hook; extremes and non-finite steps."""

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


def ref_compressed_allreduce(local, worker, server):
  """DeepSpeed's ``compressed_allreduce`` on W workers' flat momenta (rows of ``local``).

  Worker: ``p = m + δ``, scale ``‖p‖₁/L``, ``δ ← p − scale·sign(p)`` (a zero counts as +); the
  vector is cut into W shards of S values (S a multiple of 8, zero padding at the end). Server
  (owner of shard d): the mean of the workers' scaled signs plus ``δ̄``, its own scale over the
  shard's real values, ``δ̄ ← mean − scale·sign(mean)``; every device receives every shard's scaled
  signs. jaxcomp's departures: the scale is the mean magnitude (DeepSpeed: ``‖p‖₂/√L``, which lets
  the error of a sparse ``p`` grow), and the padding is left out of the scales and keeps no error.
  """
  world, length = local.shape
  shard = max(-(-length // (8 * world)), 1) * 8
  p = local + worker
  scales = np.abs(p).sum(1) / length
  signs = np.where(p >= 0, 1.0, -1.0)
  worker = p - scales[:, None] * signs
  padded = np.ones((world, world * shard))  # the zero padding has sign +
  padded[:, :length] = signs
  out = np.zeros(world * shard)
  server = np.zeros_like(server) + server
  for owner in range(world):
    lo, hi = owner * shard, min((owner + 1) * shard, length)
    valid = max(hi - lo, 0)
    mean = (scales[:, None] * padded[:, owner * shard:(owner + 1) * shard]).mean(0)
    mean[:valid] += server[owner, lo:hi]
    mean[valid:] = 0
    scale = np.abs(mean).sum() / valid if valid else 0.0
    compressed = scale * np.where(mean >= 0, 1.0, -1.0)
    server[owner, lo:hi] = (mean - compressed)[:valid]
    out[owner * shard:(owner + 1) * shard] = compressed
  return out[:length], worker, server


class RefOneBitAdam:
  """1-bit Adam (Tang et al. 2021, Alg. 1) on W workers, float64."""

  def __init__(self, length, learning_rate, freeze_steps, b1=0.9, b2=0.999, eps=1e-8,
               bias_correction=True):
    self.m, self.v = np.zeros(length), np.zeros(length)
    self.worker, self.server = np.zeros((W, length)), np.zeros((W, length))
    self.lr, self.freeze, self.b1, self.b2, self.eps = learning_rate, freeze_steps, b1, b2, eps
    self.bias_correction, self.t = bias_correction, 0

  def step(self, grads):  # grads: (W, length)
    if self.t < self.freeze:  # Adam on the mean gradient
      g = grads.mean(0)
      self.m = self.b1 * self.m + (1 - self.b1) * g
      self.v = self.b2 * self.v + (1 - self.b2) * g**2
    else:  # local momentum, exchanged 1-bit with worker and server error; v frozen
      local = self.b1 * self.m + (1 - self.b1) * grads
      self.m, self.worker, self.server = ref_compressed_allreduce(local, self.worker, self.server)
      if self.freeze:
        self.m = np.where(self.v > 0, self.m, 0.0)  # DeepSpeed's exp_avg_mask where v is 0
    self.t += 1
    m, v = self.m, self.v
    if self.bias_correction:
      m = m / (1 - self.b1**self.t)
      v = v / (1 - self.b2**min(self.t, self.freeze))
    return -self.lr * m / (np.sqrt(v) + self.eps)


def flat(tree):
  """The reduced leaves of a per-device pytree, flat in leaf order: (W, length)."""
  return np.concatenate([np.asarray(tree[k], np.float64).reshape(W, -1) for k in ("b", "w")], 1)


def gradients(rng, steps):
  """Per step, per-device gradients; row 0 of ``w`` is always 0 (a blank input's weights)."""
  grads = [{"b": (rng.standard_normal((W, 6)) + 0.5).astype(np.float32),
            "w": rng.standard_normal((W, 10, 6)).astype(np.float32) * np.float32(0.1),
            "n": np.arange(W, dtype=np.int32)} for _ in range(steps)]
  for g in grads:
    g["w"][:, 0] = 0
  return grads


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_the_reference_step_for_step(bias_correction):
  steps, freeze = 40, 6
  grads = gradients(np.random.default_rng(0), steps)
  tx = jaxcomp.onebit_adam(0.01, freeze_steps=freeze, bias_correction=bias_correction)
  outs, states = run_updates(tx, grads, W)
  ref = RefOneBitAdam(66, 0.01, freeze, bias_correction=bias_correction)
  for t in range(steps):
    expected = ref.step(flat(grads[t]))
    got = flat(outs[t])
    for d in range(W):
      np.testing.assert_allclose(got[d], expected, rtol=0, atol=64 * EPS * np.abs(expected).max(),
                                 err_msg=f"step {t}")
    np.testing.assert_allclose(flat(states[t].mu)[0], ref.m, rtol=0,
                               atol=64 * EPS * np.abs(ref.m).max())
    np.testing.assert_allclose(flat(states[t].nu_root)[0] ** 2, ref.v, rtol=0,
                               atol=64 * EPS * ref.v.max())
    np.testing.assert_allclose(flat(states[t].worker_error), ref.worker, rtol=0,
                               atol=64 * EPS * np.abs(ref.m).max())
    np.testing.assert_allclose(flat(states[t].server_error), ref.server, rtol=0,
                               atol=64 * EPS * np.abs(ref.m).max())
    np.testing.assert_array_equal(outs[t]["n"], grads[t]["n"])
  assert np.abs(ref.server).max() > 0 and np.abs(ref.worker).max() > 0
  np.testing.assert_array_equal(np.asarray(states[-1].nu_root["w"]),
                                np.asarray(states[freeze - 1].nu_root["w"]))  # frozen
  np.testing.assert_array_equal(np.asarray(outs[-1]["w"])[:, 0], 0)  # never a gradient: no step


def test_vmap_with_an_axis_name_gives_the_reference_update():
  """``jax.vmap(tx.update, axis_name=...)`` runs the devices on one (its all-gather: no pvary);
  both stages."""
  grads = gradients(np.random.default_rng(7), 3)
  tx = jaxcomp.onebit_adam(0.01, freeze_steps=1)
  update = jax.jit(jax.vmap(tx.update, axis_name="batch"))
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads[0])), W)
  ref = RefOneBitAdam(66, 0.01, 1)
  for g in grads:
    out, state = jax.block_until_ready(update(g, state))
    expected = ref.step(flat(g))
    np.testing.assert_allclose(flat(out), np.stack([expected] * W), rtol=0,
                               atol=64 * EPS * np.abs(expected).max())


def test_before_the_freeze_it_is_adam_on_the_mean_gradient():
  grads = gradients(np.random.default_rng(1), 10)
  outs, _ = run_updates(jaxcomp.onebit_adam(0.01, freeze_steps=100), grads, W)
  adam, _ = run_updates(optax.chain(jaxcomp.allreduce(), optax.adam(0.01)), grads, W)
  for out, expected in zip(outs, adam):
    for k in ("b", "w"):
      # optax computes 1 − 0.999ᵗ as written, which loses up to 3e-5 of it in float32.
      np.testing.assert_allclose(out[k], expected[k], rtol=2e-5, atol=0)


def test_the_hook_with_sgd_is_the_optimizer():
  rng = np.random.default_rng(2)
  grads = [{"w": rng.standard_normal((W, 9, 8)).astype(np.float32)} for _ in range(12)]
  outs, _ = run_updates(jaxcomp.onebit_adam(0.01, freeze_steps=4), grads, W)
  hook = optax.chain(jaxcomp.comm_hook(hooks.onebit_adam_hook,
                                       hooks.onebit_adam_state(freeze_steps=4)), optax.sgd(0.01))
  hook_outs, _ = run_updates(hook, grads, W)
  for out, hook_out in zip(outs, hook_outs):
    np.testing.assert_allclose(hook_out["w"], out["w"], rtol=0,
                               atol=16 * EPS * np.abs(np.asarray(out["w"])).max())


def test_b1_b2_and_eps_may_be_injected_hyperparameters_and_a_static_one_is_named():
  grads = gradients(np.random.default_rng(8), 3)
  inject = lambda **static: optax.inject_hyperparams(  # noqa: E731
      jaxcomp.scale_by_onebit_adam, static_args=tuple(static))
  injected, states = run_updates(
      inject(freeze_steps=1)(freeze_steps=1, b1=0.9, b2=0.999, eps=1e-8),
      grads, W)
  plain, _ = run_updates(jaxcomp.scale_by_onebit_adam(freeze_steps=1), grads, W)
  assert np.asarray(states[-1].hyperparams["b2"]).dtype == np.float32  # an array, not a number
  for out, expected in zip(injected, plain):
    # log(b2) of float32 b2 (injected) and of the Python float differ by 1.3e-5 of it.
    np.testing.assert_allclose(flat(out), flat(expected), rtol=2e-5, atol=0)
  with pytest.raises(TypeError, match=r"freeze_steps is static.*static_args=\('freeze_steps',\)"):
    optax.inject_hyperparams(jaxcomp.scale_by_onebit_adam)(freeze_steps=1).init({"w": np.ones(3)})


def test_a_learning_rate_schedule_is_called_with_the_step():
  grads = gradients(np.random.default_rng(3), 3)
  fixed, _ = run_updates(jaxcomp.onebit_adam(0.01, freeze_steps=2), grads, W)
  scheduled, _ = run_updates(jaxcomp.onebit_adam(lambda t: 0.01 * (t + 1), freeze_steps=2), grads,
                             W)
  for t in range(3):
    np.testing.assert_allclose(scheduled[t]["w"], (t + 1) * np.asarray(fixed[t]["w"]), rtol=1e-5)


@pytest.mark.parametrize("magnitude", [1e30, 0.0])
def test_huge_and_all_zero_gradients_at_w8_stay_finite(magnitude):
  rng = np.random.default_rng(4)
  grads = {"w": (rng.standard_normal((8, 40, 30)) * magnitude).astype(np.float32),
           "b": np.full((8, 30), magnitude, np.float32)}
  outs, states = run_updates(jaxcomp.onebit_adam(0.01, freeze_steps=2), [grads] * 5, 8)
  for out, state in zip(outs, states):  # both stages
    for leaf in jax.tree.leaves((out, state)):
      assert np.isfinite(np.asarray(leaf)).all()
  if magnitude == 0:
    for leaf in jax.tree.leaves(outs):
      np.testing.assert_array_equal(leaf, 0)


@pytest.mark.parametrize("bad_step", [1, 4])  # in the warm-up and in the compressed stage
def test_a_non_finite_step_keeps_the_state_and_gives_nan(bad_step):
  grads = gradients(np.random.default_rng(5), 6)
  grads[bad_step]["w"][2, 3, 1] = np.nan
  outs, states = run_updates(jaxcomp.onebit_adam(0.01, freeze_steps=3), grads, W)
  assert np.isnan(np.asarray(outs[bad_step]["w"])).all()
  jax.tree.map(np.testing.assert_array_equal, states[bad_step], states[bad_step - 1])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(outs[bad_step + 1]))


def test_comm_report_shows_the_dense_warm_up_and_a_compressed_stage_of_bits_and_scales():
  grads = gradients(np.random.default_rng(6), 1)[0]
  tx = jaxcomp.onebit_adam(0.01, freeze_steps=2)
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads)), W)
  report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W]),
                               grads, state, num_devices=W)
  warmup, compressed = "onebit_adam.warmup", "onebit_adam.compressed"
  assert report.phase_names == (warmup, compressed)
  # The warm-up: the dense float32 mean (and the finiteness flag); its share of the steady state 0.
  assert report.phase(warmup).bytes_by_dtype() == {"f32": 4 * 66}  # no flag: the mean tells
  stage = report.phase(compressed)
  shard = -(-66 // (8 * W)) * 8
  bits = [c for c in stage.collectives if c.dtypes[0] == "u8"]
  assert sorted(c.op for c in bits) == ["all-gather", "all-to-all"]
  assert all(c.payload_bytes == W * shard // 8 for c in bits)
  scales = [c for c in stage.collectives if c.dtypes[0] == "f32"]
  assert sorted(c.op for c in scales) == ["all-gather", "all-to-all"]
  assert all(c.payload_bytes == 4 * W for c in scales)
  # A steady-state step is a compressed one: bits, scales and the finiteness flag.
  assert report.payload_bytes == stage.payload_bytes == 2 * W * shard // 8 + 2 * 4 * W
