"""guard: ``jaxcomp.skip_if_nonfinite``, ``optax.apply_if_finite`` for chains that communicate:
every device skips or applies the step together, from one all-device flag."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from chain_harness import W, grads, params, powersgd_chain, run
from helpers import (assert_identical_across_devices, pmapped_update, replicate, rounding_tol,
                     run_updates)


def test_skip_if_nonfinite_skips_on_every_device_together_and_keeps_the_inner_state():
  tx = jaxcomp.skip_if_nonfinite(powersgd_chain(), 3)
  _, before = run(tx, [grads(1)])
  out, after = run(tx, [grads(2, nan_on=2)], state=before)
  np.testing.assert_array_equal(out["w"], 0)  # the update is zero everywhere
  np.testing.assert_array_equal(out["b"], 0)
  np.testing.assert_array_equal(after.notfinite_count, 1)
  np.testing.assert_array_equal(after.last_finite, False)
  chex.assert_trees_all_equal(after.inner_state, before.inner_state)  # error, Q, momentum kept
  out, again = run(tx, [grads(3)], state=after)  # a finite step applies and resets the count
  assert np.isfinite(np.asarray(out["w"])).all() and np.abs(np.asarray(out["w"])).max() > 0
  assert_identical_across_devices(out)
  np.testing.assert_array_equal(again.notfinite_count, 0)
  np.testing.assert_array_equal(again.total_notfinite, 1)


def test_skip_if_nonfinite_counts_like_apply_if_finite():
  # At world size 1 the two decide alike: same updates and counters over a run of NaN steps that
  # exceeds max_consecutive_errors.
  inner = lambda: optax.sgd(0.1, momentum=0.9)
  ours = jaxcomp.skip_if_nonfinite(inner(), 2, axis_name=None)
  theirs = optax.apply_if_finite(inner(), 2)
  p = {"w": jnp.ones(3)}
  ours_state, theirs_state = ours.init(p), theirs.init(p)
  for value in [1.0, np.nan, np.nan, np.nan, 2.0, np.inf, 3.0]:
    g = {"w": jnp.full(3, value)}
    ours_out, ours_state = ours.update(g, ours_state)
    theirs_out, theirs_state = theirs.update(g, theirs_state)
    chex.assert_trees_all_equal(ours_out, theirs_out)
    for field in ("notfinite_count", "last_finite", "total_notfinite"):
      np.testing.assert_array_equal(getattr(ours_state, field), getattr(theirs_state, field))
    chex.assert_trees_all_equal(ours_state.inner_state, theirs_state.inner_state)


@pytest.mark.numeric
def test_under_pmap_it_decides_as_apply_if_finite_after_the_mean_and_lets_the_last_error_through():
  """Around the mean, the same decisions, updates and counters as ``optax.apply_if_finite`` after
  it (where every device sees the same mean), on every device: a NaN on one device skips the step
  everywhere, up to ``max_consecutive_errors`` in a row; the next non-finite step is applied."""
  inner = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
  ours = jaxcomp.skip_if_nonfinite(optax.chain(jaxcomp.allreduce(), inner()), 2)
  theirs = optax.chain(jaxcomp.allreduce(), optax.apply_if_finite(inner(), 2))
  nan_on = [None, 1, None, 2, 3, 0]  # the last is the third non-finite step in a row: applied
  steps = [grads(seed, nan) for seed, nan in enumerate(nan_on)]
  ours_out, ours_states = run_updates(ours, steps, W)
  theirs_out, theirs_states = run_updates(theirs, steps, W)
  for t, (a, b, s, r) in enumerate(zip(ours_out, theirs_out, ours_states, theirs_states)):
    assert_identical_across_devices(a)
    # Two programs: the mean of W unit-scale terms and a momentum step or two.
    chex.assert_trees_all_close(a, b, **rounding_tol(W + 2 * t))
    for field in ("notfinite_count", "last_finite", "total_notfinite"):
      np.testing.assert_array_equal(getattr(s, field), getattr(r[1], field), err_msg=field)
  skipped = [bool((np.asarray(out["w"]) == 0).all()) for out in ours_out]
  assert skipped == [False, True, False, True, True, False]
  let_through = np.asarray(ours_out[-1]["w"])  # the mean, NaN where device 0's gradient is
  assert np.isnan(let_through[:, 0, 0]).all() and np.isfinite(let_through[:, 1:]).all()
  np.testing.assert_array_equal(ours_states[-1].notfinite_count, 3)
  np.testing.assert_array_equal(ours_states[-1].total_notfinite, 4)


def test_one_flag_is_sent_on_every_step_and_the_inner_collectives_only_where_it_applies():
  tx = jaxcomp.skip_if_nonfinite(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), 3)
  step = pmapped_update(tx, W)
  g, state = grads(), replicate(tx.init(params()), W)
  jax.block_until_ready(step(g, state))
  report = jaxcomp.comm_report(step, g, state)
  every_step = [c for c in report.collectives if not c.in_conditional]
  assert [(c.op, c.payload_bytes) for c in every_step] == [("all-reduce", 4)]
  inner = [c for c in report.collectives if c.in_conditional]
  assert sum(c.payload_bytes for c in inner) == 4 * (6 * 5 + 5)
  assert all("f32" in c.dtypes for c in inner)
