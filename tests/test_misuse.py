"""Misuse found from the program: each hazard of wrapping a cross-device mean is refused where
``jaxcomp.data_parallel`` traces the step and through ``jaxcomp.check`` on a ``pmap`` step, and
each safe composition (README's table, "safe as is") runs with the replicas identical."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp
from chain_harness import W, grads, params, powersgd_chain, run
from helpers import assert_identical_across_devices, pmapped_update, replicate, rounding_tol

HANG = r"a collective over 'batch' runs under a decision taken on each device alone: .*"
DRIFT = (r"is the same on every device when the step starts, and the step returns it at the same "
         r"place different on each device: it reached no collective.*optax.masked.*compress=.*"
         r"sparsify=.*multi_transform")


def pmap_step(tx):
  """A hand-written pmap training step: the update applied to the parameters."""
  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s
  return jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])


def check(tx, g=None):
  """``jaxcomp.check`` on the pmap training step of ``tx``, with per-device gradients."""
  jaxcomp.check(pmap_step(tx), replicate(params(), W), replicate(tx.init(params()), W),
                grads() if g is None else g)


def data_parallel_step(tx):
  """One step of ``jaxcomp.data_parallel``'s loss form with ``tx`` (gradients of a linear loss)."""
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  loss_fn = lambda p, x: jnp.mean(x @ p["w"]) + jnp.mean(x[:, :5] * p["b"])  # noqa: E731
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  x = np.random.default_rng(0).normal(size=(2 * W, 6)).astype(np.float32)
  new, _, loss = dp.step(params(), dp.make_state(params()), dp.shard(x))
  float(loss.mean())
  return new


def masked_powersgd():
  return optax.chain(optax.masked(jaxcomp.powersgd(1, start_iter=0), {"w": True, "b": False}),
                     optax.sgd(0.1))


# ----------------------------------------------------------------- 1: a collective under a decision


def test_apply_if_finite_around_a_compressor_is_refused_under_data_parallel_and_by_check():
  # It decides per device: the device with the NaN skips the collectives the others wait in.
  tx = optax.apply_if_finite(powersgd_chain(), 3)
  with pytest.raises(ValueError, match=HANG + r"jaxcomp.skip_if_nonfinite.*apply_if_finite"):
    data_parallel_step(tx)
  with pytest.raises(ValueError, match=HANG + r"psum.*under the cond at"):
    check(tx)


def test_multi_steps_with_a_skip_function_is_refused_under_data_parallel_and_by_check():
  tx = optax.MultiSteps(powersgd_chain(), 2, should_skip_update_fn=optax.skip_not_finite)
  with pytest.raises(ValueError, match=HANG + r"should_skip_update_fn"):
    data_parallel_step(tx)
  with pytest.raises(ValueError, match=HANG):
    check(tx)


def user_cond(tx):
  """A user's own wrapper: runs ``tx`` only where this device's gradient is small."""
  def update(g, s, p=None):
    small = jnp.abs(g["w"]).max() < 1.5
    return lax.cond(small, lambda: tx.update(g, s, p),
                    lambda: (jax.tree.map(jnp.zeros_like, g), s))
  return optax.GradientTransformation(tx.init, update)


def test_a_users_own_cond_on_a_per_device_value_around_a_compressor_is_refused():
  with pytest.raises(ValueError, match=HANG + r"a lax.cond of your own"):
    data_parallel_step(user_cond(powersgd_chain()))
  with pytest.raises(ValueError, match=HANG):
    check(user_cond(powersgd_chain()))


def test_a_decision_every_device_agrees_on_is_accepted():
  # skip_if_nonfinite decides from an all-reduced flag; the compressor's own phases from counts.
  tx = jaxcomp.skip_if_nonfinite(powersgd_chain(), 3)
  check(tx)
  assert np.isfinite(np.asarray(data_parallel_step(tx)["w"])).all()


def test_apply_if_finite_after_the_compressor_is_safe():
  # After the compressor every device sees the same (NaN) values: all skip together.
  tx = optax.chain(jaxcomp.powersgd(1, start_iter=0),
                   optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 3))
  check(tx)
  out, state = run(tx, [grads(1), grads(2, nan_on=2)])
  np.testing.assert_array_equal(out["w"], 0)
  np.testing.assert_array_equal(state[1].notfinite_count, 1)


# --------------------------------------------------------- 2: a leaf that reaches no collective


def test_masked_around_a_compressor_is_refused_naming_the_left_out_leaf():
  with pytest.raises(ValueError, match=r"params\['b'\] differs from device to device after the "
                                       r"step.*optax.masked"):
    data_parallel_step(masked_powersgd())
  with pytest.raises(ValueError, match=r"argument 0\['b'\] " + DRIFT):
    check(masked_powersgd())


@pytest.mark.numeric
def test_complementary_masks_averaged_by_jaxcomp_transformations_are_safe():
  # Every leaf is averaged by some jaxcomp transformation of the chain: "w" by PowerSGD, "b" (the
  # 1-D leaves, chosen by a callable mask) by allreduce.
  is_vector = lambda tree: jax.tree.map(lambda x: np.ndim(x) == 1, tree)  # noqa: E731
  tx = optax.chain(optax.masked(jaxcomp.powersgd(1, start_iter=0), {"w": True, "b": False}),
                   optax.masked(jaxcomp.allreduce(), is_vector), optax.sgd(0.1))
  check(tx)
  g = grads(4)
  out, _ = run(tx, [g])
  assert_identical_across_devices(out)
  np.testing.assert_allclose(out["b"][0], -0.1 * g["b"].mean(0),
                             **rounding_tol(2 * W, scale=0.1 * np.abs(g["b"]).max()))


def test_masks_whose_other_leaves_only_a_plain_optax_transformation_sees_are_refused():
  tx = optax.chain(optax.masked(jaxcomp.powersgd(1), {"w": True, "b": False}),
                   optax.masked(optax.scale(1.0), {"w": False, "b": True}), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"argument 0\['b'\] " + DRIFT):
    check(tx)


def test_multi_transform_with_a_jaxcomp_transformation_for_every_label_is_safe():
  tx = optax.multi_transform({"kernel": jaxcomp.powersgd(1, start_iter=0),
                              "bias": jaxcomp.fp16_compress()}, {"w": "kernel", "b": "bias"})
  check(tx)
  g = grads(4)
  out, _ = run(tx, [g])
  assert_identical_across_devices(out)
  np.testing.assert_allclose(out["b"][0], g["b"].mean(0), rtol=1e-3, atol=1e-3)


# ------------------------------------------------- 3: k times the traffic, and whole optimizers


def test_multi_steps_warns_and_accumulate_sends_k_times_less_for_the_same_update():
  k = 4
  steps = [grads(seed) for seed in range(2 * k)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check(optax.MultiSteps(powersgd_chain(), k))
  assert any("optax.MultiSteps runs jaxcomp.powersgd" in str(w.message) for w in caught)
  multi_out, _ = run(optax.MultiSteps(powersgd_chain(), k), steps)
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


def test_multi_steps_state_accumulates_per_device():
  specs = jaxcomp.state_partition_specs(optax.MultiSteps(powersgd_chain(), 2), params())
  assert specs.acc_grads == {"w": P("batch"), "b": P("batch")}
  assert specs.mini_step == P() and specs.inner_opt_state[0].error == (P("batch"), P("batch"))


@pytest.mark.parametrize("after", ["adamw", "sgd after a nested chain", "jaxcomp.allreduce",
                                   "identity"])
def test_a_transformation_after_a_whole_optimizer_is_refused_from_its_state(after):
  whole = jaxcomp.onebit_adam(0.1, freeze_steps=2)
  tx = {"adamw": lambda: optax.chain(whole, optax.adamw(1e-3)),
        "sgd after a nested chain": lambda: optax.chain(
            optax.chain(whole, optax.apply_if_finite(optax.identity(), 3)), optax.sgd(0.1)),
        "jaxcomp.allreduce": lambda: optax.chain(whole, jaxcomp.allreduce()),
        "identity": lambda: optax.chain(whole, optax.identity())}[after]()
  message = (r"jaxcomp.onebit_adam is followed in an optax.chain by another transformation: "
             r"jaxcomp.onebit_adam is a whole optimizer whose output is the parameter update.*"
             r"Use jaxcomp.onebit_adam alone.*jaxcomp.scale_by_onebit_adam\(\.\.\.\) followed by a "
             r"learning rate")
  with pytest.raises(ValueError, match=message):
    data_parallel_step(tx)
  with pytest.raises(ValueError, match=message):
    check(tx)


def test_nothing_may_follow_an_optimizer_that_sets_the_parameters():
  tx = optax.chain(jaxcomp.diloco(optax.sgd(0.1), sync_every=2),
                   optax.apply_if_finite(optax.identity(), 3))
  with pytest.raises(ValueError, match=r"jaxcomp.diloco is followed in an optax.chain by another "
                                       r"transformation: .*sets the parameters"):
    jaxcomp.check(pmap_step(tx), replicate(params(), W), replicate(tx.init(params()), W), grads())


def test_guards_after_a_whole_optimizer_and_wrappers_around_it_are_accepted():
  whole = jaxcomp.onebit_adam(0.1, freeze_steps=2)
  for tx in [whole, optax.chain(optax.clip_by_global_norm(100.0), whole),
             optax.chain(whole, optax.apply_if_finite(optax.chain(optax.identity()), 3)),
             jaxcomp.skip_if_nonfinite(whole, 3)]:
    check(tx)
    assert np.isfinite(np.asarray(data_parallel_step(tx)["w"])).all()


# ---------------------------------------------------------------------------------- the rest


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


# -------------------------------------------------- refusals that name the cause, and what works


def test_a_hook_that_returns_only_its_buffer_is_told_to_return_the_state_too():
  def forgetful(state, bucket):
    return jaxcomp.axis.mean(bucket.buffer, bucket.axis_name)

  tx = jaxcomp.comm_hook(forgetful)
  with pytest.raises(TypeError, match=r"hook 'forgetful' must return \(buffer, state\)"):
    run(tx, [grads()])


def test_reduce_on_plateau_takes_the_devices_mean_loss_under_data_parallel():
  # Its update needs value=: data_parallel passes the mean of the devices' losses, one decision.
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1),
                   optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(lambda p, x: jnp.mean((x @ p["w"]) ** 2), mesh, tx=tx)
  p, state = params(), dp.make_state(params())
  x = dp.shard(np.random.default_rng(0).normal(size=(2 * W, 6)).astype(np.float32))
  for _ in range(3):
    p, state, loss = dp.step(p, state, x)
    float(loss.mean())
  assert np.unique(np.asarray(state[2].scale)).size == 1  # the same on every device


def test_lookahead_under_the_loss_form_is_refused_with_the_step_form_as_the_fix():
  tx = optax.lookahead(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), 2, 0.5)
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(lambda p, x: jnp.mean((x @ p["w"]) ** 2), mesh, tx=tx)
  with pytest.raises(ValueError, match=r"optax.lookahead keeps two copies.*per-device-step form"):
    dp.make_state(params())


def test_momentum_after_sign_compress_is_warned_of():
  tx = optax.chain(jaxcomp.sign_compress(), optax.sgd(0.1, momentum=0.9))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check(tx)
  assert any("sign_compress is followed by momentum" in str(w.message) for w in caught)


def test_check_reads_a_program_whose_inner_jit_returns_a_constant():
  inner = jax.jit(lambda y: (y * 2.0, 1.0))  # the 1.0 is a literal among the jit's results
  step = jax.jit(lambda x: inner(x))
  jaxcomp.check(step, jnp.ones(3))  # nothing mapped, nothing to refuse: it must not raise


def test_a_per_device_loss_is_not_read_as_the_new_value_of_a_later_argument():
  # step(params, state, g, zeros) -> (params, state, loss): the loss has the layout of the
  # (replicated) last argument, but it is not that argument's new value.
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))

  def step(p, s, g, offset):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, jnp.sum(g["w"]) + offset
  mapped = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  jaxcomp.check(mapped, replicate(params(), W), replicate(tx.init(params()), W), grads(),
                np.zeros(W, np.float32))
