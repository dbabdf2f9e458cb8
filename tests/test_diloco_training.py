"""DiLoCo and Streaming DiLoCo on real data, 8 simulated devices, against allreduce.

Chars: DiLoCo reaches allreduce's held-out loss in the same number of inner steps, to within 2%,
for a twentieth of its bytes; with PowerSGD on the pseudo-gradient under a hundredth, for a few
percent of loss. Streaming DiLoCo does as well as DiLoCo with half its peak, and with 8-bit
pseudo-gradients sends 265× less than allreduce for a few percent of loss. The paper's protocol:
DiLoCo continues from a model trained synchronously for a while (its C4 runs start from a
pretrained checkpoint), here 200 allreduce steps of the character transformer of ``python -m
jaxcomp.train --quick``; then allreduce and DiLoCo (H = 20, the paper's outer Nesterov SGD, learning
rate 0.7, momentum 0.9) each train 400 more steps on the same batches. The inner SGD of DiLoCo takes
a third of allreduce's learning rate: the outer momentum multiplies each period's progress.

Digits: Streaming DiLoCo (H = 100, three fragments, τ = 1) keeps allreduce's accuracy to within
two standard errors with about 60% of DiLoCo's peak bytes, and with a float16 PowerSGD rank-4
pseudo-gradient it comes within 3% for about 2,000× fewer bytes than allreduce.

The DiLoCo methods are evaluated on θ, the synchronized parameters of their state (DiLoCo's are
every device's right after a sync; Streaming DiLoCo's devices never hold all of θ at once), as the
papers evaluate the global model.
"""

import functools

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import replicate
from training import pmap_step
from jaxcomp.train import tasks
from jaxcomp.train.registry import REGISTRY

W, BATCH, PRETRAIN, STEPS = 8, 64, 200, 400
DIGITS_STEPS = 800


def sgd(learning_rate):
  return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(learning_rate, momentum=0.9))


def synchronized(params, state):
  """θ, the outer parameters, where ``state`` holds them (DiLoCo's and Streaming DiLoCo's state),
  else device 0's parameters."""
  own = jax.tree.map(lambda x: np.asarray(x[0]), params)
  if not hasattr(state, "outer_params"):
    return own
  return jax.tree.unflatten(jax.tree.structure(own), [np.asarray(t[0]) for t in state.outer_params])


def train(task, tx, params, steps, seed):
  """``steps`` pmapped steps from ``params`` (the same on every device), blocking on the loss each
  step; returns the synchronized parameters and the report of one step."""

  pstep = pmap_step(task.loss, tx, W)
  params, state = replicate(params, W), replicate(tx.init(params), W)
  shard = lambda a: a.reshape((W, -1) + a.shape[1:])
  report = jaxcomp.comm_report(pstep, params, state, *map(shard, task.batch(seed, 0, BATCH)))
  for t in range(steps):
    params, state, loss = pstep(params, state, *map(shard, task.batch(seed, t, BATCH)))
    float(loss[0])  # blocks: unblocked steps with collectives deadlock XLA:CPU
  return synchronized(params, state), report


def peak(report) -> float:
  """The most one step sends: the largest of the report's phases, or every step's bytes where there
  are none (ring bytes per device)."""
  return max([report.phase(name).ring_bytes for name in report.phase_names]
             or [report.ring_bytes])


@pytest.mark.slow
def test_diloco_and_streaming_diloco_match_allreduce_on_chars_for_a_fraction_of_the_bytes():
  task = tasks.chars(quick=True)
  lr = task.learning_rate
  start, _ = train(task, REGISTRY["allreduce"].optimizer(sgd(lr)), task.init(0), PRETRAIN, seed=1)
  streaming = functools.partial(jaxcomp.streaming_diloco, sgd(lr / 3))
  runs = {
      "allreduce": REGISTRY["allreduce"].optimizer(sgd(lr)),
      "diloco_h20": REGISTRY["diloco_h20"].optimizer(sgd(lr / 3)),
      "diloco_h20_powersgd_r2": REGISTRY["diloco_h20_powersgd_r2"].optimizer(sgd(lr / 3)),
      "streaming_h20_p2_d1": streaming(sync_every=20, fragments=2, delay=1, mix=1.0),
      "streaming_h100_p4_d2_int8": streaming(
          sync_every=100, fragments=4, delay=2,
          compressor=jaxcomp.quantized(8, error_feedback=False)),
  }
  results = {}
  for name, tx in runs.items():
    params, report = train(task, tx, start, STEPS, seed=0)
    results[name] = task.evaluate(params)[0], report.ring_bytes, peak(report)
  base_loss, base_bytes, _ = results["allreduce"]
  for name, (loss, sent, most) in results.items():
    print(f"{name}: held-out loss {loss:.4f} ({loss / base_loss - 1:+.2%}), "
          f"{sent:,.0f} B/step/device ({base_bytes / sent:.1f}x fewer), peak {most:,.0f} B")
  loss, sent, diloco_peak = results["diloco_h20"]
  assert loss <= 1.02 * base_loss and base_bytes / sent == pytest.approx(20)
  # PowerSGD rank 2 (without error feedback, see the registry) sends under a hundredth; its
  # low-rank pseudo-gradient costs held-out loss here (7% when measured).
  loss, sent, _ = results["diloco_h20_powersgd_r2"]
  assert loss <= 1.1 * base_loss and base_bytes / sent >= 100
  # Two fragments, the exchange overlapping a step: DiLoCo's loss (+0.2% of allreduce's when
  # measured) and bytes, half its peak.
  loss, sent, most = results["streaming_h20_p2_d1"]
  assert loss <= 1.01 * base_loss and base_bytes / sent == pytest.approx(20)
  assert most <= 0.55 * diloco_peak
  # H = 100, four fragments in pieces over two steps, 8-bit codes: 265x fewer bytes than allreduce
  # for +3.5% of loss when measured (+2.2% after 1,200 steps instead of 400); 4-bit codes would
  # halve the bytes. Its peak step sends a 21st of DiLoCo's (the fragments hold unequal layers).
  loss, sent, most = results["streaming_h100_p4_d2_int8"]
  assert loss <= 1.04 * base_loss and base_bytes / sent >= 250 and most <= diloco_peak / 20


def digits_run(task, tx, steps):
  """``steps`` pmapped steps of the digits MLP from the task's initial parameters, 16 examples per
  device; returns the held-out accuracy of the synchronized parameters and the report."""

  def step(params, state, x, y):
    updates, state = tx.update(jax.grad(task.loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  params, state = replicate(task.init(0), W), replicate(tx.init(task.init(0)), W)
  batch = lambda t: [a.reshape((W, -1) + a.shape[1:]) for a in task.batch(0, t, W * 16)]
  report = jaxcomp.comm_report(pstep, params, state, *batch(0))
  for t in range(steps):
    params, state = pstep(params, state, *batch(t))
    jax.block_until_ready(params)  # unblocked multi-device loops deadlock XLA:CPU on 2 cores
  return task.evaluate(synchronized(params, state))[1], report


@pytest.mark.slow
def test_streaming_diloco_keeps_allreduce_accuracy_on_digits_for_2000x_fewer_bytes():
  task = tasks.digits()
  sgd = optax.sgd(task.learning_rate, momentum=0.9)
  fp16_powersgd = jaxcomp.comm_hook(
      jaxcomp.fp16_compress_wrapper(jaxcomp.hooks.powersgd_hook),
      jaxcomp.hooks.powersgd_state(rank=4, start_iter=0, error_feedback=False,
                                   min_compression_rate=1.0), bucket_cap_mb=1000.0)
  runs = {
      "allreduce": optax.chain(jaxcomp.allreduce(), sgd),
      "diloco_h100": jaxcomp.diloco(sgd, sync_every=100),
      "streaming_h100_p3_d1": jaxcomp.streaming_diloco(sgd, sync_every=100, fragments=3, delay=1),
      "streaming_h100_p3_d1_fp16_powersgd_r4": jaxcomp.streaming_diloco(
          sgd, sync_every=100, fragments=3, delay=1, compressor=fp16_powersgd),
  }
  results = {name: digits_run(task, tx, DIGITS_STEPS) for name, tx in runs.items()}
  base, base_report = results["allreduce"]
  for name, (accuracy, report) in results.items():
    print(f"{name}: accuracy {accuracy:.4f} ({accuracy - base:+.2%}), {report.ring_bytes:,.1f} "
          f"B/step/device ({base_report.ring_bytes / report.ring_bytes:,.0f}x fewer), peak "
          f"{peak(report):,.0f} B")
  # Measured (allreduce, DiLoCo, Streaming DiLoCo, with the float16 PowerSGD rank-4
  # pseudo-gradient):
  # 0.9889, 0.9556, 0.9861, 0.9806 on one x86 CPU (0.9778 on another, the same code: XLA:CPU's code,
  # and so the last bits of every step, differ by CPU); 0.9889, 0.9833, 0.9889, 0.9639 on an AMD
  # EPYC (2026-12-07, the code of 2026-11-28 gave the same). On 360 held-out digits one digit is
  # 0.28% and the standard error of an accuracy near 98.5% is 0.64%: "keeps allreduce's accuracy"
  # means within two standard errors (1.3%). Whether DiLoCo at H = 100 falls behind depends on the
  # CPU (3.3% on the first, 0.6% on the EPYC), so it is printed, not asserted; the PowerSGD
  # pseudo-gradient costs 0.3% to 2.5%.
  assert base > 0.98
  _, diloco_report = results["diloco_h100"]
  for name, allowed in (("streaming_h100_p3_d1", 0.013),
                        ("streaming_h100_p3_d1_fp16_powersgd_r4", 0.03)):
    accuracy, report = results[name]
    assert accuracy >= base - allowed, name
    # Fragments are whole layers: the peak is the largest one's, the middle layer here (63%).
    assert peak(report) <= 0.65 * peak(diloco_report), name
  _, report = results["streaming_h100_p3_d1_fp16_powersgd_r4"]
  assert base_report.ring_bytes / report.ring_bytes >= 1900
