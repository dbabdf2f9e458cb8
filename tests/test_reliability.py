"""Faults survived, replicas never drift, resume is exact — for every compressor.

Local SGD and DiLoCo let replicas differ between synchronizations by design: they are compared right
after one, where they must be bitwise identical, and resumed mid-period.
"""

import pathlib
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest

from compressors import ALGORITHMS, synced_leaves
from training import W, make_step, mean_losses, run, start

WORKER = pathlib.Path(__file__).parent / "workers" / "resume.py"


def max_drift(params, which):
  """max |param on device d - param on device 0| over the leaves ``which`` selects, all devices."""
  return max(float(np.abs(np.asarray(x) - np.asarray(x)[:1]).max())
             for x, chosen in zip(jax.tree.leaves(params), which) if chosen)


def all_finite(tree):
  return all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(tree)
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_2000_steps_with_random_faults_never_drift_or_poison_the_state(name):
  rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same faults on every run
  faults = [(int(s), int(d), float(v)) for s, d, v in zip(
      rng.choice(2000, size=25, replace=False), rng.integers(0, W, 25),
      rng.choice([np.nan, np.inf, -np.inf], 25))]
  tx, pstep = make_step(name)
  params, opt_state = start(tx)
  num_leaves = len(jax.tree.leaves(params))
  synced_after = lambda step: synced_leaves(name, opt_state, step, num_leaves)
  losses = []
  for hundred in range(20):
    # Checked after step 99 of every hundred, where local SGD and DiLoCo synchronize
    # (tests/compressors.py), or for Streaming DiLoCo, whose fragments land at their own offsets,
    # after the last landing before it: the leaves synchronized then are identical everywhere.
    end = 100 * (hundred + 1) - 1
    while not any(synced_after(end)):
      end -= 1
    params, opt_state, outputs = run(pstep, params, opt_state, end + 1 - len(losses),
                                     len(losses), faults)
    losses += mean_losses(outputs)
    assert max_drift(params, synced_after(end)) == 0.0, f"replicas drifted by step {end + 1}"
    assert all_finite(params) and all_finite(opt_state), f"poisoned by step {end + 1}"
  params, opt_state, outputs = run(pstep, params, opt_state, 2000 - len(losses), len(losses),
                                   faults)
  losses += mean_losses(outputs)
  finite_losses = [l for l in losses[-100:] if np.isfinite(l)]
  assert np.mean(finite_losses) < 0.2 * np.mean(losses[:20]), "training did not continue"


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
  def worker(*args):
    subprocess.run([sys.executable, str(WORKER), "--steps", "30", *args], check=True, timeout=900)

  # Saved after 13 steps (mid-period for local SGD and DiLoCo at test scale: tests/compressors.py)
  # by a run that goes on uninterrupted to the end.
  worker("--save-at", "13", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "full.npz"))
  worker("--resume-from", "13", "--ckpt", str(tmp_path / "ckpt"),
         "--out", str(tmp_path / "resumed.npz"))
  full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
  assert sorted(full.files) == sorted(resumed.files)
  assert {k.split("/")[0] for k in full.files} == set(ALGORITHMS)
  for key in full.files:
    np.testing.assert_array_equal(resumed[key], full[key], err_msg=key)
