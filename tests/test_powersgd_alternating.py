"""PowerSGD's alternating variant (epfml's BasicPowerSGD, ``alternating=True``) against its NumPy
reference, and the one all-reduce each of its steps sends."""


import chex
import jax
import numpy as np
import pytest

import jaxcomp
from helpers import assert_identical_across_devices, pmapped_update, replicate
from powersgd_reference import W, device, grads_for, named, np_alternating_step, params_mixed

pytestmark = pytest.mark.numeric


def powersgd_ratio(state):
  return jaxcomp.powersgd_stats(device(state, 0))[0]


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_alternating_matches_numpy_reference(rank):
  """epfml's variant across the start iteration: Qs sent on even compressed steps, Ps on odd
  ones."""
  params = params_mixed()
  tx = jaxcomp.powersgd(rank, start_iter=2, alternating=True)
  state = replicate(tx.init(params), W)
  step = pmapped_update(tx, W)
  rng = np.random.default_rng(10 + rank)
  float_keys = [k for k, v in named(params).items() if v.dtype == np.float32]
  errors = [{k: 0.0 for k in float_keys} for _ in range(W)]
  for t in range(6):
    grads = grads_for(params, rng)
    ps, qs = ({k: v[0] for k, v in named(state.by_leaf(f)).items()} for f in ("p", "q"))
    out, state = jax.block_until_ready(step(grads, state))
    assert_identical_across_devices((out, state.p, state.q, state.count))
    per_device = [{k: v for k, v in named(device(grads, d)).items() if k in float_keys}
                  for d in range(W)]
    if t < 2:  # plain mean, factors untouched
      expected = {k: np.mean([g[k] for g in per_device], axis=0) for k in float_keys}
      chex.assert_trees_all_equal(ps, {k: v[0] for k, v in named(state.by_leaf("p")).items()})
    else:
      expected, errors, new_ps, new_qs = np_alternating_step(per_device, errors, ps, qs, t - 2,
                                                             rank=rank)
      for got, want in (("p", new_ps), ("q", new_qs)):
        for k, factor in named(state.by_leaf(got)).items():
          np.testing.assert_allclose(factor[0], want[k], rtol=1e-4, atol=1e-5, err_msg=(t, k))
    got = named(out)
    for k in float_keys:
      np.testing.assert_allclose(got[k][0], expected[k], rtol=1e-4, atol=1e-5, err_msg=(t, k))
    for d in range(W):
      for k, e in named(device(state.by_leaf("error"), d)).items():
        np.testing.assert_allclose(e, errors[d][k], rtol=1e-4, atol=1e-5, err_msg=(t, d, k))
  assert powersgd_ratio(state) > 1


def test_alternating_sends_one_all_reduce_per_step():
  """comm_report: one all-reduce per step: the uncompressed leaves with the
  Qs (phase "even" of the compressed steps) or with the Ps ("odd"); the steady state averages the
  two."""
  params = {"conv": np.zeros((3, 3, 4, 16), np.float32), "dense": np.zeros((64, 32), np.float32),
            "bias": np.zeros(32, np.float32)}
  rank, n_dev = 2, 8
  tx = jaxcomp.powersgd(rank, start_iter=0, alternating=True)
  grads = grads_for(params, np.random.default_rng(0), n_dev)
  report = jaxcomp.comm_report(pmapped_update(tx, n_dev), grads, replicate(tx.init(params), n_dev))
  dense, qs, ps = 4 * 32, 4 * rank * (16 + 32), 4 * rank * (36 + 64)
  assert all(c.op == "all-reduce" for c in report.collectives)
  assert report.phase_names == ("powersgd.compressed", "powersgd.compressed/powersgd.even",
                                "powersgd.compressed/powersgd.odd")
  # No finiteness flag: the step reads it from the sums it sends.
  assert [c.payload_bytes for c in report.collectives if c.phase == ""] == []
  even, odd = report.phase("powersgd.even"), report.phase("powersgd.odd")
  assert sorted(c.payload_bytes for c in even.collectives) == [dense + qs]
  assert sorted(c.payload_bytes for c in odd.collectives) == [dense + ps]
  assert report.payload_bytes == dense + (qs + ps) / 2
  # torch's variant sends the same factors in one step, in two sequential all-reduces.
  torch_tx = jaxcomp.powersgd(rank, start_iter=0)
  torch_report = jaxcomp.comm_report(pmapped_update(torch_tx, n_dev), grads,
                                     replicate(torch_tx.init(params), n_dev))
  assert torch_report.payload_bytes == dense + qs + ps
  assert len(torch_report.collectives) == 2
