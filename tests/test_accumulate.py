"""``jaxcomp.accumulate``: k micro-steps equal one step on the k-times-larger batch, and the
collectives run once per k, in a conditional branch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import replicate, rounding_tol
from training import pmap_step, run

pytestmark = pytest.mark.numeric
W = 8
K = 4


def loss_fn(params, x, y):
  hidden = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] - y) ** 2)


def init_params():
  rng = np.random.default_rng(0)
  return {"w1": rng.normal(size=(5, 6)).astype(np.float32), "b1": np.zeros(6, np.float32),
          "w2": rng.normal(size=(6, 2)).astype(np.float32)}


def data(steps, per_device):
  rng = np.random.default_rng(1)
  return (rng.normal(size=(steps, W, per_device, 5)).astype(np.float32),
          rng.normal(size=(steps, W, per_device, 2)).astype(np.float32))


def train(tx, xs, ys):
  """The pmapped steps of ``tx`` on the batches ``xs``, ``ys`` (``training.run``): the last
  parameters and state, and every step's updates."""
  params = replicate(init_params(), W)
  params, opt_state, outputs = run(pmap_step(loss_fn, tx, W, returns="updates"), params,
                                   jax.pmap(tx.init)(params), len(xs), n_devices=W,
                                   batch=lambda t, n: (xs[t], ys[t]))
  return params, opt_state, [updates for _, _, updates in outputs]


INNERS = {
    "allreduce+momentum": lambda: optax.chain(jaxcomp.allreduce(), optax.sgd(0.1, momentum=0.9)),
    "fp16+adam": lambda: optax.chain(jaxcomp.fp16_compress(), optax.adam(0.01)),
    "powersgd+momentum": lambda: optax.chain(
        jaxcomp.powersgd(1, start_iter=1, min_compression_rate=1.0), optax.sgd(0.1, momentum=0.9)),
    "dgc": lambda: optax.chain(jaxcomp.dgc(0.2), optax.sgd(0.1)),
}


@pytest.mark.parametrize("inner", list(INNERS))
def test_k_micro_steps_equal_one_step_on_the_k_times_larger_batch(inner):
  big_steps, per_device = 3, 2
  xs, ys = data(big_steps * K, per_device)
  params, _, updates = train(jaxcomp.accumulate(INNERS[inner](), every_k=K), xs, ys)

  # The reference: each device sees its K micro-batches at once, one step per K micro-steps.
  big = lambda a: a.reshape(big_steps, K, W, per_device, -1).transpose(0, 2, 1, 3, 4).reshape(
      big_steps, W, K * per_device, -1)
  ref_params, _, _ = train(INNERS[inner](), big(xs), big(ys))
  # A different program (K means of 2 vs one mean of 2K, then W devices): unit-scale params agree
  # to a rounding per term of each step's reductions.
  chex.assert_trees_all_close(params, ref_params, **rounding_tol(big_steps * (K * per_device + W)))
  for i, u in enumerate(updates):  # the update is zero except on every K-th micro-step
    if i % K != K - 1:
      chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
    else:
      assert max(float(jnp.abs(v).max()) for v in jax.tree.leaves(u)) > 0


def test_the_accumulator_is_per_device_and_resets_after_communicating():
  xs, ys = data(K, 2)
  tx = jaxcomp.accumulate(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), every_k=K)
  _, state, _ = train(tx, xs[:1], ys[:1])
  assert isinstance(state, jaxcomp.AccumulateState)
  np.testing.assert_array_equal(state.micro_step, np.ones(W))
  grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(init_params(), xs[0], ys[0])
  # The pmapped step against vmap outside it: a rounding per term of the 2-sample, 6-wide
  # reductions, absolute on the scale of the terms (unit-scale inputs and weights): some gradients
  # cancel to ~1e-3.
  chex.assert_trees_all_close(state.acc, tuple(jax.tree.leaves(grads)), **rounding_tol(2 * 6))
  assert not np.allclose(state.acc[0][0], state.acc[0][1])  # devices hold their own sums
  _, state, _ = train(tx, xs, ys)
  np.testing.assert_array_equal(state.micro_step, np.zeros(W))
  chex.assert_trees_all_equal(state.acc, jax.tree.map(jnp.zeros_like, state.acc))


def _step_report(tx):
  params = replicate(init_params(), W)
  opt_state = jax.pmap(tx.init)(params)
  x, y = (a[0] for a in data(1, 2))
  return jaxcomp.comm_report(pmap_step(loss_fn, tx, W, returns="updates"), params, opt_state, x,
                             y)


def test_collectives_sit_in_the_branch_that_runs_once_per_k():
  inner = lambda: optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1))
  plain = _step_report(inner())
  accumulated = _step_report(jaxcomp.accumulate(inner(), every_k=K))
  assert plain.collectives and not any(c.phases for c in plain.collectives)
  assert accumulated.collectives and all(
      c.phases == (("accumulate.communicate", 1 / K),) for c in accumulated.collectives)
  # The step that communicates sends what the plain step sends; per micro-step, a k-th of it.
  assert accumulated.phase("accumulate.communicate").payload_bytes == plain.payload_bytes
  assert accumulated.payload_bytes == plain.payload_bytes / K
  assert set(accumulated.bytes_by_dtype()) == {"f16"}
  # optax.MultiSteps, by contrast, communicates on every micro-step: its collectives are
  # unconditional, and jaxcomp warns.
  with pytest.warns(UserWarning, match="optax.MultiSteps runs jaxcomp\."):
    multi = _step_report(optax.MultiSteps(inner(), every_k_schedule=K).gradient_transformation())
  assert multi.collectives and not any(c.in_conditional for c in multi.collectives)
  assert multi.payload_bytes == plain.payload_bytes


def test_integer_leaves_pass_through_and_are_not_accumulated():
  tx = jaxcomp.accumulate(jaxcomp.allreduce(axis_name=None), every_k=2)
  params = {"w": jnp.ones(3), "n": jnp.array(5, jnp.int32)}
  state = tx.init(params)
  assert isinstance(state.acc[0], optax.MaskedNode)  # "n" sorts before "w"
  grads = {"w": jnp.full(3, 2.0), "n": jnp.array(7, jnp.int32)}
  updates, state = tx.update(grads, state)
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(3), "n": jnp.array(0, jnp.int32)})
  updates, state = tx.update({"w": jnp.full(3, 4.0), "n": jnp.array(9, jnp.int32)}, state)
  chex.assert_trees_all_equal(updates, {"w": jnp.full(3, 3.0), "n": jnp.array(9, jnp.int32)})


def test_every_k_one_is_the_inner_transformation():
  xs, ys = data(3, 2)
  inner = lambda: optax.chain(jaxcomp.allreduce(), optax.sgd(0.1, momentum=0.9))
  # Two programs (the inner update inside a cond, or not): unit-scale params agree to rounding of
  # each step's reductions (2 samples, W devices); absolute, as b1 (from zero) is ~1e-3.
  chex.assert_trees_all_close(train(jaxcomp.accumulate(inner(), every_k=1), xs, ys)[0],
                              train(inner(), xs, ys)[0], **rounding_tol(len(xs) * (2 + W)))


@pytest.mark.parametrize("every_k, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                            (True, TypeError), ("4", TypeError)])
def test_every_k_is_validated(every_k, error):
  with pytest.raises(error, match=r"every_k must be a positive int; got"):
    jaxcomp.accumulate(optax.sgd(0.1), every_k=every_k)


def test_an_inner_that_is_not_a_gradient_transformation_is_refused():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    jaxcomp.accumulate(lambda g: g, every_k=2)


def test_changed_gradient_structure_is_reported():
  tx = jaxcomp.accumulate(optax.sgd(0.1), every_k=2)
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="changed between init and update"):
    tx.update({"w": jnp.ones(4)}, state)


def test_every_k_is_static_under_inject_hyperparams():
  inner = optax.sgd(0.1)
  with pytest.raises(TypeError, match=r"every_k is static: it fixes when the collectives run.*"
                     r"static_args=\('every_k',\)"):
    optax.inject_hyperparams(jaxcomp.accumulate)(inner, every_k=4).init({"w": np.zeros(3)})
  tx = optax.inject_hyperparams(jaxcomp.accumulate, static_args=("every_k",))(inner, every_k=2)
  state = tx.init({"w": np.zeros(3, np.float32)})
  for _ in range(2):
    out, state = tx.update({"w": np.ones(3, np.float32)}, state)
  np.testing.assert_allclose(out["w"], -0.1)
