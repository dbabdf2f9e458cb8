"""DGC's sampled top-k selection (``topk.sampled_topk``) against the reference's ``_sparsify``:
the same threshold and indices, never more than k values and at least 0.8·k, ties and zero
gradients, and its benchmark."""

import math

import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import topk

from dgc_reference import ref_sparsify
from helpers import assert_identical_across_devices, pmapped_update, replicate

pytestmark = pytest.mark.numeric
W = 4


@pytest.mark.parametrize("dist", ["gaussian", "heavy_tailed"])
def test_sampled_selection_matches_reference_and_stays_in_band(dist):
  n, density = 200_003, 0.001
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density)
  assert plan.num_samples < n  # the sampled path, not the exact one
  select = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key))
  rng = np.random.default_rng(3)
  for trial in range(12):
    x = (rng.standard_normal(n) if dist == "gaussian"
         else rng.standard_t(1.5, n)).astype(np.float32)
    key = jax.random.PRNGKey(trial)
    indices, threshold, finite = select(x, key)
    assert bool(finite)
    indices = np.asarray(indices)
    sent = indices[indices < n]
    start = int(jax.random.randint(key, (), 0, plan.stride))
    ref_indices, ref_threshold = ref_sparsify(x, density, start)
    assert float(threshold) == float(ref_threshold)
    np.testing.assert_array_equal(np.sort(sent), np.sort(ref_indices))
    assert len(sent) <= k and len(set(sent.tolist())) == len(sent)
    assert np.all(np.abs(x[sent]) >= threshold)
    assert 0.8 * k <= len(sent) <= k
    assert np.all(indices[len(sent):] == n)  # empty slots hold the out-of-range sentinel


def test_sampled_selection_resamples_and_handles_ties():
  n, density = 100_000, 0.001
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density)
  select = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key))
  rng = np.random.default_rng(4)
  # Half the entries tie at the top: far more than the candidate buffer, exact top-k fallback.
  x = np.where(rng.random(n) < 0.5, 1.0, rng.random(n) * 0.1).astype(np.float32)
  indices, threshold, _ = select(x, jax.random.PRNGKey(0))
  assert float(threshold) == 1.0 and np.all(np.asarray(indices) < n)
  assert np.all(x[np.asarray(indices)] == 1.0) and len(set(np.asarray(indices).tolist())) == k
  # A zero gradient: threshold 0, every entry a candidate, k distinct zeros sent.
  indices, threshold, _ = select(np.zeros(n, np.float32), jax.random.PRNGKey(0))
  assert float(threshold) == 0.0 and len(set(np.asarray(indices).tolist())) == k


def test_sampled_mode_never_sends_more_than_k_under_pmap():
  params = {"w": np.zeros((300, 200), np.float32), "b": np.zeros((200,), np.float32)}
  tx = jaxcomp.dgc(0.001)
  k = 60  # ceil(300 * 200 * 0.001)
  state = replicate(tx.init(params), W)
  update = pmapped_update(tx, W)
  rng = np.random.default_rng(5)
  for _ in range(5):
    grads = {key: rng.standard_normal((W,) + p.shape).astype(np.float32)
             for key, p in params.items()}
    before = np.asarray(state.v["w"]) + 0  # v after this step's accumulation is v + u
    out, new_state = jax.block_until_ready(update(grads, state))
    assert_identical_across_devices(out)
    accumulated = before + 0.9 * np.asarray(state.u["w"]) + grads["w"]
    for w in range(W):
      sent = np.flatnonzero((np.asarray(new_state.v["w"][w]) == 0) & (accumulated[w] != 0))
      assert 0.8 * k <= len(sent) <= k
    assert np.count_nonzero(out["w"][0]) <= W * k
    state = new_state


def test_selection_benchmark_runs_quick(capsys):
  from benchmarks import dgc_selection as benchmark
  assert benchmark.main(["--quick"]) == 0
  assert "speed-up of sampled over exact" in capsys.readouterr().out
