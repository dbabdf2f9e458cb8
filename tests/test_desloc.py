"""``desloc``: the paper's Algorithm 1 in NumPy step for step (Local AdamW with the parameters, the
first and the second moment averaged on three periods), its reduction to Local Adam, its three
phases in ``comm_report``, and its refusals. The registry's ``desloc`` runs through every
registry-wide test (pmap, shard_map, data_parallel, faults, resume), and ``test_local_steps.py``'s
(the local non-finite policy, nnx, both data_parallel forms) as every optimizer that owns the
parameters does."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp._src import desloc
from helpers import assert_identical_across_devices, pmapped, replicate
from test_local_sgd import batch, init_params, numpy_grad, pmap_run

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

LR, B1, B2, EPS, DECAY = 0.02, 0.9, 0.95, 1e-8, 0.1


def reference(steps, n, kx, ku, kv):
  """DES-LOC in float64 from the paper's Algorithm 1, with optax's AdamW on each device's own
  gradient: u ← β₁u + (1 − β₁)g, v ← β₂v + (1 − β₂)g², x ← x − η(û/(√v̂ + ε) + λx) (û, v̂ the
  bias-corrected moments); then after the steps t with (t + 1) % K == 0, x averaged over the devices
  for K = Kx, u for K = Ku, v for K = Kv."""
  x = [jax.tree.map(np.float64, init_params()) for _ in range(n)]
  u = [jax.tree.map(np.zeros_like, x[0]) for _ in range(n)]
  v = [jax.tree.map(np.zeros_like, x[0]) for _ in range(n)]
  mean = lambda trees: jax.tree.map(lambda *a: np.mean(a, 0), *trees)  # noqa: E731
  history = []
  for t in range(steps):
    inputs, targets = batch(t, n)
    for i in range(n):
      g = numpy_grad(x[i], inputs[i].astype(np.float64), targets[i])
      u[i] = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, u[i], g)
      v[i] = jax.tree.map(lambda m, g: B2 * m + (1 - B2) * g * g, v[i], g)
      x[i] = jax.tree.map(
          lambda p, m, s: p - LR * ((m / (1 - B1 ** (t + 1))) / (np.sqrt(s / (1 - B2 ** (t + 1)))
                                                                  + EPS) + DECAY * p),
          x[i], u[i], v[i])
    for state, period in ((x, kx), (u, ku), (v, kv)):
      if (t + 1) % period == 0:
        state[:] = [mean(state)] * n
    history.append(jax.tree.map(lambda *p: np.stack(p), *x))
  return history


def adamw():
  return optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=DECAY)


@pytest.mark.parametrize("kx, ku, kv", [(2, 6, 12), (3, 3, 3), (4, 8, 8)])
def test_matches_the_papers_algorithm_in_numpy_step_for_step(kx, ku, kv):
  steps, n = 24, 4
  tx = jaxcomp.desloc(adamw(), param_sync_every=kx, first_moment_sync_every=ku,
                      second_moment_sync_every=kv)
  expected = reference(steps, n, kx, ku, kv)
  for t, (got, want) in enumerate(zip(pmap_run(tx, steps, n), expected)):
    # float32 against float64: Adam's division and 24 steps of it.
    chex.assert_trees_all_close(got, want, rtol=0, atol=2e-5)
    if (t + 1) % kx == 0:
      assert_identical_across_devices(got)
    else:
      assert float(np.abs(np.diff(np.asarray(got["w"]), axis=0)).max()) > 0
  # The moments matter: averaging only the parameters (Kx, never the moments) ends elsewhere.
  apart = reference(steps, n, kx, 10**6, 10**6)[-1]
  assert (ku, kv) == (10**6,) * 2 or float(np.abs(apart["w"] - expected[-1]["w"]).max()) > 1e-6


def test_the_moments_are_averaged_on_their_own_periods():
  """Kx = 2, Ku = 3, Kv = 6, each device its own gradient: after step t (0-based) the parameters
  are the same everywhere exactly when 2 divides t + 1, the first moments when 3 does, the second
  moments when 6 does."""
  tx = jaxcomp.desloc(adamw(), param_sync_every=2, first_moment_sync_every=3,
                      second_moment_sync_every=6)
  step = pmapped(lambda p, s, g: tx.update(g, s, p), 4)
  params, state = replicate(init_params(), 4), replicate(tx.init(init_params()), 4)
  rng = np.random.default_rng(0)
  for t in range(6):
    grads = jax.tree.map(lambda x: rng.normal(size=(4,) + x.shape[1:]).astype(np.float32), params)
    updates, state = step(params, state, grads)
    params = optax.apply_updates(params, updates)
    mu, nu = (np.asarray(desloc._moment(state.inner_state, field)[0]["w"])
              for field in ("mu", "nu"))
    assert (np.abs(np.diff(mu, axis=0)).max() == 0) == ((t + 1) % 3 == 0), t
    assert (np.abs(np.diff(nu, axis=0)).max() == 0) == ((t + 1) % 6 == 0), t
    assert (np.abs(np.diff(np.asarray(params["w"]), axis=0)).max() == 0) == ((t + 1) % 2 == 0)


def test_comm_report_shows_the_three_periods_as_phases():
  params = init_params()
  numel = sum(x.size for x in jax.tree.leaves(params))
  tx = jaxcomp.desloc(adamw(), param_sync_every=4, first_moment_sync_every=12,
                      second_moment_sync_every=24)
  step = pmapped(lambda p, s, g: tx.update(g, s, p), 4)
  report = jaxcomp.comm_report(step, replicate(params, 4), replicate(tx.init(params), 4),
                               replicate(params, 4), num_devices=4)
  assert report.phase_names == ("desloc.params", "desloc.first_moment", "desloc.second_moment")
  for name, share in zip(report.phase_names, (1 / 4, 1 / 12, 1 / 24)):
    phase = report.phase(name)
    assert phase.bytes_by_dtype() == {"f32": 4 * numel}
    assert all(c.share == share for c in report.collectives if c.phase == name)
  assert report.payload_bytes == pytest.approx(4 * numel * (1 / 4 + 1 / 12 + 1 / 24))
  # Against Local Adam at the same Kx (all three every 4 steps): half the bytes, the paper's 2×.
  local_adam = jaxcomp.desloc(adamw(), param_sync_every=4, first_moment_sync_every=4,
                              second_moment_sync_every=4)
  local_step = pmapped(lambda p, s, g: local_adam.update(g, s, p), 4)
  both = jaxcomp.comm_report(local_step, replicate(params, 4),
                             replicate(local_adam.init(params), 4), replicate(params, 4),
                             num_devices=4)
  assert both.payload_bytes == pytest.approx(2 * report.payload_bytes)


def test_refuses_an_inner_optimizer_without_adam_moments_and_periods_out_of_order():
  with pytest.raises(ValueError, match="no Adam moments.*optax.adamw"):
    jaxcomp.desloc(optax.sgd(0.1), param_sync_every=2, first_moment_sync_every=2,
                   second_moment_sync_every=2).init(init_params())
  with pytest.raises(ValueError, match="first_moment_sync_every must be at least "
                                       "param_sync_every \\(4\\)"):
    jaxcomp.desloc(adamw(), param_sync_every=4, first_moment_sync_every=2,
                   second_moment_sync_every=8)
  with pytest.raises(TypeError, match="second_moment_sync_every"):
    jaxcomp.desloc(adamw(), param_sync_every=4, first_moment_sync_every=4,
                   second_moment_sync_every=8.5)
  # Adam inside a chain (clipping first, as the paper's ĝ = clip(g, ρ)) is found there.
  chained = optax.chain(optax.clip_by_global_norm(1.0), adamw())
  jaxcomp.desloc(chained, param_sync_every=2, first_moment_sync_every=2,
                 second_moment_sync_every=2).init(init_params())
