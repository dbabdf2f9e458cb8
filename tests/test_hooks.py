"""hooks: the built-in per-bucket hooks of ``jaxcomp.comm_hook`` and the compress wrappers.

The dense hooks against the dense transformations; every stateful hook, with the state its
``*_state`` makes, against the transformation of the same name run on the same buckets
(``bucket_cap_mb``); a hook given the wrong state names the state it needs; the wrappers' casts.
(``comm_hook`` and the buckets themselves: ``tests/test_buckets.py``.)
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomp
from jaxcomp import hooks
from dgc_reference import device_grads, make_params
from helpers import (assert_identical_across_devices, per_device_grads, pmap_update, pmapped_update,
                     replicate, rounding_tol, run_updates)

pytestmark = pytest.mark.numeric
W = 8
PARAMS = {"conv": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros(8), "head": jnp.zeros((8, 10)),
          "step": jnp.zeros((), jnp.int32)}


# ------------------------------------------------------------------------------ the dense hooks


@pytest.mark.parametrize("hook, exact", [
    (hooks.allreduce_hook, True),
    (hooks.fp16_compress_hook, False),
    (hooks.bf16_compress_hook, False),
])
def test_default_hooks_equal_the_dense_transformations(hook, exact):
  grads = per_device_grads(np.random.default_rng(1), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  dense = {hooks.allreduce_hook: jaxcomp.allreduce, hooks.fp16_compress_hook: jaxcomp.fp16_compress,
           hooks.bf16_compress_hook: jaxcomp.bf16_compress}[hook]()
  out, _ = pmap_update(jaxcomp.comm_hook(hook, bucket_cap_mb=0.001), grads)
  expected, _ = pmap_update(dense, grads)
  assert_identical_across_devices(out)
  # Two programs (buckets, or leaf by leaf) for the same mean of W unit-scale terms: float32
  # rounding of the W terms, or, through the wire dtype, a wire rounding or two of the unit-scale
  # mean.
  wire = {hooks.fp16_compress_hook: np.float16, hooks.bf16_compress_hook: ml_dtypes.bfloat16}
  tol = rounding_tol(W) if exact else rounding_tol(2, dtype=wire[hook])
  chex.assert_trees_all_close(out, expected, **tol)
  if exact:  # against NumPy's float32 mean
    chex.assert_trees_all_close(out["conv"][0], grads["conv"].mean(0), **rounding_tol(W))
  np.testing.assert_array_equal(out["step"], grads["step"])


def test_noop_hook_returns_local_gradients():
  grads = per_device_grads(np.random.default_rng(2), PARAMS, W)
  out, _ = pmap_update(jaxcomp.comm_hook(hooks.noop_hook), grads)
  chex.assert_trees_all_equal(out, grads)


def int8_hook(state, bucket):
  """The README's worked user hook: int8 values with a shared per-bucket scale."""
  scale = jaxcomp.axis.pmax(jnp.abs(bucket.buffer).max(), bucket.axis_name) / 127
  q = jnp.round(bucket.buffer / jnp.maximum(scale, 1e-30)).astype(jnp.int32)
  total = jaxcomp.axis.psum(q, bucket.axis_name)
  n = jaxcomp.axis.axis_size(bucket.axis_name)
  return (total * scale / n).astype(bucket.buffer.dtype), state


def test_documented_user_hook_works_and_is_in_the_docs():
  assert "def int8_hook(state, bucket):" in hooks.__doc__
  grads = per_device_grads(np.random.default_rng(3), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  out, _ = pmap_update(jaxcomp.comm_hook(int8_hook), grads)
  assert_identical_across_devices(out)
  scale = max(np.abs(g).max() for g in jax.tree.leaves(grads) if g.dtype == np.float32) / 127
  np.testing.assert_allclose(out["conv"][0], grads["conv"].mean(0), atol=scale)


@pytest.mark.parametrize("wrapper, wire", [(jaxcomp.fp16_compress_wrapper, np.float16),
                                           (jaxcomp.bf16_compress_wrapper, ml_dtypes.bfloat16)])
@pytest.mark.parametrize("inner", [hooks.allreduce_hook, int8_hook, hooks.noop_hook])
def test_wrappers_compose_with_any_hook(wrapper, wire, inner):
  grads = per_device_grads(np.random.default_rng(4), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  seen_dtypes = []

  def spy(state, bucket):
    seen_dtypes.append(bucket.buffer.dtype)
    return inner(state, bucket)

  out, _ = pmap_update(jaxcomp.comm_hook(wrapper(spy)), grads)
  assert set(seen_dtypes) == {jnp.dtype(wire)}
  assert out["conv"].dtype == jnp.float32
  # The inner hook ran on the wire-dtype bucket: same as running it on pre-rounded gradients.
  rounded = jax.tree.map(lambda g: g.astype(wire).astype(g.dtype)
                         if g.dtype == np.float32 else g, grads)
  expected, _ = pmap_update(jaxcomp.comm_hook(wrapper(inner)), rounded)
  # The same program on inputs that the wrapper's cast maps to the same wire values: bitwise.
  chex.assert_trees_all_equal(out, expected)
  if inner is hooks.allreduce_hook:
    plain, _ = pmap_update(jaxcomp.comm_hook(
        {np.float16: hooks.fp16_compress_hook,
         ml_dtypes.bfloat16: hooks.bf16_compress_hook}[wire]), grads)
    # Another program (cast, then allreduce_hook's sum and ÷W; or cast, ÷W, sum): the same mean of
    # W wire-dtype terms, to a wire rounding or two of the unit-scale result.
    chex.assert_trees_all_close(out, plain, **rounding_tol(2, dtype=wire))


# ------------------------------------------------------------------------------ the stateful hooks

DGC_W = 4


def test_dgc_hook_matches_dgc_in_exact_mode():
  params = make_params()
  direct = jaxcomp.dgc(0.05, selection="exact")
  hooked = jaxcomp.comm_hook(hooks.dgc_hook, hooks.dgc_state(0.05, selection="exact"),
                              bucket_cap_mb=0.001)
  rng = np.random.default_rng(7)
  states = [replicate(direct.init(params), DGC_W), replicate(hooked.init(params), DGC_W)]
  updates = [pmapped_update(direct, DGC_W), pmapped_update(hooked, DGC_W)]
  for _ in range(4):
    grads = device_grads(rng, params, DGC_W)
    (a, states[0]), (b, states[1]) = [jax.block_until_ready(f(grads, s))
                                      for f, s in zip(updates, states)]
    # Two programs (buckets, or leaf by leaf): per step the momentum, v and the sum over W round.
    chex.assert_trees_all_close(a, b, **rounding_tol(4 * (DGC_W + 3)))
  assert len(states[1].hook_states) > 1


def test_dgc_hook_composes_with_fp16_compress_wrapper():
  params = make_params()
  wrapped = jaxcomp.comm_hook(jaxcomp.fp16_compress_wrapper(hooks.dgc_hook),
                              hooks.dgc_state(0.05, selection="exact"), bucket_cap_mb=0.001)
  # The same as DGC with float16 on the wire, run on the gradients rounded to float16.
  direct = jaxcomp.dgc(0.05, selection="exact", value_dtype=jnp.float16)
  rng = np.random.default_rng(9)
  states = [replicate(direct.init(params), DGC_W), replicate(wrapped.init(params), DGC_W)]
  updates = [pmapped_update(direct, DGC_W), pmapped_update(wrapped, DGC_W)]
  for _ in range(3):
    grads = jax.tree.map(lambda g: g.astype(np.float16).astype(g.dtype),
                         device_grads(rng, params, DGC_W))
    (a, states[0]), (b, states[1]) = [jax.block_until_ready(f(grads, s))
                                      for f, s in zip(updates, states)]
    # Two programs with float16 on the wire: a float16 rounding or two of values up to ~4.
    chex.assert_trees_all_close(a, b, **rounding_tol(2, scale=4, dtype=np.float16))
  report = jaxcomp.comm_report(updates[1], grads, states[1])
  assert {d for c in report.collectives if c.op == "all-gather" for d in c.dtypes} == {"f16", "s32"}


def test_a_hook_state_given_an_array_names_the_state_factory():
  for make, name in [(lambda: hooks.onebit_adam_state(b1=jnp.asarray(0.9)), "onebit_adam_state"),
                     (lambda: hooks.sign_state(error_feedback=jnp.asarray(True)), "sign_state")]:
    with pytest.raises(TypeError, match=rf"^{name}: .* must be Python values: a hook's state is "
                                        r"made once"):
      make()


def test_a_hook_without_its_state_says_which_state_to_pass():
  for hook, maker in ((hooks.quantized_hook, "quantized_state"), (hooks.sign_hook, "sign_state"),
                      (hooks.onebit_adam_hook, "onebit_adam_state")):
    tx = jaxcomp.comm_hook(hook, axis_name=None)
    grads = {"w": jnp.ones((4, 3))}
    with pytest.raises(TypeError, match=maker):
      tx.update(grads, tx.init(grads))


# Each stateful hook with its state factory, and the transformation of the same name given
# ``bucket_cap_mb`` (the bucket cap, in MiB, is the argument); each compressing from the first step
# (one phase: the warm-ups' switches would double what is compiled).
STATEFUL = {
    "powersgd": (hooks.powersgd_hook,
                 lambda: hooks.powersgd_state(1, start_iter=0, min_compression_rate=1.0),
                 lambda cap: jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0,
                                              bucket_cap_mb=cap)),
    "dgc": (hooks.dgc_hook, lambda: hooks.dgc_state(0.1),
            lambda cap: jaxcomp.dgc(0.1, bucket_cap_mb=cap)),
    "quantized": (hooks.quantized_hook, lambda: hooks.quantized_state("fp8", block_size=32),
                  lambda cap: jaxcomp.quantized("fp8", block_size=32, bucket_cap_mb=cap)),
    "sign": (hooks.sign_hook, lambda: hooks.sign_state(),
             lambda cap: jaxcomp.sign_compress(bucket_cap_mb=cap)),
    "onebit_adam": (hooks.onebit_adam_hook, lambda: hooks.onebit_adam_state(freeze_steps=0),
                    lambda cap: jaxcomp.scale_by_onebit_adam(freeze_steps=0, bucket_cap_mb=cap)),
    "chunked_topk": (hooks.chunked_topk_hook, lambda: hooks.chunked_topk_state(4, chunk=16),
                     lambda cap: jaxcomp.chunked_topk(4, chunk=16, bucket_cap_mb=cap)),
}
HOOK_W = 4
HOOK_PARAMS = {"a": np.zeros((8, 6), np.float32), "b": np.zeros(6, np.float32),
               "n": np.zeros(3, np.int32)}
CAP = 20 / 2**20  # DDP's buckets, last leaf first, each closed once it holds 20 bytes: b, then a


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_every_stateful_hook_is_its_transformation_bucket_by_bucket(name):
  hook, state, transformation = STATEFUL[name]
  hooked = jaxcomp.comm_hook(hook, state(), bucket_cap_mb=CAP)
  direct = transformation(CAP)
  rng = np.random.default_rng(10)
  steps = [per_device_grads(rng, HOOK_PARAMS, HOOK_W,
                            make=lambda r, s: r.standard_normal(s).astype(np.float32))
           for _ in range(2)]
  hook_outs, hook_states = run_updates(hooked, steps, HOOK_W)
  outs, states = run_updates(direct, steps, HOOK_W)
  assert len(hook_states[-1].hook_states) == len(states[-1].hook_states) == 2
  for a, b in zip(hook_outs, outs):
    assert_identical_across_devices(a)
    assert np.abs(np.asarray(a["a"])).max() > 0
    # The same step on the same buckets (two programs, by construction alike): a few roundings of
    # each of 2 steps' terms.
    chex.assert_trees_all_close(a, b, **rounding_tol(2 * (HOOK_W + 3), scale=4))
  chex.assert_trees_all_close(hook_states[-1], states[-1], **rounding_tol(2 * (HOOK_W + 3), 4))


def test_batched_powersgd_hook_is_batched_powersgd_on_a_bucket_of_one_leaf():
  """One leaf, one bucket: the same zero-padded square (240 values in 16 × 16), the same Q."""
  hooked = jaxcomp.comm_hook(hooks.batched_powersgd_hook,
                             hooks.batched_powersgd_state(1, start_iter=0))
  direct = jaxcomp.batched_powersgd(1, start_iter=0)
  rng = np.random.default_rng(11)
  steps = [{"w": rng.standard_normal((HOOK_W, 12, 20)).astype(np.float32)} for _ in range(2)]
  hook_outs, hook_states = run_updates(hooked, steps, HOOK_W)
  outs, states = run_updates(direct, steps, HOOK_W)
  tol = rounding_tol(2 * (2 * 16 + HOOK_W), scale=4)  # 2 steps: two products of 16 terms, W terms
  for a, b in zip(hook_outs, outs):
    assert_identical_across_devices(a)
    chex.assert_trees_all_close(a, b, **tol)
  chex.assert_trees_all_close(hook_states[-1].hook_states[0].q, states[-1].q, **tol)


@pytest.mark.parametrize("hook, other_state, needed", [
    (hooks.powersgd_hook, hooks.quantized_state, "powersgd_state"),
    (hooks.batched_powersgd_hook, hooks.sign_state, "batched_powersgd_state"),
    (hooks.dgc_hook, hooks.chunked_topk_state, "dgc_state"),
    (hooks.quantized_hook, hooks.sign_state, "quantized_state"),
    (hooks.sign_hook, hooks.quantized_state, "sign_state"),
    (hooks.onebit_adam_hook, hooks.dgc_state, "onebit_adam_state"),
    (hooks.chunked_topk_hook, hooks.powersgd_state, "chunked_topk_state"),
    # One state type, two algorithms: each refuses the other's configuration.
    (hooks.powersgd_hook, hooks.batched_powersgd_state, "powersgd_state"),
    (hooks.batched_powersgd_hook, hooks.powersgd_state, "batched_powersgd_state"),
], ids=lambda v: getattr(v, "__name__", v) if callable(v) else None)
def test_a_hook_given_another_algorithms_state_names_the_state_it_needs(hook, other_state, needed):
  tx = jaxcomp.comm_hook(hook, other_state())
  grads = per_device_grads(np.random.default_rng(12), HOOK_PARAMS, HOOK_W)
  state = replicate(tx.init(HOOK_PARAMS), HOOK_W)
  got = type(state.hook_states[0]).__name__
  with pytest.raises(TypeError, match=rf"needs the per-bucket state made by jaxcomp\.hooks\."
                                      rf"{needed}\(\.\.\.\).*got {got}"):
    pmapped_update(tx, HOOK_W)(grads, state)


@pytest.mark.parametrize("wrapper, wire", [(jaxcomp.fp16_compress_wrapper, np.float16),
                                           (jaxcomp.bf16_compress_wrapper, ml_dtypes.bfloat16)])
def test_a_wrapped_stateful_hook_computes_on_the_wire_dtype_and_keeps_its_states_dtypes(wrapper,
                                                                                      wire):
  """The quantized hook on the bucket cast to the wire dtype: its output cast back to float32 and
  its state (the errors) still float32; the mean within int8 and wire rounding."""
  wrapped = wrapper(hooks.quantized_hook)
  assert wrapped.__name__ == f"{wrapper.__name__}(quantized_hook)"
  tx = jaxcomp.comm_hook(wrapped, hooks.quantized_state(8, block_size=32))
  grads = per_device_grads(np.random.default_rng(13), HOOK_PARAMS, HOOK_W,
                           make=lambda r, s: r.standard_normal(s).astype(np.float32))
  (out,), (state,) = run_updates(tx, [grads], HOOK_W)
  assert_identical_across_devices(out)
  assert {x.dtype for x in jax.tree.leaves(out)} == {np.dtype(np.float32), np.dtype(np.int32)}
  (bucket_state,) = state.hook_states
  assert {x.dtype for x in jax.tree.leaves(bucket_state.worker_error)} == {np.dtype(np.float32)}
  np.testing.assert_array_equal(out["n"], grads["n"])
  wire_eps = float(ml_dtypes.finfo(wire).eps)
  for k in ("a", "b"):
    biggest = np.abs(grads[k]).max()
    np.testing.assert_allclose(out[k][0], grads[k].mean(0), rtol=0,
                               atol=biggest * (2 / 127 + 4 * wire_eps))
