"""End to end: a Flax MLP on scikit-learn's bundled digits, 8 devices, PowerSGD against the plain
mean.

The task (data, model, batches) is ``jaxcomp.train.tasks.digits``; nothing is downloaded.
"""

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.train import tasks
from helpers import replicate
from training import pmap_step

W, PER_DEVICE = 8, 16


def batch(task, t):
  inputs, targets = task.batch(0, t, W * PER_DEVICE)
  return inputs.reshape(W, PER_DEVICE, -1), targets.reshape(W, PER_DEVICE)


def train(task, tx, steps, step=None, poison_at=None, skip=None):
  """Trains from the same init on the same batches; returns (params, state)."""
  step = step or pmap_step(task.loss, tx, W, poisoned=True)
  params = task.init(0)
  params, state = replicate(params, W), replicate(tx.init(params), W)
  for t in range(steps):
    if t == skip:
      continue
    poison = np.zeros(W, np.float32)
    if t == poison_at:
      poison[3] = np.nan
    params, state, _ = step(params, state, *batch(task, t), poison)
    jax.block_until_ready(params)  # unblocked multi-device loops deadlock XLA:CPU on 2 cores
  return params, state


def step_report(task, tx):
  params = task.init(0)
  return jaxcomp.comm_report(pmap_step(task.loss, tx, W, poisoned=True), replicate(params, W),
                             replicate(tx.init(params), W), *batch(task, 0),
                             np.zeros(W, np.float32))


@pytest.mark.slow
def test_rank2_powersgd_matches_allreduce_accuracy_on_digits():
  task = tasks.digits()
  steps, start_iter = 600, 60
  sgd = optax.sgd(task.learning_rate, momentum=0.9)
  baseline_tx = optax.chain(jaxcomp.allreduce(), sgd)
  params, _ = train(task, baseline_tx, steps)
  _, baseline = task.evaluate(jax.tree.map(lambda x: x[0], params))
  tx = optax.chain(jaxcomp.powersgd(2, start_iter=start_iter), sgd)
  params, state = train(task, tx, steps)
  _, compressed = task.evaluate(jax.tree.map(lambda x: x[0], params))
  # The report's totals are a compressed step's; its warm-up phase is the dense mean.
  dense = step_report(task, baseline_tx).payload_bytes
  report = step_report(task, tx)
  # No finiteness flag in either phase: PowerSGD reads it from the sums it sends.
  assert report.phase("powersgd.warmup").payload_bytes == dense
  rate = state[0].compression_stats()[0]
  print(f"\ndigits, {steps} steps on {W} devices: allreduce accuracy {baseline:.4f}, "
        f"{dense:,} B/step; PowerSGD rank 2 (from step {start_iter}) {compressed:.4f}, "
        f"{report.payload_bytes:,} B/step compressed ({dense / report.payload_bytes:.1f}x less; "
        f"torch's stats: {rate:.2f}x fewer numbers)\n{report}")
  assert baseline > 0.95
  assert abs(compressed - baseline) <= 0.01, (compressed, baseline)
  assert dense == 4 * sum(x.size for x in jax.tree.leaves(task.init(0)))
  assert report.payload_bytes == dense / rate
  assert dense / report.payload_bytes > 15


@pytest.mark.numeric
def test_non_finite_gradient_on_one_device_is_skipped_as_if_absent():
  """NaN at device 3 on step 7: every later step equals a run that never took step 7."""
  task = tasks.digits(quick=True)
  tx = optax.chain(jaxcomp.powersgd(2, start_iter=4),
                   optax.apply_if_finite(optax.sgd(task.learning_rate, momentum=0.9), 10))
  step = pmap_step(task.loss, tx, W, poisoned=True)
  poisoned, poisoned_state = train(task, tx, 14, step, poison_at=7)
  skipped, skipped_state = train(task, tx, 14, step, skip=7)
  jax.tree.map(np.testing.assert_array_equal, poisoned, skipped)
  jax.tree.map(np.testing.assert_array_equal, poisoned_state[0], skipped_state[0])
  assert int(poisoned_state[0].count[0]) == 13
  assert int(poisoned_state[1].total_notfinite[0]) == 1
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(poisoned))
