"""Optax wrappers around jaxcomp: each row of README's table ("safe as is", "unsafe, why", "the
jaxcomp alternative") is checked here, and ``check_last_in_chain`` for whole optimizers."""

import warnings

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from chain_harness import W, grads, params, powersgd_chain, run
from helpers import assert_identical_across_devices, pmapped_update, replicate, rounding_tol
from jaxcomp._src import optax_wrappers


def test_apply_if_finite_around_a_compressor_is_refused_at_trace_time():
  # It would decide per device: the device with the NaN skips collectives the others wait in.
  with pytest.raises(ValueError, match=r"apply_if_finite.*decides on each device alone.*"
                                       r"jaxcomp.skip_if_nonfinite"):
    run(optax.apply_if_finite(powersgd_chain(), 3), [grads()])


def test_apply_if_finite_after_the_compressor_is_safe():
  # After the compressor every device sees the same (NaN) values: all skip together.
  tx = optax.chain(jaxcomp.powersgd(1, start_iter=0),
                   optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 3))
  out, state = run(tx, [grads(1), grads(2, nan_on=2)])
  np.testing.assert_array_equal(out["w"], 0)
  np.testing.assert_array_equal(state[1].notfinite_count, 1)


def test_masked_around_a_compressor_is_refused_naming_the_left_out_leaves():
  with pytest.raises(ValueError, match=r"optax.masked leaves \['b'\] out.*replicas drift.*"
                                       r"compress=.*sparsify=.*multi_transform"):
    run(optax.masked(jaxcomp.powersgd(1), {"w": True, "b": False}), [grads()])


@pytest.mark.numeric
def test_complementary_masks_averaged_by_jaxcomp_transformations_are_safe():
  # Every leaf is averaged by some jaxcomp transformation of the chain: "w" by PowerSGD, "b" (the
  # 1-D leaves, chosen by a callable mask) by allreduce.
  is_vector = lambda tree: jax.tree.map(lambda x: np.ndim(x) == 1, tree)
  tx = optax.chain(optax.masked(jaxcomp.powersgd(1, start_iter=0), {"w": True, "b": False}),
                   optax.masked(jaxcomp.allreduce(), is_vector), optax.sgd(0.1))
  g = grads(4)
  out, _ = run(tx, [g])
  assert_identical_across_devices(out)
  np.testing.assert_allclose(out["b"][0], -0.1 * g["b"].mean(0),
                             **rounding_tol(2 * W, scale=0.1 * np.abs(g["b"]).max()))


def test_masks_whose_other_leaves_only_a_plain_optax_transformation_sees_are_refused():
  tx = optax.chain(optax.masked(jaxcomp.powersgd(1), {"w": True, "b": False}),
                   optax.masked(optax.scale(1.0), {"w": False, "b": True}), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"optax.masked leaves \['b'\] out.*nothing averages them"):
    run(tx, [grads()])


def test_multi_transform_with_a_jaxcomp_transformation_for_every_label_is_safe():
  tx = optax.multi_transform({"kernel": jaxcomp.powersgd(1, start_iter=0),
                              "bias": jaxcomp.fp16_compress()}, {"w": "kernel", "b": "bias"})
  g = grads(4)
  out, _ = run(tx, [g])
  assert_identical_across_devices(out)
  np.testing.assert_allclose(out["b"][0], g["b"].mean(0), rtol=1e-3, atol=1e-3)


def test_multi_steps_warns_and_accumulate_sends_k_times_less_for_the_same_update():
  k = 4
  steps = [grads(seed) for seed in range(2 * k)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    multi_out, _ = run(optax.MultiSteps(powersgd_chain(), k), steps)
  assert any("optax.MultiSteps runs jaxcomp." in str(w.message) for w in caught)
  acc_out, _ = run(jaxcomp.accumulate(powersgd_chain(), k), steps)
  chex.assert_trees_all_close(multi_out, acc_out, rtol=1e-5, atol=1e-6)

  def bytes_per_k_steps(tx):
    state = replicate(tx.init(params()), W)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      report = jaxcomp.comm_report(pmapped_update(tx, W), steps[0], state)
    every_step = sum(c.payload_bytes for c in report.collectives if not c.in_conditional)
    once = sum(c.payload_bytes for c in report.collectives if c.in_conditional)
    return k * every_step + once, report

  multi_bytes, _ = bytes_per_k_steps(optax.MultiSteps(powersgd_chain(), k))
  acc_bytes, acc_report = bytes_per_k_steps(jaxcomp.accumulate(powersgd_chain(), k))
  assert all(c.in_conditional for c in acc_report.collectives)  # once per k micro-steps
  assert multi_bytes == k * acc_bytes > 0


def test_multi_steps_with_a_skip_function_is_refused():
  tx = optax.MultiSteps(powersgd_chain(), 2, should_skip_update_fn=optax.skip_not_finite)
  with pytest.raises(ValueError, match="should_skip_update_fn.*skips on each device alone"):
    run(tx, [grads()])


def test_multi_steps_state_accumulates_per_device():
  specs = jaxcomp.state_partition_specs(optax.MultiSteps(powersgd_chain(), 2), params())
  assert specs.acc_grads == {"w": P("batch"), "b": P("batch")}
  assert specs.mini_step == P() and specs.inner_opt_state[0].error["w"] == P("batch")


def test_inject_hyperparams_is_told_which_hyperparameters_are_static():
  with pytest.raises(TypeError, match="is static.*static_args"):
    optax.inject_hyperparams(jaxcomp.dgc)(ratio=0.01).init(params())


@pytest.mark.parametrize("where", ["before", "after"])
def test_clip_by_global_norm_before_or_after_the_compressor_keeps_replicas_identical(where):
  clip = optax.clip_by_global_norm(0.5)
  parts = [clip, jaxcomp.powersgd(1, start_iter=0)]
  tx = optax.chain(*(parts if where == "before" else parts[::-1]), optax.sgd(0.1))
  out, _ = run(tx, [grads(5), grads(6)])
  assert_identical_across_devices(out)
  if where == "after":  # clipping the mean: the update's norm is at most 0.1 * 0.5
    norm = np.sqrt(sum(np.sum(np.asarray(x[0]) ** 2) for x in jax.tree.leaves(out)))
    assert norm <= 0.05 * (1 + 1e-5)


def whole_optimizer(lr=0.1):
  """A toy whole optimizer whose output is the update, -lr·g, as jaxcomp.onebit_adam's is."""

  def update_fn(updates, state, params=None):
    del params
    optax_wrappers.check_last_in_chain("whole_optimizer", alternative="scale_by_whole")
    return jax.tree.map(lambda g: -lr * g, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


@pytest.mark.parametrize("after", ["adamw", "sgd after a nested chain", "jaxcomp.allreduce"])
def test_a_transformation_after_a_whole_optimizer_is_refused_at_trace_time(after):
  tx = {"adamw": lambda: optax.chain(whole_optimizer(), optax.adamw(1e-3)),
        "sgd after a nested chain": lambda: optax.chain(
            optax.chain(whole_optimizer(), optax.identity()), optax.sgd(0.1)),
        "jaxcomp.allreduce": lambda: optax.chain(whole_optimizer(),
                                                 jaxcomp.allreduce(axis_name=None))}[after]()
  p = params()
  with pytest.raises(ValueError, match=r"whole_optimizer is followed in an optax.chain by .*: "
                                       r"whole_optimizer is a whole optimizer whose output is the "
                                       r"parameter update.*Use whole_optimizer alone.*"
                                       r"scale_by_whole\(\.\.\.\) followed by a learning rate"):
    jax.jit(tx.update)(p, tx.init(p), p)


def test_guards_after_a_whole_optimizer_and_wrappers_around_it_are_accepted():
  p = params()
  g = {"w": np.full((6, 5), 2.0, np.float32), "b": np.full(5, -1.0, np.float32)}
  for tx in [whole_optimizer(),
             optax.chain(optax.clip_by_global_norm(100.0), whole_optimizer()),
             optax.chain(whole_optimizer(), optax.identity(),
                         optax.apply_if_finite(optax.chain(optax.identity()), 3)),
             jaxcomp.skip_if_nonfinite(whole_optimizer(), 3, axis_name=None)]:
    out, _ = jax.jit(tx.update)(g, tx.init(p), p)
    chex.assert_trees_all_close(out, jax.tree.map(lambda x: -0.1 * x, g))
