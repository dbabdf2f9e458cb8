"""DiLoCo on real data, 8 simulated devices: allreduce's held-out loss in the same number of inner
steps, to within 2%, for a twentieth of its bytes; with PowerSGD on the pseudo-gradient under a
hundredth, for a few percent of loss.

The paper's protocol: DiLoCo continues from a model trained synchronously for a while (its C4 runs
start from a pretrained checkpoint), here 200 allreduce steps of the character transformer of
``python -m jaxcomp.train --quick``; then allreduce and DiLoCo (H = 20, the paper's outer Nesterov SGD,
learning rate 0.7, momentum 0.9) each train 400 more steps on the same batches. The inner SGD of DiLoCo
takes a third of allreduce's learning rate: the outer momentum multiplies each period's progress.
"""

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import replicate
from jaxcomp.train import tasks
from jaxcomp.train.registry import REGISTRY

W, BATCH, PRETRAIN, STEPS = 8, 64, 200, 400


def sgd(learning_rate):
  return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(learning_rate, momentum=0.9))


def train(task, tx, params, steps, seed):
  """``steps`` pmapped steps from ``params`` (the same on every device), blocking on the loss each
  step; returns device 0's parameters and the bytes one step sends per device."""

  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(task.loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  params, state = replicate(params, W), replicate(tx.init(params), W)
  shard = lambda a: a.reshape((W, -1) + a.shape[1:])
  report = jaxcomp.comm_report(pstep, params, state, *map(shard, task.batch(seed, 0, BATCH)))
  for t in range(steps):
    params, state, loss = pstep(params, state, *map(shard, task.batch(seed, t, BATCH)))
    float(loss[0])  # blocks: unblocked steps with collectives deadlock XLA:CPU
  return jax.tree.map(lambda x: np.asarray(x[0]), params), report


@pytest.mark.slow
def test_diloco_h20_matches_allreduce_within_2_percent_for_a_twentieth_of_the_bytes():
  task = tasks.chars(quick=True)
  lr = task.learning_rate
  start, _ = train(task, REGISTRY["allreduce"].optimizer(sgd(lr)), task.init(0), PRETRAIN, seed=1)

  results = {}
  for name, inner_lr in (("allreduce", lr), ("diloco_h20", lr / 3),
                         ("diloco_h20_powersgd_r2", lr / 3)):
    entry = REGISTRY[name]
    params, report = train(task, entry.optimizer(sgd(inner_lr)), start, STEPS, seed=0)
    results[name] = task.evaluate(params)[0], entry.bytes_per_step(report)
  base_loss, base_bytes = results["allreduce"]
  for name, (loss, sent) in results.items():
    print(f"{name}: held-out loss {loss:.4f} ({loss / base_loss - 1:+.2%}), "
          f"{sent:,.0f} B/step/device ({base_bytes / sent:.1f}x fewer)")
  loss, sent = results["diloco_h20"]
  assert loss <= 1.02 * base_loss and base_bytes / sent >= 20
  # PowerSGD rank 2 (without error feedback, see the registry) sends under a hundredth; its
  # low-rank pseudo-gradient costs held-out loss here (7% when measured).
  loss, sent = results["diloco_h20_powersgd_r2"]
  assert loss <= 1.1 * base_loss and base_bytes / sent >= 100
