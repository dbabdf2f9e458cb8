"""dion: Dion against a NumPy reference of the paper's Algorithm 1 on the mean gradient (which the
data-parallel exchange of the factors reproduces, by linearity), at low and at full rank, under
pmap and data_parallel; at full rank its warm-started power iteration reaches the orthonormal factor
UVᵀ of the mean momentum; the bytes of the compiled step; non-finite steps; NNX; exact resume."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxcomp
from helpers import (assert_identical_across_devices, pmapped, pmapped_update, replicate,
                     rounding_tol, run_applied_updates)

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
LR, WD, SLR, SWD = 0.02, 0.1, 0.005, 0.05


def params_tree(small=False):
  rng = np.random.default_rng(0)
  tree = {"tall": rng.normal(size=(24, 10)).astype(np.float32),  # compressed, P on the fan-in side
          "bias": rng.normal(size=(10,)).astype(np.float32)}  # the scalar optimizer
  if not small:
    tree.update({
        "wide": rng.normal(size=(6, 20)).astype(np.float32),  # compressed, transposed
        "heads": rng.normal(size=(8, 2, 5)).astype(np.float32),  # 3-D: (8, 10) by fan_in
        "small": rng.normal(size=(3, 4)).astype(np.float32),  # not worth compressing: dense
        "embedding": rng.normal(size=(12, 4)).astype(np.float32),  # the scalar optimizer
        "count": np.arange(3, dtype=np.int32)})  # passes through
  return tree


def fan_in(path, leaf):
  return 1 if "heads" in path else jaxcomp.dion_fan_in(path, leaf)


def gradients(steps, seed=1, small=False):
  rng = np.random.default_rng(seed)
  return [{k: rng.standard_normal((W,) + v.shape).astype(np.float32)
           if v.dtype == np.float32 else np.stack([v] * W) for k, v in params_tree(small).items()}
          for _ in range(steps)]


class RefDion:
  """Dion (Ahn et al. 2025, Alg. 1; microsoft/dion ``dion_update``, ``adamw_update``) on one device,
  float64, given the mean gradient. ``matrices``: name → (a, b), the leaf as fan-in × fan-out."""

  def __init__(self, params, qs, matrices, mu=0.95, b1=0.9, b2=0.95, eps=1e-8):
    self.x = {k: np.asarray(v, np.float64) for k, v in params.items() if v.dtype == np.float32}
    self.q = {k: np.asarray(qs[k], np.float64) for k in matrices}
    self.matrices, self.mu, self.b1, self.b2, self.eps = matrices, mu, b1, b2, eps
    self.m = {k: np.zeros(v.shape) for k, v in self.x.items()}  # Dion's M, or Adam's m
    self.v = {k: np.zeros(v.shape) for k, v in self.x.items() if k not in matrices}
    self.t = 0

  def step(self, mean):
    self.t += 1
    updates = {}
    for k, x in self.x.items():
      if k in self.matrices:
        a, b = self.matrices[k]
        B = (self.m[k] + mean[k]).reshape(a, b)
        t = a < b  # the power iteration on the long side
        B = B.T if t else B
        P = np.linalg.qr(B @ self.q[k])[0]
        R = B.T @ P
        M = B - (1 - self.mu) * P @ R.T
        self.m[k] = (M.T if t else M).reshape(x.shape)
        self.q[k] = R / (np.linalg.norm(R, axis=0) + self.eps)
        U = P @ self.q[k].T
        updates[k] = -LR * (math.sqrt(b / a) * (U.T if t else U).reshape(x.shape) + WD * x)
      else:
        g = mean[k]
        self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
        self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g**2
        m_hat, v_hat = self.m[k] / (1 - self.b1**self.t), self.v[k] / (1 - self.b2**self.t)
        updates[k] = -SLR * (m_hat / (np.sqrt(v_hat) + self.eps) + SWD * x)
      self.x[k] = x + updates[k]
    return updates


def make(**settings):
  return jaxcomp.dion(LR, weight_decay=WD, scalar_learning_rate=SLR, scalar_weight_decay=SWD,
                      fan_in=fan_in, **settings)


def run_data_parallel(tx, grads_per_step):
  """The same steps under ``jaxcomp.data_parallel``'s per-device-step form (shard_map, check_vma);
  the parameters after each step."""
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])

  def step(state, grads):
    params, opt_state = state
    updates, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state, params)
    # The int leaf's "update" is its gradient passed through, which differs between devices.
    params = jax.tree.map(lambda p, u: p + u if p.dtype == jnp.float32 else p, params, updates)
    return (params, opt_state), ()

  dp = jaxcomp.data_parallel(step, mesh)
  state = dp.make_state((params_tree(), tx.init(params_tree())))
  params = []
  for grads in grads_per_step:
    state, _ = dp.step(state, *dp.shard((grads,)))
    params.append(jax.block_until_ready(state[0]))
  return params


MATRICES = {"tall": (24, 10), "wide": (6, 20), "heads": (8, 10), "small": (3, 4)}


@pytest.mark.parametrize("rank", [2, None])  # None: full rank (rank_fraction=1), all dense
def test_matches_the_reference_on_the_mean_gradient(rank):
  small = rank is None  # at full rank: pmap only, on two leaves
  grads = gradients(3, small=small)
  tx = make(rank=2) if rank else make(rank_fraction=1.0)
  state = tx.init(params_tree(small))
  # compressed?
  assert isinstance(state.by_leaf("momentum")["tall"], jax.Array) == (rank is not None)
  qs = state.by_leaf("q")
  ref = RefDion(params_tree(small), qs, {k: MATRICES[k] for k in qs if k in MATRICES})
  if small:  # under pmap: the updates
    outs, _ = run_applied_updates(tx, grads, params_tree(small), W)
    for g, out in zip(grads, outs):
      want = ref.step({k: v.astype(np.float64).mean(0) for k, v in g.items()})
      assert_identical_across_devices(out)
      for k, expected in want.items():
        np.testing.assert_allclose(out[k][0], expected, **rounding_tol(2000, LR), err_msg=k)
  else:  # under data_parallel (shard_map, check_vma): the parameters
    # r(a + b) ≥ ab: dense.
    assert isinstance(state.by_leaf("momentum")["small"], optax.MaskedNode)
    for g, params in zip(grads, run_data_parallel(tx, grads)):
      ref.step({k: v.astype(np.float64).mean(0) for k, v in g.items()})
      for k, want in ref.x.items():
        np.testing.assert_allclose(params[k], want, **rounding_tol(2000), err_msg=k)
      np.testing.assert_array_equal(params["count"], params_tree()["count"])


def test_at_full_rank_the_update_is_the_orthonormal_factor_of_the_mean_momentum():
  # μ = 1 keeps the momentum at the first step's mean gradient (nothing is fed back), and the
  # warm-started power iteration converges to its singular vectors: the update becomes
  # −lr·√(b/a)·UVᵀ, Muon's ideal orthonormalisation (its polar factor).
  rng = np.random.default_rng(2)
  u, _ = np.linalg.qr(rng.normal(size=(12, 6)))
  v, _ = np.linalg.qr(rng.normal(size=(6, 6)))
  mean = (u * 0.5 ** np.arange(6)) @ v.T  # singular values 1, 1/2, …
  noise = rng.normal(size=(W, 12, 6))
  first = {"w": (mean + noise - noise.mean(0)).astype(np.float32)}
  zero = {"w": np.zeros((W, 12, 6), np.float32)}
  tx = jaxcomp.dion(LR, rank_fraction=1.0, mu=1.0, weight_decay=0.0)
  outs, _ = run_applied_updates(tx, [first] + [zero] * 40, {"w": np.zeros((12, 6), np.float32)},
                                W)
  polar = u @ v.T
  np.testing.assert_allclose(outs[-1]["w"][0], -LR * math.sqrt(6 / 12) * polar, rtol=0,
                             atol=1e-5 * LR)
  direction = np.asarray(outs[-1]["w"][0], np.float64) / (-LR * math.sqrt(6 / 12))
  np.testing.assert_allclose(direction.T @ direction, np.eye(6), atol=1e-5)  # orthonormal


def test_lion_is_optax_lion_on_the_mean_of_the_scalar_leaves():
  grads = gradients(3, small=True)
  tx = jaxcomp.dion(LR, rank=2, scalar_optimizer="lion", scalar_learning_rate=SLR,
                    scalar_weight_decay=SWD, b1=0.9, b2=0.99)
  lion = optax.lion(SLR, b1=0.9, b2=0.99, weight_decay=SWD)
  params = {"bias": params_tree()["bias"]}
  lion_state = lion.init(params)
  outs, _ = run_applied_updates(tx, grads, params_tree(small=True), W)
  for g, out in zip(grads, outs):
    want, lion_state = lion.update({"bias": g["bias"].mean(0)}, lion_state, params)
    params = optax.apply_updates(params, want)
    np.testing.assert_allclose(out["bias"][0], want["bias"], **rounding_tol(64, SLR))


def test_bytes_are_the_factors_and_the_dense_means_in_two_all_reduces():
  tx = make(rank=2)
  grads = gradients(1)[0]
  state = replicate(tx.init(params_tree()), W)
  report = jaxcomp.comm_report(pmapped_update(tx, W),
                               grads, state, replicate(params_tree(), W), num_devices=W)
  factors = 2 * (24 + 10) + 2 * (6 + 20) + 2 * (8 + 10)  # r·(a + b) per compressed matrix
  dense = 3 * 4 + 10 + 12 * 4  # the uncompressed matrix, the bias, the embedding
  assert report.bytes_by_dtype() == {"f32": 4 * (factors + dense)}
  assert sorted(c.op for c in report.collectives) == ["all-reduce", "all-reduce"]
  assert report.payload_bytes == 4 * (factors + dense)


def test_a_non_finite_step_keeps_the_state_and_gives_nan_on_every_device():
  grads = gradients(4, small=True)
  grads[2]["tall"][3, 3, 1] = np.inf
  outs, states = run_applied_updates(make(rank=2), grads, params_tree(small=True), W)
  assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(outs[2]))
  jax.tree.map(np.testing.assert_array_equal, states[2], states[1])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(outs[3]))


def test_a_chained_optimizer_missing_params_and_bad_settings_are_refused():
  grads = {"w": jnp.ones((8, 8))}
  tx = jaxcomp.dion(LR, axis_name=None)
  with pytest.raises(ValueError, match=r"jaxcomp.dion is followed in an optax.chain"):
    chained = optax.chain(tx, optax.sgd(0.1))  # found from the state, by jaxcomp.check
    jaxcomp.check(chained.update, grads, chained.init(grads), grads)
  with pytest.raises(ValueError, match=r"weight decay needs the parameters"):
    jax.eval_shape(tx.update, grads, tx.init(grads))
  no_decay = jaxcomp.dion(LR, weight_decay=0.0, axis_name=None)
  jax.eval_shape(no_decay.update, grads, no_decay.init(grads))  # no decay: no params needed
  with pytest.raises(ValueError, match=r"rank or rank_fraction, not both"):
    jaxcomp.dion(LR, rank=2, rank_fraction=0.5)
  with pytest.raises(ValueError, match=r"scalar_optimizer must be 'adamw' or 'lion'"):
    jaxcomp.dion(LR, scalar_optimizer="sgd")
  with pytest.raises(ValueError, match=r"fan_in\(\"\['w'\]\", ...\) must be None or the number"):
    jaxcomp.dion(LR, fan_in=lambda path, leaf: 2).init(grads)


def test_hyperparameters_may_be_injected_and_the_learning_rate_a_schedule():
  grads = gradients(1, small=True)[0]
  params = replicate(params_tree(small=True), W)
  settings = dict(weight_decay=WD, scalar_learning_rate=SLR, scalar_weight_decay=SWD, rank=2)

  def one_step(tx, taken=0):  # from a fresh state that has taken ``taken`` steps
    state = replicate(jax.jit(tx.init)(params_tree(small=True)), W)
    state = state._replace(count=state.count + taken)
    return pmapped_update(tx, W)(
        grads, state, params)[0]

  fixed = one_step(jaxcomp.dion(LR, mu=0.9, **settings))
  injected = one_step(optax.inject_hyperparams(jaxcomp.dion, static_args=("rank", "seed"))(
      learning_rate=LR, mu=0.9, **settings))
  # A schedule is called with the steps taken: 2·LR at step 1, twice the update of LR (the bias
  # follows scalar_learning_rate, a number here).
  twice = one_step(jaxcomp.dion(lambda t: LR * (t + 1.0), mu=0.9, **settings), taken=1)
  for k in ("tall", "bias"):
    np.testing.assert_allclose(injected[k], fixed[k], rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(twice["tall"], 2 * np.asarray(fixed["tall"]), rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(twice["bias"], fixed["bias"], rtol=1e-6, atol=1e-9)


class Model(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(10, 6, rngs=rngs)
    self.hidden = nnx.Linear(6, 16, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, tokens):
    return self.out(nnx.relu(self.hidden(self.embed(tokens))))


def test_nnx_optimizer_gives_the_parameters_of_plain_arrays():
  tx = jaxcomp.dion(LR, rank=2)
  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state = tx.init(params)
  assert not isinstance(state.by_leaf("momentum")["hidden"]["kernel"], optax.MaskedNode)  # matrix
  assert isinstance(state.by_leaf("q")["embed"]["embedding"], optax.MaskedNode)  # scalar opt.'s

  def step(nnx_state, plain, grads):
    model, optimizer = nnx_state
    nnx_grads = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(nnx_grads, grads)
    optimizer.update(model, nnx_grads)
    updates, opt_state = tx.update(grads, plain[1], plain[0])
    return (model, optimizer), (optax.apply_updates(plain[0], updates), opt_state)

  step = pmapped(step, W)
  nnx_state, plain = replicate((model, optimizer), W), replicate((params, state), W)
  rng = np.random.default_rng(0)
  for _ in range(3):
    grads = jax.tree.map(lambda p: rng.normal(size=(W,) + np.shape(p)).astype(np.float32), params)
    nnx_state, plain = step(nnx_state, plain, grads)
  got = nnx.to_pure_dict(nnx.state(nnx_state[0], nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, got, plain[0])
  assert_identical_across_devices(plain[0])


def test_resumes_from_an_orbax_checkpoint_bitwise(tmp_path):
  grads = gradients(4, small=True)
  tx = make(rank=2)
  outs, states = run_applied_updates(tx, grads, params_tree(small=True), W)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", states[1])
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                             states[1]))
  assert type(restored) is type(states[1])
  params = replicate(params_tree(small=True), W)
  for out in outs[:2]:
    params = jax.tree.map(lambda p, u: p + np.asarray(u), params, out)
  resumed, _ = run_applied_updates(tx, grads[2:], jax.tree.map(lambda p: p[0], params), W,
                                   restored)
  for got, want in zip(resumed, outs[2:]):
    jax.tree.map(np.testing.assert_array_equal, got, want)
