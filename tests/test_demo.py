"""demo: DeMo step for step against a NumPy reference of the paper's algorithm (bloc97/DeMo's
``demo.py``, with SciPy's orthonormal DCT), under pmap and data_parallel; a decode that is the same
bits on every device; int16 positions and the bytes of the compiled step; non-finite steps."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from scipy import fft

import jaxcomp
from jaxcomp._src import demo as demo_lib
from helpers import (assert_identical_across_devices, pmapped_update, replicate, rounding_tol,
                     run_applied_updates)

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
LR, WD, CHUNK, K, DECAY = 0.01, 0.1, 8, 5, 0.9


def params_tree(small=False):
  # Tiles whose sides are powers of two: an odd side's DCT basis has exact zeros (the centre of
  # every odd cosine), where a decode of few coefficients can be 0 exactly and its sign is then
  # float rounding, in any implementation.
  rng = np.random.default_rng(0)
  if small:
    return {"w": rng.normal(size=(16, 24)).astype(np.float32),
            "v": rng.normal(size=(40,)).astype(np.float32)}
  return {"w": rng.normal(size=(16, 24)).astype(np.float32),  # 2 × 3 tiles of 8 × 8
          "odd": rng.normal(size=(22, 8)).astype(np.float32),  # 11 tiles of 2 × 8
          "t": rng.normal(size=(2, 4, 16)).astype(np.float32),  # (8, 16): 2 tiles of 8 × 8
          "v": rng.normal(size=(40,)).astype(np.float32),  # (1, 40): 5 tiles of 1 × 8
          "s": np.float32(0.5),  # (1, 1): its one coefficient is always sent
          "n": np.arange(3, dtype=np.int32)}  # passes through


def gradients(steps, seed=1, small=False):
  rng = np.random.default_rng(seed)
  return [{k: rng.standard_normal((W,) + np.shape(v)).astype(np.float32)
           if np.asarray(v).dtype == np.float32 else np.stack([v] * W)
           for k, v in params_tree(small).items()} for _ in range(steps)]


def largest_divisor(n, at_most):
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


class RefDeMo:
  """DeMo (Peng et al. 2024; bloc97/DeMo ``DeMo.step``) on W devices, float64: per device
  ``δ ← decay·δ + lr·g``, the orthonormal 2-D DCT-II of each tile (SciPy's), the k largest
  |coefficients| per tile, ``δ ← δ − IDCT(sent)``; every device's (position, value) pairs; per
  coefficient the mean of the values sent for it; the inverse DCT, sign, SGD with decoupled weight
  decay. A leaf is a matrix of its last axis (a vector (1, n), a scalar (1, 1)). A leaf whose tiles
  would send at least its dense mean (W devices' k values and int16 positions per tile against 8
  bytes a value) sends every coefficient."""

  def __init__(self, params):
    self.x = {k: np.asarray(v, np.float64) for k, v in params.items()
              if np.asarray(v).dtype == np.float32}
    self.delta = {k: np.zeros((W,) + v.shape) for k, v in self.x.items()}

  @staticmethod
  def tiles(shape):
    a, b = (int(np.prod(shape[:-1])), shape[-1]) if shape else (1, 1)
    return a, b, largest_divisor(a, CHUNK), largest_divisor(b, CHUNK)

  @staticmethod
  def transform(m, a, b, h, w, inverse=False):
    """Each h × w tile of the (a, b) ``m`` through the 2-D DCT (or its inverse)."""
    tiles = m.reshape(a // h, h, b // w, w).transpose(0, 2, 1, 3)
    out = (fft.idctn if inverse else fft.dctn)(tiles, axes=(2, 3), norm="ortho")
    return out.transpose(0, 2, 1, 3).reshape(a, b)

  def step(self, grads):
    updates = {}
    for name, x in self.x.items():
      a, b, h, w = self.tiles(x.shape)
      k = min(K, h * w)
      if W * (a // h) * (b // w) * k * (4 + 2) >= 8 * a * b:  # cheaper as the dense mean
        k = h * w
      total, count = np.zeros((a, b)), np.zeros((a, b))
      for d in range(W):
        self.delta[name][d] = DECAY * self.delta[name][d] + LR * grads[name][d]
        c = self.transform(self.delta[name][d].reshape(a, b), a, b, h, w)
        tiles = c.reshape(a // h, h, b // w, w).transpose(0, 2, 1, 3).reshape(-1, h * w)
        order = np.argsort(-np.abs(tiles), axis=1, kind="stable")
        if k < h * w:  # a clear choice: float32 and float64 pick the same coefficients
          ranked = np.take_along_axis(np.abs(tiles), order, axis=1)
          assert (ranked[:, k - 1] - ranked[:, k] > 1e-5 * ranked[:, 0]).all(), name
        keep = np.zeros_like(tiles, bool)
        np.put_along_axis(keep, order[:, :k], True, axis=1)
        mask = keep.reshape(a // h, b // w, h, w).transpose(0, 2, 1, 3).reshape(a, b)
        sent = np.where(mask, c, 0.0)
        self.delta[name][d] -= self.transform(sent, a, b, h, w, inverse=True).reshape(x.shape)
        total, count = total + sent, count + mask
      decoded = self.transform(total / np.maximum(count, 1), a, b, h, w, inverse=True)
      assert (np.abs(decoded) > 1e-5 * np.abs(decoded).max()).all(), name  # a clear sign
      updates[name] = -LR * (np.sign(decoded).reshape(x.shape) + WD * x)
      self.x[name] = x + updates[name]
    return updates


def make(**settings):
  return jaxcomp.demo(LR, chunk=CHUNK, k=K, decay=DECAY, weight_decay=WD, **settings)


def run_data_parallel(tx, grads_per_step):
  """The steps under ``jaxcomp.data_parallel``'s per-device-step form (shard_map, check_vma): the
  parameters after each."""
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])

  def step(state, grads):
    params, opt_state = state
    updates, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state, params)
    params = jax.tree.map(lambda p, u: p + u if p.dtype == jnp.float32 else p, params, updates)
    return (params, opt_state), ()

  dp = jaxcomp.data_parallel(step, mesh)
  state = dp.make_state((params_tree(), tx.init(params_tree())))
  after = []
  for grads in grads_per_step:
    state, _ = dp.step(state, *dp.shard((grads,)))
    after.append(jax.tree.map(np.asarray, state[0]))
  return after


def test_matches_the_reference_step_for_step_under_pmap_and_data_parallel():
  grads = gradients(3)
  tx = make()
  ref = RefDeMo(params_tree())
  outs, states = run_applied_updates(tx, grads, params_tree(), W)
  after = run_data_parallel(tx, grads)
  for g, out, state, params in zip(grads, outs, states, after):
    want = ref.step(g)
    momenta = jax.vmap(demo_lib.momentum)(state)  # δ from the state's DCT coefficients
    assert_identical_across_devices(out)
    for k, expected in want.items():
      np.testing.assert_allclose(out[k][0], expected, **rounding_tol(64, LR), err_msg=k)
      np.testing.assert_allclose(momenta[k], ref.delta[k], **rounding_tol(256, LR), err_msg=k)
      np.testing.assert_allclose(params[k], ref.x[k], **rounding_tol(64), err_msg=k)
    np.testing.assert_array_equal(out["n"], g["n"])


def test_positions_travel_as_int16_and_the_bytes_are_the_compiled_steps():
  tx = make()
  state = replicate(tx.init(params_tree()), W)
  step = pmapped_update(tx, W)
  report = jaxcomp.comm_report(step, gradients(1)[0], state, replicate(params_tree(), W),
                               num_devices=W)
  # (tiles, coefficients sent per tile) of each leaf; "v" (5 tiles of 1 × 8) and "s" would send
  # more as tiles than as their mean: an all-reduce of their 41 values.
  sent = {"w": (6, 5), "odd": (11, 5), "t": (2, 5)}
  values = sum(tiles * k for tiles, k in sent.values())
  assert report.bytes_by_dtype() == {"s16": 2 * W * values, "f32": 4 * W * values + 4 * 41}
  assert sorted(c.op for c in report.collectives) == ["all-gather", "all-gather", "all-reduce"]
  assert report.payload_bytes == 6 * W * values + 4 * 41


def test_defaults_send_32_of_each_64_by_64_tile_85_times_less_than_the_mean():
  tx = jaxcomp.demo(1e-3)
  grads = {"w": np.ones((W, 128, 192), np.float32)}
  state = replicate(tx.init({"w": grads["w"][0]}), W)
  report = jaxcomp.comm_report(pmapped_update(tx, W),
                               grads, state, num_devices=W)
  tiles = 2 * 3
  assert report.payload_bytes == W * tiles * 32 * (4 + 2)
  assert round(4 * 128 * 192 / (tiles * 32 * (4 + 2)), 1) == 85.3  # the paper's "up to 85×"


def test_the_decode_is_the_devices_values_in_device_order_and_the_same_bits_everywhere():
  # Every device sends the same position with values that do not add associatively in float32:
  # the mean is (((v0 + v1) + v2) + v3) / 4 on every device.
  values = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
  grads = {"w": values[:, None, None] * np.eye(1, 8, dtype=np.float32)[None]}  # (W, 1, 8)
  tx = jaxcomp.demo(1.0, k=1, decay=0.0)
  state = replicate(tx.init({"w": grads["w"][0]}), W)
  updates, state = pmapped_update(tx, W)(grads, state)
  coefficient = fft.dct(np.eye(1, 8)[0], norm="ortho")  # the DCT of e_0: all 8 positive
  order = np.argsort(-np.abs(coefficient), kind="stable")[0]
  sent = coefficient[order].astype(np.float32) * values
  total = np.float32(0)
  for v in sent:
    total = np.float32(total + v)
  mean = np.zeros(8)
  mean[order] = total / np.float32(W)
  np.testing.assert_array_equal(updates["w"][:, 0], np.broadcast_to(
      -np.sign(fft.idct(mean, norm="ortho")), (W, 8)))
  assert_identical_across_devices(updates)


def test_a_non_finite_step_keeps_the_state_and_gives_nan_on_every_device():
  grads = gradients(4, small=True)
  grads[2]["w"][1, 4, 7] = np.nan
  outs, states = run_applied_updates(make(), grads, params_tree(small=True), W)
  assert all(np.isnan(np.asarray(outs[2][k])).all() for k in ("w", "v"))
  jax.tree.map(np.testing.assert_array_equal, states[2], states[1])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(outs[3]))


def test_a_chained_optimizer_missing_params_and_bad_settings_are_refused():
  grads = {"w": jnp.ones((8, 8))}
  tx = make(axis_name=None)
  with pytest.raises(ValueError, match=r"jaxcomp.demo is followed in an optax.chain"):
    chained = optax.chain(tx, optax.sgd(0.1))  # found from the state, by jaxcomp.check
    jaxcomp.check(chained.update, grads, chained.init(grads), grads)
  with pytest.raises(ValueError, match=r"weight decay needs the parameters"):
    jax.eval_shape(tx.update, grads, tx.init(grads))
  no_decay = jaxcomp.demo(LR, axis_name=None)
  jax.eval_shape(no_decay.update, grads, no_decay.init(grads))  # no decay: no params needed
  for bad, name in ((dict(k=0), "k"), (dict(chunk=0), "chunk"), (dict(decay=1.0), "decay")):
    with pytest.raises(ValueError, match=name):
      jaxcomp.demo(LR, **bad)


def test_the_learning_rate_scales_the_gradient_into_the_momentum_and_the_step_out_of_it():
  # A schedule is called with the steps taken; an injected rate gives the constant one's update.
  grads = gradients(1, small=True)[0]
  params = replicate(params_tree(small=True), W)

  def one_step(tx, taken=0):
    state = replicate(jax.jit(tx.init)(params_tree(small=True)), W)
    state = state._replace(count=state.count + taken)
    return pmapped_update(tx, W)(
        grads, state, params)

  fixed, fixed_state = one_step(make())
  injected, _ = one_step(optax.inject_hyperparams(jaxcomp.demo, static_args=("chunk", "k"))(
      LR, chunk=CHUNK, k=K, decay=DECAY, weight_decay=WD))
  twice, twice_state = one_step(
      jaxcomp.demo(lambda t: LR * (t + 1.0), chunk=CHUNK, k=K, decay=DECAY, weight_decay=WD), 1)
  for k in ("w", "v"):
    np.testing.assert_allclose(injected[k], fixed[k], rtol=1e-6)
    np.testing.assert_allclose(twice[k], 2 * np.asarray(fixed[k]), rtol=1e-6)
    np.testing.assert_allclose(twice_state.coefficients[k],
                               2 * np.asarray(fixed_state.coefficients[k]),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("shape, worth", [((509, 64), False), ((4099,), False), ((512, 64), True)])
def test_a_leaf_never_sends_more_than_its_mean(shape, worth):
  # A prime side cuts tiles one row high, and a vector of prime length tiles of one value: there
  # DeMo sends the leaf's mean, an all-reduce; (512, 64) keeps its 64 × 64 tiles, 21× fewer bytes.
  w = 8
  grads = {"x": np.ones((w,) + shape, np.float32)}
  tx = jaxcomp.demo(1e-3)
  state = replicate(tx.init({"x": grads["x"][0]}), w)
  step = jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:w])
  demo_bytes = jaxcomp.comm_report(step, grads, state).ring_bytes
  mean = optax.chain(jaxcomp.allreduce(), optax.sgd(1e-3))
  mean_step = jax.pmap(mean.update, axis_name="batch", devices=jax.devices()[:w])
  mean_bytes = jaxcomp.comm_report(mean_step, grads, replicate(mean.init({"x": grads["x"][0]}),
                                                               w)).ring_bytes
  assert demo_bytes <= mean_bytes
  assert (demo_bytes * 21 < mean_bytes) == worth
  updates, _ = step(grads, state)
  assert np.isfinite(np.asarray(updates["x"])).all()
