"""``diloco``: the paper's Algorithm 1 in NumPy step for step, its reduction to allreduce,
compressed pseudo-gradients, what it sends, and an orbax resume in the middle of a period."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomp
from helpers import assert_identical_across_devices, pmapped, replicate
from quantized_reference import ref_step
from jaxcomp.train.registry import REGISTRY
from test_local_sgd import batch, init_params, loss_fn, numpy_grad, pmap_run
from training import pmap_step, run

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

LR, MOMENTUM = 0.05, 0.9


def reference(steps, n, sync_every, outer_lr, outer_momentum, nesterov, average=None):
  """DiLoCo in float64 from the paper's Algorithm 1: SGD with momentum as InnerOpt on each device's
  own gradient; after every H inner steps Δ = mean_i(θ − θ_i) (or ``average([Δ_i])``, a compressed
  exchange), OuterOpt = SGD with (Nesterov) momentum on θ, and every θ_i ← θ."""
  theta = jax.tree.map(np.float64, init_params())
  params = [theta] * n
  momenta = [jax.tree.map(np.zeros_like, theta) for _ in range(n)]
  outer_momentum_buffer = jax.tree.map(np.zeros_like, theta)
  history = []
  for t in range(steps):
    x, y = batch(t, n)
    for i in range(n):
      g = numpy_grad(params[i], x[i].astype(np.float64), y[i])
      momenta[i] = jax.tree.map(lambda m, g: g + MOMENTUM * m, momenta[i], g)
      params[i] = jax.tree.map(lambda p, m: p - LR * m, params[i], momenta[i])
    if (t + 1) % sync_every == 0:
      deltas = [jax.tree.map(lambda th, q: th - q, theta, q) for q in params]
      delta = (average or (lambda d: jax.tree.map(lambda *x: np.mean(x, 0), *d)))(deltas)
      outer_momentum_buffer = jax.tree.map(lambda m, d: outer_momentum * m + d,
                                           outer_momentum_buffer, delta)
      step = (jax.tree.map(lambda d, m: d + outer_momentum * m, delta, outer_momentum_buffer)
              if nesterov else outer_momentum_buffer)
      theta = jax.tree.map(lambda th, s: th - outer_lr * s, theta, step)
      params = [theta] * n
    history.append(jax.tree.map(lambda *p: np.stack(p), *params))
  return history


def test_sync_every_1_outer_lr_1_no_momentum_is_allreduce_with_the_inner_optimizer():
  inner = optax.sgd(LR, momentum=MOMENTUM)  # linear in the gradient, so the mean commutes with it
  tx = jaxcomp.diloco(inner, sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0)
  dense = pmap_run(optax.chain(jaxcomp.allreduce(), inner), 20, 8)
  for got, expected in zip(pmap_run(tx, 20, 8), dense):
    assert_identical_across_devices(got)
    chex.assert_trees_all_close(got, expected, rtol=0, atol=1e-5)  # float32 rounding


@pytest.mark.parametrize("outer_lr, outer_momentum, nesterov",
                         [(0.7, 0.9, True), (0.5, 0.8, False), (1.0, 0.0, True)])
def test_matches_the_papers_algorithm_in_numpy_and_replicas_are_identical_after_outer_steps(
    outer_lr, outer_momentum, nesterov):
  steps, n, sync_every = 60, 4, 5
  tx = jaxcomp.diloco(optax.sgd(LR, momentum=MOMENTUM), sync_every=sync_every,
                      outer_learning_rate=outer_lr, outer_momentum=outer_momentum,
                      nesterov=nesterov)
  expected = reference(steps, n, sync_every, outer_lr, outer_momentum, nesterov)
  for t, (got, want) in enumerate(zip(pmap_run(tx, steps, n), expected)):
    # float32 against float64: a few roundings per step over 60 steps (12 outer steps).
    chex.assert_trees_all_close(got, want, rtol=0, atol=5e-5)
    if (t + 1) % sync_every == 0:
      assert_identical_across_devices(got)  # max |Δparam| = 0
    else:
      assert max(float(np.abs(np.diff(np.asarray(x), axis=0)).max())
                 for x in jax.tree.leaves(got)) > 0


def run_with_state(tx, steps, n=4, state=None, params=None, first=0):
  """``steps`` pmapped steps of ``tx`` from step ``first`` on the least-squares data
  (``training.run``): the parameters and the state after the last."""
  params = replicate(init_params(), n) if params is None else params
  state = replicate(tx.init(init_params()), n) if state is None else state
  params, state, _ = run(pmap_step(loss_fn, tx, n, returns=None), params, state, steps, first,
                         n_devices=n, batch=batch)
  return params, state


def test_fp16_pseudo_gradient_is_the_float32_one_to_float16_rounding():
  make = lambda compressor: jaxcomp.diloco(optax.sgd(LR, momentum=MOMENTUM), sync_every=4,
                                           compressor=compressor)
  exact, _ = run_with_state(make(None), 12)
  half, _ = run_with_state(make(jaxcomp.fp16_compress()), 12)
  assert_identical_across_devices(half)
  # The pseudo-gradients (smaller than θ) rounded to float16 over three outer steps: the result is
  # within one float16 ulp (2⁻¹⁰ relative) of the parameters' scale.
  scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(exact))
  chex.assert_trees_all_close(half, exact, rtol=0, atol=2**-10 * scale)
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(half), jax.tree.leaves(exact))) > 0


def test_powersgd_keeps_its_error_feedback_across_outer_steps_and_runs_only_at_them():
  tx = jaxcomp.diloco(optax.sgd(LR), sync_every=3,
                      compressor=jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0))
  params, state = run_with_state(tx, 6)  # outer steps after steps 2 and 5
  assert_identical_across_devices(params)
  assert np.asarray(state.compressor_state.count).tolist() == [2] * 4
  error = np.asarray(state.compressor_state.by_leaf("error")["w"])
  assert np.abs(error).max() > 0 and np.abs(np.diff(error, axis=0)).max() > 0  # per device
  _, later = run_with_state(tx, 1, state=state, params=params, first=6)  # an inner step
  chex.assert_trees_all_equal(later.outer_params, state.outer_params)
  chex.assert_trees_all_equal(later.compressor_state, state.compressor_state)


def test_sends_the_parameters_once_per_outer_step_amortised_by_the_registry():
  """One f32 all-reduce of the parameters' size, in the branch of the outer step; nothing else."""
  params = init_params()
  numel = sum(x.size for x in jax.tree.leaves(params))

  def report(tx):
    step = pmapped(lambda p, s, g: tx.update(g, s, p), 4)
    return jaxcomp.comm_report(step, replicate(params, 4), replicate(tx.init(params), 4),
                               replicate(params, 4), num_devices=4)

  entry = REGISTRY["diloco_h20"]
  sync = report(entry.make(inner=optax.sgd(LR)))
  assert [(c.op, set(c.dtypes), c.phase) for c in sync.collectives] == [
      ("all-reduce", {"f32"}, "diloco.sync")]  # one all-reduce of the leaves (XLA combines them)
  assert sync.phase("diloco.sync").payload_bytes == 4 * numel
  dense = report(REGISTRY["allreduce"].make())
  assert entry.bytes_per_step(sync) == entry.bytes_per_step(sync, "ring_bytes") == (
      dense.ring_bytes / 20)
  assert entry.bytes_per_step(sync, "payload_bytes") == 4 * numel / 20


def test_orbax_resume_in_the_middle_of_a_period_is_bit_identical(tmp_path):
  tx = jaxcomp.diloco(optax.adam(0.01), sync_every=5,
                      compressor=jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0))
  full_params, full_state = run_with_state(tx, 13)
  params, state = run_with_state(tx, 7)  # two inner steps into the second period
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", jax.device_get({"params": params, "state": state}))
  checkpointer.wait_until_finished()
  target = jax.tree.map(jnp.zeros_like, {"params": params, "state": state})
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  params, state = run_with_state(tx, 6, state=restored["state"], params=restored["params"], first=7)
  chex.assert_trees_all_equal(params, full_params)
  chex.assert_trees_all_equal(state, full_state)


def test_full_rank_powersgd_on_the_pseudo_gradient_is_the_exact_mean():
  """Rank ≥ min(n, m): P̂ spans the mean's columns, so P̂·P̂ᵀ·mean(Δ) is mean(Δ) to rounding."""
  inner = optax.sgd(LR, momentum=MOMENTUM)
  exact, _ = run_with_state(jaxcomp.diloco(inner, sync_every=4), 12)
  full_rank = jaxcomp.powersgd(8, start_iter=0, min_compression_rate=0.0)
  compressed, _ = run_with_state(jaxcomp.diloco(inner, sync_every=4, compressor=full_rank), 12)
  chex.assert_trees_all_close(compressed, exact, rtol=0, atol=1e-5)


def test_muloco_is_diloco_with_a_2_bit_decaying_error_exchange_step_for_step():
  """The registry's ``muloco`` (MuLoCo's recipe, its inner optimizer whatever is passed: SGD with
  momentum here, where the paper's is Muon) against the paper's pseudo-code in NumPy: after every H
  inner steps, per device e ← β·e + Δ_i, Δ̂_i = Q(e), e ← e − Δ̂_i (β = 0.9, Q: ``quantized(2)``'s
  ternary codes, the reference's two-phase exchange with its server error), then the outer
  Nesterov step (0.8, 0.9) on the mean."""
  steps, n, sync_every = 30, 4, 5
  size = 6 + 8 * 6  # the bias, then the kernel (IN, OUT = 8, 6)
  errors = {"worker": np.zeros((n, size), np.float32), "server": np.zeros((n, size), np.float32)}

  def average(deltas):  # the leaves of each device's Δ_i as one flat vector (leaf order: b, w)
    flat = np.stack([np.concatenate([d["b"].ravel(), d["w"].ravel()]) for d in deltas])
    mean, errors["worker"], errors["server"], _, _ = ref_step(
        flat.astype(np.float32), errors["worker"], errors["server"], 256, 2, decay=0.9)
    return {"b": mean[:6].astype(np.float64), "w": mean[6:].reshape(8, 6).astype(np.float64)}

  tx = REGISTRY["muloco"].make(inner=optax.sgd(LR, momentum=MOMENTUM), sync_every=sync_every)
  expected = reference(steps, n, sync_every, 0.8, 0.9, True, average)
  got = run_with_state(tx, steps, n)[0]
  chex.assert_trees_all_close(got, expected[-1], rtol=0, atol=5e-5)
  assert_identical_across_devices(got)
  exact = reference(steps, n, sync_every, 0.8, 0.9, True)[-1]
  assert max(float(np.abs(exact[k] - np.asarray(got[k])).max()) for k in got) > 1e-3  # 2 bits
