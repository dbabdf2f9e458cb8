"""``chunked_topk``: SparseLoCo's exchange against its steps in NumPy (float64), the bytes it sends,
the non-finite policy, DDP buckets, a scheduled error decay, and its argument checks."""

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import (assert_identical_across_devices, pmapped_update, replicate, rounding_tol,
                     run_updates)
from jaxcomp._src import chunked_topk as chunked_topk_lib

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4
K, CHUNK = 4, 32  # w (12, 9): 4 chunks of 27, 4 kept each; b (9,): one chunk of 9, 2 kept
FLOAT = ("w", "b")  # the reduced leaves


def reference_sent(e, k, chunk, bits, delta):
  """Steps 2–3 of ``chunked_topk`` for one device's error-fed leaf ``e``, in float64, from the
  module docstring: ``(sent, fragile)`` — the values sent at their positions (0 elsewhere), and how
  many decisions (a top-k boundary, a magnitude-bin boundary, a bfloat16 rounding) lie within
  ``delta`` of flipping, where a float32 program could decide otherwise."""
  n = e.size
  rows = -(-n // chunk)
  width = -(-n // rows)
  kept = min(width, -(-k * width // chunk))
  levels = 2 ** (bits - 1)
  chunks = np.zeros(rows * width)
  chunks[:n] = e.ravel()
  chunks = chunks.reshape(rows, width)
  sent = np.zeros_like(chunks)
  fragile = 0
  for r in range(rows):
    score = np.where(r * width + np.arange(width) < n, np.abs(chunks[r]), -1.0)
    order = np.argsort(-score, kind="stable")  # ties to the lower position, as lax.top_k
    keep = np.sort(order[:kept])
    fragile += kept < width and score[order[kept - 1]] - score[order[kept]] < delta
    v = chunks[r, keep]
    magnitude = np.abs(v)
    low, span = magnitude.min(), magnitude.max() - magnitude.min()
    bins = np.zeros(kept, int)
    if span > 0:
      bins = np.clip(np.floor((magnitude - low) / span * levels), 0, levels - 1).astype(int)
      edges = low + span * np.arange(1, levels) / levels
      fragile += int((np.abs(magnitude[:, None] - edges) < delta).sum())
    used = np.array([(bins == j).any() for j in range(levels)])
    centroids = np.array([magnitude[bins == j].mean() if used[j] else 0.0 for j in range(levels)])
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    fragile += int((used & (bf16(centroids + delta) != bf16(centroids - delta))).sum())
    sent[r, keep] = np.where(v < 0, -bf16(centroids)[bins], bf16(centroids)[bins])
  return sent.ravel()[:n].reshape(e.shape), fragile


def reference(grads_per_step, k, chunk, bits, beta, delta):
  """``chunked_topk`` over steps, in float64: per device e ← β·e + g, ê = Q(TopK(e)), e ← e − ê; the
  output is Σ_w ê_w / W. Returns the outputs, the final errors and the count of fragile
  decisions."""
  errors = [{name: np.zeros(grads_per_step[0][name].shape[1:]) for name in FLOAT}
            for _ in range(W)]
  outputs, fragile = [], 0
  for grads in grads_per_step:
    out = {}
    for name in FLOAT:
      total = 0.0
      for w in range(W):
        errors[w][name] = beta * errors[w][name] + grads[name][w].astype(np.float64)
        sent, bad = reference_sent(errors[w][name], k, chunk, bits, delta)
        errors[w][name] = errors[w][name] - sent
        total, fragile = total + sent / W, fragile + bad
      out[name] = total
    outputs.append(out)
  return outputs, errors, fragile


def params():
  return {"w": np.zeros((12, 9), np.float32), "b": np.zeros(9, np.float32),
          "n": np.zeros(3, np.int32)}  # an integer leaf passes through untouched


def gradients(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": rng.normal(size=(W, 12, 9)).astype(np.float32),
           "b": rng.normal(size=(W, 9)).astype(np.float32),
           "n": np.tile(np.arange(3, dtype=np.int32), (W, 1))} for _ in range(steps)]


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_matches_its_steps_in_numpy_and_the_mean_is_the_same_on_every_device(bits):
  grads = gradients(4)
  tx = jaxcomp.chunked_topk(K, chunk=CHUNK, bits=bits, error_decay=0.9)
  outputs, states = run_updates(tx, grads, W, params=params())
  # The errors (of order 1, below 4) went through four steps of two roundings each in float32: no
  # choice of the reference lies that close to flipping, so both programs choose alike, and the
  # outputs agree to a few roundings more.
  delta = rounding_tol(8, scale=4.0)["atol"]
  expected, errors, fragile = reference(grads, K, CHUNK, bits, 0.9, delta)
  assert fragile == 0
  tol = rounding_tol(16, scale=4.0)
  for got, want in zip(outputs, expected):
    assert_identical_across_devices(got)
    chex.assert_trees_all_close({k: got[k][0] for k in FLOAT}, want, **tol)
    np.testing.assert_array_equal(got["n"], grads[0]["n"])
  chex.assert_trees_all_close({k: states[-1].error[k] for k in FLOAT},
                              {k: np.stack([e[k] for e in errors]) for k in FLOAT}, **tol)
  assert isinstance(states[-1].error["n"], optax.MaskedNode)
  np.testing.assert_array_equal(states[-1].count, [4] * W)
  # The density: 4 of each 27 of w and 2 of the 9 of b per device, at most W times that in the mean.
  assert 0 < np.count_nonzero(outputs[0]["w"][0]) <= W * 4 * 4
  assert 0 < np.count_nonzero(outputs[0]["b"][0]) <= W * 2


def test_sends_one_uint8_all_gather_of_the_coded_chunks_and_nothing_else():
  tx = jaxcomp.chunked_topk(K, chunk=CHUNK)
  step = pmapped_update(tx, W)
  report = jaxcomp.comm_report(step, gradients(1)[0], replicate(tx.init(params()), W),
                               num_devices=W)
  config = chunked_topk_lib.ChunkedTopKConfig(K, CHUNK)
  sent = chunked_topk_lib.payload_bytes(config, [(12, 9), (9,)])
  # Per chunk of w: 4 positions of 27 in Elias–Fano code (l = 2: 8 low bits, 4 + 26 >> 2 = 10
  # upper), 4 2-bit codes: 26 bits, 4 bytes; then 2 bfloat16 centroids. b: 2 of 9 (l = 2: 4 + 4
  # bits) and 2 codes: 12 bits, 2 bytes, and 4 bytes of centroids.
  assert sent == 4 * (4 + 4) + (2 + 4)
  # No flag of its own: a non-finite gradient shows in the centroids sent.
  assert [(c.op, c.dtypes, c.payload_bytes) for c in report.collectives] == [
      ("all-gather", ("u8",), W * sent)]
  # The default, 64 of 4,096 at 2 bits: 511 bits of positions and 128 of codes, 80 bytes, and 4
  # bytes of centroids: 84 bytes per 4,096 float32 values (16,384 bytes).
  assert chunked_topk_lib.payload_bytes(chunked_topk_lib.ChunkedTopKConfig(), [(4096,)]) == 84


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_gradient_on_one_device_keeps_every_state_and_outputs_nan_everywhere(bad):
  # No flag of its own: the selection sends the value (a NaN ranked as ∞), its centroids NaN.
  tx = jaxcomp.chunked_topk(K, chunk=CHUNK, error_decay=0.9)
  grads = gradients(2)
  grads[1]["w"][2, 3, 4] = bad
  outputs, states = run_updates(tx, grads, W, params=params())
  assert np.isnan(outputs[1]["w"]).all() and np.isnan(outputs[1]["b"]).all()
  np.testing.assert_array_equal(outputs[1]["n"], grads[1]["n"])
  chex.assert_trees_all_equal(states[1], states[0])  # error and count exactly as they were
  assert np.abs(states[0].error["w"]).max() > 0


def test_ddp_buckets_send_one_all_gather_each_and_average_as_the_whole_tree():
  grads = gradients(2)
  whole, _ = run_updates(jaxcomp.chunked_topk(K, chunk=CHUNK), grads, W, params=params())
  tx = jaxcomp.chunked_topk(K, chunk=CHUNK, bucket_cap_mb=200 / 2**20)  # w and b apart
  bucketed, states = run_updates(tx, grads, W, params=params())
  assert isinstance(states[-1], jaxcomp.CommHookState)
  for got, want in zip(bucketed, whole):  # the same per-leaf arithmetic in another program
    chex.assert_trees_all_close(got, want, **rounding_tol(16, scale=2.0))
  step = pmapped_update(tx, W)
  report = jaxcomp.comm_report(step, grads[0], replicate(tx.init(params()), W), num_devices=W)
  assert sorted(c.dtypes for c in report.collectives if c.op == "all-gather") == [("u8",)] * 2


def test_error_decay_may_be_scheduled_under_inject_hyperparams():
  grads = gradients(2)
  fixed, _ = run_updates(jaxcomp.chunked_topk(K, chunk=CHUNK, error_decay=0.5), grads, W,
                         params=params())
  injected = optax.inject_hyperparams(jaxcomp.chunked_topk, static_args=("k", "chunk", "bits"))(
      k=K, chunk=CHUNK, error_decay=0.5)
  scheduled, states = run_updates(injected, grads, W, params=params())
  chex.assert_trees_all_close(scheduled, fixed, **rounding_tol(16, scale=2.0))
  assert float(states[-1].hyperparams["error_decay"][0]) == 0.5


def test_settings_are_checked_and_static_ones_refused_as_arrays_in_one_error():
  with pytest.raises(ValueError, match=r"k must be at most chunk.*got k=65, chunk=64"):
    jaxcomp.chunked_topk(65, chunk=64)
  with pytest.raises(ValueError, match=r"bits must be 1, 2, 3 or 4.*got 8"):
    jaxcomp.chunked_topk(bits=8)
  with pytest.raises(TypeError, match=r"bits must be a positive int; got 2.0 \(float\)"):
    jaxcomp.chunked_topk(bits=2.0)
  with pytest.raises(ValueError, match=r"error_decay must be a number in \[0, 1\]; got 1.5"):
    jaxcomp.chunked_topk(error_decay=1.5)
  with pytest.raises(TypeError, match=r"chunked_topk: k, chunk are static.*"
                                      r"static_args=\('k', 'chunk', 'bits'\).*only error_decay"):
    jaxcomp.chunked_topk(jnp.asarray(4), chunk=jnp.asarray(32))


def test_a_gradient_without_floating_point_leaves_passes_through_and_sends_nothing():
  tx = jaxcomp.chunked_topk(K, chunk=CHUNK)
  grads = {"n": np.tile(np.arange(3, dtype=np.int32), (W, 1))}
  step = pmapped_update(tx, W)
  state = replicate(tx.init({"n": np.zeros(3, np.int32)}), W)
  out, state = step(grads, state)
  np.testing.assert_array_equal(out["n"], grads["n"])
  np.testing.assert_array_equal(state.count, [1] * W)
  assert jaxcomp.comm_report(step, grads, state).collectives == ()
