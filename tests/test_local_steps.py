"""What local SGD, DiLoCo and DES-LOC share: ``Assign`` updates, the local non-finite policy, and
the places they run — ``pmap``, ``shard_map(check_vma=True)`` with ``state_partition_specs``,
``nnx.Optimizer``, ``jaxcomp.data_parallel`` (parameters per device, both forms)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from helpers import assert_identical_across_devices, replicate, rounding_tol
from training import pmap_step, run

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 4


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": rng.normal(0, 0.5, (5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def batch(step, n=W):
  rng = np.random.default_rng(100 + step)
  return (rng.normal(size=(n, 6, 5)).astype(np.float32),
          rng.normal(size=(n, 6, 3)).astype(np.float32))


WRAPPERS = {
    "local_sgd": lambda: jaxcomp.local_sgd(optax.sgd(0.1, momentum=0.9), sync_every=3,
                                           start_iter=2),
    "diloco": lambda: jaxcomp.diloco(optax.adam(0.05), sync_every=3,
                                     compressor=jaxcomp.powersgd(1, start_iter=0)),
    "desloc": lambda: jaxcomp.desloc(optax.adam(0.05), param_sync_every=3,
                                     first_moment_sync_every=3, second_moment_sync_every=6),
}


def pmap_run(tx, steps, poison_at=()):
  """``steps`` pmapped steps from identical parameters (``training.run``; ``poison_at``: its
  ``(step, device, value)`` triples). Returns the parameters after every step."""
  _, _, outputs = run(pmap_step(loss_fn, tx, W, poisoned=True, returns=None),
                      replicate(init_params(), W), replicate(tx.init(init_params()), W), steps,
                      poison_at=poison_at, n_devices=W, batch=batch)
  return [params for params, _ in outputs]


# ------------------------------------------------------------------------------------- Assign


def test_assign_sets_parameters_exactly_where_adding_a_difference_cannot():
  # Two replicas, their float32 average t: no update u gives p + u == t on both.
  p1, p2 = np.float32(-(0.5 - 2**-25)), np.float32(-(0.5 - 2**-24))
  t = np.float32(2**-21)
  assert p1 + (t - p1) != t or p2 + (t - p2) != t
  for p in (p1, p2, jnp.asarray(p1), np.asarray([p2])):
    np.testing.assert_array_equal(
        p + jaxcomp.Assign(np.asarray(t, np.float32).reshape(np.shape(p))), t)
  params = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}
  target = {"a": jnp.full(3, 7.0), "b": jnp.zeros((2, 2))}
  updates = jax.tree.map(jaxcomp.Assign, target)
  chex.assert_trees_all_equal(optax.apply_updates(params, updates), target)
  chex.assert_trees_all_equal(jax.jit(optax.apply_updates)(params, updates), target)


def test_adding_the_difference_to_the_average_misses_it_on_many_elements():
  """Why ``Assign``: 8 float32 replicas of N(0, 0.1) weights that drifted apart by N(0, 0.01)."""
  rng = np.random.default_rng(0)
  weights = rng.normal(0, 0.1, 100_000).astype(np.float32)
  replicas = (weights + rng.normal(0, 0.01, (8, weights.size))).astype(np.float32)
  average = replicas.mean(0, dtype=np.float32)
  landed = replicas + (average - replicas)  # what optax.apply_updates would compute
  missed = (landed != average).any(0).mean()
  assert 0.07 < missed < 0.09  # 8% of the elements differ from the average on some device
  np.testing.assert_array_equal(replicas + jaxcomp.Assign(np.broadcast_to(average, replicas.shape)),
                                np.broadcast_to(average, replicas.shape))


def test_assign_supports_nothing_but_params_plus_update():
  update = jaxcomp.Assign(jnp.ones(3))
  for bad in (lambda: jnp.ones(3) - update, lambda: 2.0 * update, lambda: update + jnp.ones(3),
              lambda: np.ones(3) * update):
    with pytest.raises(TypeError):
      bad()
  with pytest.raises(ValueError, match="shape"):
    jnp.ones(4) + update


def test_update_without_params_is_refused():
  for name, make in WRAPPERS.items():
    tx = make()
    params = init_params()
    with pytest.raises(ValueError, match=f"{name} sets the parameters.*tx.update\\(grads, state, "
                                         "params\\)"):
      tx.update(params, tx.init(params))


# --------------------------------------------------------------------------- non-finite steps


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_a_nan_on_one_device_stays_there_and_the_next_sync_brings_it_back(name):
  # Step 3 is local for all (each averages the parameters after 2 and 5).
  clean = pmap_run(WRAPPERS[name](), 6)
  hit = pmap_run(WRAPPERS[name](), 6, [(3, 1, np.nan)])  # device 1's gradient at step 3
  for leaf_hit, leaf_before, leaf_clean in zip(*(map(np.asarray, jax.tree.leaves(h))
                                                 for h in (hit[3], hit[2], clean[3]))):
    np.testing.assert_array_equal(leaf_hit[1], leaf_before[1])  # device 1 kept its parameters
    np.testing.assert_array_equal(leaf_hit[[0, 2, 3]], leaf_clean[[0, 2, 3]])  # the others moved
  for step in (5,):  # the next synchronization: every device the same, finite
    assert_identical_across_devices(hit[step])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(hit[step]))


def test_a_nan_during_gradient_averaging_keeps_every_device_in_step():
  tx = WRAPPERS["local_sgd"]()  # steps 0 and 1 average gradients
  hit = pmap_run(tx, 3, [(1, 2, np.inf)])  # device 2's gradient at step 1
  for before, after in zip(jax.tree.leaves(hit[0]), jax.tree.leaves(hit[1])):
    np.testing.assert_array_equal(after, before)  # the mean is not finite: nobody moved
  assert_identical_across_devices(hit[1])
  assert_identical_across_devices(hit[2])


# ----------------------------------------------------------------------- where they run


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_shard_map_with_check_vma_matches_pmap(name, batch_mesh):
  """Per-device parameters (they differ between syncs) as a leading axis sharded over the mesh."""
  tx = WRAPPERS[name]()
  specs = jaxcomp.state_partition_specs(tx, init_params(), axis_name="batch")
  state = jax.jit(jax.shard_map(tx.init, mesh=batch_mesh, in_specs=P(), out_specs=specs))(
      init_params())

  @jax.jit
  @functools.partial(jax.shard_map, mesh=batch_mesh,
                     in_specs=(P("batch"), specs, P("batch"), P("batch")),
                     out_specs=(P("batch"), specs))
  def step(params, state, x, y):
    params = jax.tree.map(lambda p: p[0], params)
    updates, state = tx.update(jax.grad(loss_fn)(params, x[0], y[0]), state, params)
    return jax.tree.map(lambda p: p[None], optax.apply_updates(params, updates)), state

  params = replicate(init_params(), W)
  expected = pmap_run(tx, 6)
  for t in range(6):
    params, state = jax.block_until_ready(step(params, state, *batch(t)))
    # Two compiled programs: equal to float32 rounding (a few ulp per step).
    chex.assert_trees_all_close(params, expected[t], rtol=0, atol=1e-5)
  assert_identical_across_devices(params)  # step 5 synchronizes
  # The local steps send nothing: every collective sits in the sync branch.
  report = jaxcomp.comm_report(step, params, state, *batch(0))
  assert report.collectives and all(c.in_conditional for c in report.collectives)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_nnx_optimizer_gives_the_parameters_of_plain_arrays(name):
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):

    def __init__(self):
      self.w = nnx.Param(jnp.asarray(init_params()["w"]))
      self.b = nnx.Param(jnp.asarray(init_params()["b"]))

    def __call__(self, x):
      return jnp.tanh(x @ self.w + self.b)

  tx = WRAPPERS[name]()
  model = Model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  state = replicate(state, W)
  expected = pmap_run(tx, 6)
  for t in range(6):
    state = jax.block_until_ready(pstep(state, *batch(t)))
    model_state = nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)
    got = {"w": np.asarray(model_state["w"].get_value()),
           "b": np.asarray(model_state["b"].get_value())}
    chex.assert_trees_all_close(got, expected[t], rtol=0, atol=1e-5)
  assert_identical_across_devices(got)


def _flat(x, y):
  """The global batch of ``batch(t)``: device d's shard is rows d·6 … d·6 + 5, as under pmap."""
  return x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])


def _check_against_pmap(name, run_dp):
  """``run_dp(tx, t)`` gives data_parallel's stacked parameters after step t; compared with pmap's
  step for step over three periods, the copies bitwise identical after every sync and not all
  identical in between."""
  tx = WRAPPERS[name]()
  syncs_after = tx.init(init_params()).config.syncs_after
  steps = 9
  expected = pmap_run(tx, steps)
  for t in range(steps):
    params = run_dp(tx, t)
    assert params["w"].shape == (W, 5, 3) and tuple(params["w"].sharding.spec)[:1] == ("batch",)
    # Two compiled programs: equal to float32 rounding, which Adam's division and the steps
    # accumulate (the weights are of order 1).
    chex.assert_trees_all_close(params, expected[t], **rounding_tol(16 * (t + 1)))
    if syncs_after(t):
      assert_identical_across_devices(params)
    else:
      w = np.asarray(params["w"])
      assert not np.array_equal(w[0], w[1]), t


def _mesh():
  return jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:W])


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_data_parallel_loss_form_keeps_the_parameters_per_device_and_matches_pmap(name):
  tx = WRAPPERS[name]()
  dp = jaxcomp.data_parallel(loss_fn, _mesh(), tx=tx)
  state = {"opt_state": dp.make_state(init_params()), "params": dp.make_params(init_params())}

  def run(tx, t):
    state["params"], state["opt_state"], loss = dp.step(state["params"], state["opt_state"],
                                                        *dp.shard(_flat(*batch(t))))
    jax.block_until_ready(loss)
    return state["params"]

  _check_against_pmap(name, run)
  # Parameters not stacked are refused by shape, with the fix.
  with pytest.raises(ValueError, match=r"params\['b'\] is per device and must be stacked along a "
                                       r"leading axis of 4.*make_params"):
    dp.step(init_params(), state["opt_state"], *dp.shard(_flat(*batch(0))))


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_data_parallel_step_form_with_per_device_parameters_matches_pmap(name):
  tx = WRAPPERS[name]()

  def train_step(state, x, y):  # the parameters are this device's own: no pcast
    params, opt_state = state
    updates, opt_state = tx.update(jax.grad(loss_fn)(params.tree, x, y), opt_state, params.tree)
    return (jaxcomp.PerDevice(optax.apply_updates(params.tree, updates)), opt_state), None

  dp = jaxcomp.data_parallel(train_step, _mesh())
  holder = [dp.make_state((jaxcomp.PerDevice(init_params()), tx.init(init_params())))]

  def run(tx, t):
    holder[0], _ = jax.block_until_ready(dp.step(holder[0], *dp.shard(_flat(*batch(t)))))
    return holder[0][0].tree

  _check_against_pmap(name, run)


def test_data_parallel_refuses_replicated_parameters_under_local_steps():
  tx = WRAPPERS["local_sgd"]()

  def train_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss_fn)(jax.lax.pcast(params, "batch", to="varying"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  dp = jaxcomp.data_parallel(train_step, _mesh())
  state = dp.make_state((init_params(), tx.init(init_params())))
  with pytest.raises(ValueError, match=r"state\[0\]\['b'\] differs from device to device.*"
                                       r"local_sgd, diloco.*jaxcomp.PerDevice\(params\)"):
    dp.step(state, *dp.shard(_flat(*batch(0))))
  with pytest.raises(ValueError,
                     match="make_params places the parameters of the loss-function form"):
    dp.make_params(init_params())


# ------------------------------------------------- compositions: what works, what is refused, how


def _sparseloco(inner=None):
  return jaxcomp.sparseloco(inner or optax.adamw(0.05), sync_every=3, k=2, chunk=8)


def _dp_steps(tx, steps, poison_step=None):
  """``steps`` data_parallel steps; a NaN in device 0's shard of the batch at ``poison_step``.
  Returns the stacked parameters after every step (numpy) and the last state."""
  dp = jaxcomp.data_parallel(loss_fn, _mesh(), tx=tx)
  params, state = dp.make_params(init_params()), dp.make_state(init_params())
  history = []
  for t in range(steps):
    x, y = _flat(*batch(t))
    if t == poison_step:
      x = x.copy()
      x[0, 0] = np.nan
    params, state, loss = dp.step(params, state, *dp.shard((x, y)))
    jax.block_until_ready(loss)
    history.append(jax.tree.map(np.asarray, params))
  return history, state


def test_skip_if_nonfinite_around_a_local_step_optimizer_skips_on_every_device_together():
  # Its skipped step leaves the parameters as they are (Assign of them, not a zero update).
  history, state = _dp_steps(jaxcomp.skip_if_nonfinite(_sparseloco(), 3), 4, poison_step=1)
  chex.assert_trees_all_equal(history[1], history[0])  # every device kept its parameters
  assert int(np.asarray(state.total_notfinite).ravel()[0]) == 1
  assert not np.array_equal(history[2]["w"], history[1]["w"])
  chex.assert_tree_all_finite(history[-1])
  # The skipped step kept the count too: the synchronization after the third step taken is step 3.
  assert not np.array_equal(history[2]["w"][0], history[2]["w"][1])
  assert_identical_across_devices(history[3])


def test_accumulate_around_a_local_step_optimizer_steps_on_the_mean_of_k_micro_batches():
  k = 2
  acc = jaxcomp.data_parallel(loss_fn, _mesh(), tx=jaxcomp.accumulate(_sparseloco(), k))
  plain = jaxcomp.data_parallel(loss_fn, _mesh(), tx=_sparseloco())
  pa, sa = acc.make_params(init_params()), acc.make_state(init_params())
  pp, sp = plain.make_params(init_params()), plain.make_state(init_params())
  for t in range(3):  # one period of H = 3 local steps, each on k micro-batches
    micro = [batch(k * t + j) for j in range(k)]
    held = jax.tree.map(np.asarray, pa)
    pa, sa, _ = acc.step(pa, sa, *acc.shard(_flat(*micro[0])))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, pa), held)  # accumulated, not applied
    pa, sa, loss = acc.step(pa, sa, *acc.shard(_flat(*micro[1])))
    whole = tuple(np.concatenate(parts, axis=1) for parts in zip(*micro))  # each device's k shards
    pp, sp, plain_loss = plain.step(pp, sp, *plain.shard(_flat(*whole)))
    jax.block_until_ready((loss, plain_loss))
    # The mean of k gradients against the gradient of the k-times-larger shard: two programs.
    chex.assert_trees_all_close(pa, pp, **rounding_tol(64))
  assert_identical_across_devices(jax.tree.map(np.asarray, pa))


@pytest.mark.parametrize("after", [lambda: optax.adamw(1e-3),
                                   lambda: optax.apply_if_finite(optax.identity(), 3)])
def test_anything_after_a_local_step_optimizer_in_a_chain_is_refused_in_one_line(after):
  # A guard's zero update would set the parameters to zero: nothing may follow.
  with pytest.raises(ValueError, match=r"^jaxcomp.sparseloco is followed in an optax.chain by .*"
                                       r"sets the parameters.*into its inner optimizer"):
    _dp_steps(optax.chain(_sparseloco(), after()), 1)


@pytest.mark.parametrize("compressor, got", [
    (lambda: optax.adam(1e-3), r"an optax transformation that is not a jaxcomp compressor"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=2),
     r"jaxcomp.diloco, a whole optimizer that sets the parameters"),
])
@pytest.mark.parametrize("factory", [jaxcomp.diloco,
                                     functools.partial(jaxcomp.streaming_diloco, fragments=1)])
def test_a_compressor_that_is_not_a_jaxcomp_mean_is_refused_at_construction(factory, compressor,
                                                                             got):
  with pytest.raises(TypeError, match=r"compressor must be a jaxcomp compressor, the cross-device "
                                      r"mean .*got " + got):
    factory(optax.sgd(0.1), sync_every=2, compressor=compressor())


def test_a_compressor_over_another_axis_is_refused_naming_both():
  with pytest.raises(ValueError, match=r"diloco: its compressor averages over 'batch', but diloco "
                                       r"synchronizes over 'slow': pass axis_name='slow'"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=2, axis_name="slow",
                   compressor=jaxcomp.fp16_compress())


@pytest.mark.parametrize("inner", [
    lambda: optax.chain(jaxcomp.allreduce(), optax.adamw(1e-2)),
    lambda: jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adamw(1e-2)),
])
def test_an_inner_optimizer_that_communicates_over_the_same_axis_is_refused(inner):
  # It would send on every local step (4 KiB per step in the report), silently.
  with pytest.raises(ValueError, match=r"sparseloco: its inner optimizer communicates over 'batch' "
                                       r"on every local step \(.*\), so the steps would not be "
                                       r"local"):
    _dp_steps(_sparseloco(inner()), 1)
