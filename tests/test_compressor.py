"""The two protocols' adapters: what they derive from an algorithm's config, init and step (a
cross-device mean, ``compressor.transformation``; an optimizer that owns the parameters,
``local_steps.transformation``), on toy algorithms whose results are known exactly, and that every
public factory is built by one of them."""

import dataclasses
import functools
import inspect
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from compressors import ALGORITHMS, COMPRESSORS
from helpers import assert_identical_across_devices, replicate, run_updates
from jaxcomp._src import axis, compressor, finite, local_steps, phases, validate
from jaxcomp._src import tree as tree_lib
from jaxcomp.train.registry import REGISTRY

W = 4


# --- a toy mean: ÷W then sum, after a warm-up of one step that sends 2× the mean (to tell the
# phases apart); its state counts the finite steps it saw and keeps the last mean.

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ToyConfig(compressor.MeanConfig):
  name = "toy"

  scale: float = validate.setting(1.0, check=functools.partial(validate.number, low=0,
                                                               low_open=True), traceable=True)
  warmup: int = validate.setting(1, check=functools.partial(validate.integer,
                                                            static="fixes the phases"))

  def phases(self):
    return ((phases.Phase("toy.warmup", 0.0),) if self.warmup else ()) + (
        phases.Phase("toy.steady", 1.0),)

  def phase_of(self, count):
    return (count >= self.warmup).astype(jnp.int32)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OwnToyConfig(ToyConfig):
  NONFINITE = "own"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SelectToyConfig(ToyConfig):
  NONFINITE = "select"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class WholeTreeToyConfig(ToyConfig):
  def unbucketable(self):
    return "needs the whole tree"


class ToyState(NamedTuple):
  count: jax.Array
  last: tuple
  config: ToyConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()


def toy_init(config, signature):
  return ToyState(jnp.zeros([], jnp.int32),
                  tuple(jnp.zeros(s.shape, s.dtype) for s in signature.reduced_structs()),
                  config, signature)


def toy_step(config, state, leaves, axis_name, phase):
  factor = 2.0 if phase.name == "toy.warmup" else 1.0
  means = [factor * config.scale * axis.mean(g, axis_name) for g in leaves]
  return means, state._replace(last=tuple(means))


def toy_own_step(config, state, leaves, axis_name, phase):
  """The same, the finiteness flag taken from the means it reduced, the policy applied itself."""
  means, new_state = toy_step(config, state, leaves, axis_name, phase)
  ok = finite.reduced_finite(means)
  return finite.nan_unless_finite(ok, means), finite.keep_if_finite(ok, new_state, state), ok


def toy(config=None, step=toy_step, **transformation_settings):
  return compressor.transformation(config or ToyConfig(), toy_init, step, "batch",
                                   **transformation_settings)


def grads(seed=0, nan_on=None):
  g = {"w": np.random.default_rng(seed).normal(size=(W, 3, 2)).astype(np.float32),
       "n": np.zeros((W,), np.int32)}
  if nan_on is not None:
    g["w"][nan_on, 0, 0] = np.nan
  return g


# ------------------------------------------------------------------------------------------ means


def test_a_mean_is_a_declared_transformation_with_its_scatter():
  tx = toy()
  assert isinstance(tx, jaxcomp.Transformation) and isinstance(tx, optax.GradientTransformation)
  assert (tx.name, tx.axis_name, tx.output, tx.owns_params) == ("toy", "batch", "gradient", False)
  g = grads()
  (out,), _ = run_updates(tx, [g], W)
  shard = jax.pmap(tx.scatter, axis_name="batch", devices=jax.devices()[:W])(
      g, replicate(tx.init({"w": g["w"][0], "n": g["n"][0]}), W))[0]["w"]
  # The whole mean, this device's shard of it kept (flat layout: the raveled leaf cut in W).
  whole = np.asarray(out["w"][0]).ravel()
  padded = np.pad(whole, (0, -whole.size % W)).reshape(W, -1)
  np.testing.assert_array_equal(np.asarray(shard).reshape(W, -1), padded)


def test_phases_run_in_turn_count_the_steps_and_label_the_report():
  tx = toy()
  outs, (*_, state) = run_updates(tx, [grads(0), grads(1)], W)
  mean = lambda s: grads(s)["w"].mean(0)  # noqa: E731
  np.testing.assert_allclose(outs[0]["w"][0], 2 * mean(0), rtol=1e-6)  # the warm-up phase
  np.testing.assert_allclose(outs[1]["w"][0], mean(1), rtol=1e-6)
  np.testing.assert_array_equal(outs[1]["n"], grads(1)["n"])  # integer leaves pass through
  assert np.asarray(state.count).tolist() == [2] * W
  assert_identical_across_devices(outs[1])
  # The configuration names its phases after the transformation.
  step = jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W])
  report = jaxcomp.comm_report(step, grads(), replicate(tx.init(jax.tree.map(lambda x: x[0],
                                                                            grads())), W))
  assert set(report.phase_names) == {"toy.warmup", "toy.steady"}


@pytest.mark.parametrize("nonfinite", ["skip", "select", "own"])
def test_each_way_of_the_nonfinite_policy_keeps_the_state_and_returns_nan_everywhere(nonfinite):
  config = {"skip": ToyConfig, "select": SelectToyConfig, "own": OwnToyConfig}[nonfinite](warmup=0)
  assert config.NONFINITE == nonfinite
  tx = toy(config, toy_own_step if nonfinite == "own" else toy_step)
  outs, (*_, state) = run_updates(tx, [grads(0), grads(1, nan_on=2), grads(2)], W)
  assert np.isnan(np.asarray(outs[1]["w"])).all()  # every device, every element
  assert np.asarray(state.count).tolist() == [2] * W  # the non-finite step was not counted
  np.testing.assert_allclose(state.last[0][0], grads(2)["w"].mean(0), rtol=1e-6)
  _, (*_, kept) = run_updates(tx, [grads(0), grads(1, nan_on=2)], W)
  np.testing.assert_array_equal(kept.last[0], run_updates(tx, [grads(0)], W)[1][0].last[0])


def test_traceable_settings_are_arrays_and_static_ones_are_refused_with_every_static_name():
  tx = optax.inject_hyperparams(
      lambda scale, warmup: toy(ToyConfig(scale=scale, warmup=warmup)),
      static_args=("warmup",))(scale=3.0, warmup=0)
  (out,), (state,) = run_updates(tx, [grads()], W)
  np.testing.assert_allclose(out["w"][0], 3 * grads()["w"].mean(0), rtol=1e-6)
  assert state.inner_state.config.scale is validate.TRACED  # the array stays out of the state
  with pytest.raises(TypeError, match=r"^toy: warmup is static .*not an array. Under "
                                      r"optax.inject_hyperparams pass static_args=\('warmup',\); "
                                      r"only scale may be scheduled$"):
    ToyConfig(warmup=jnp.asarray(1))
  with pytest.raises(TypeError, match=r"toy_state: no setting named 'rank'"):
    compressor.config_of(ToyConfig, "toy", rank=2)


def test_the_hook_runs_the_same_step_on_a_bucket():
  def hook(state, bucket):
    return compressor.run_hook(toy_step, state, bucket, "toy")

  tx = jaxcomp.comm_hook(hook, compressor.hook_state("toy", ToyConfig(warmup=0), toy_init))
  plain = toy(ToyConfig(warmup=0))
  g = {"w": grads()["w"]}
  np.testing.assert_allclose(run_updates(tx, [g], W)[0][0]["w"],
                             run_updates(plain, [g], W)[0][0]["w"], rtol=1e-6)
  with pytest.raises(TypeError, match=r"toy_hook needs the per-bucket state made by "
                                      r"jaxcomp.hooks.toy_state"):
    run_updates(jaxcomp.comm_hook(hook, optax.EmptyState()), [g], W)
  with pytest.raises(ValueError, match="bucket_cap_mb cannot be used here: needs the whole tree"):
    toy(WholeTreeToyConfig(), bucket_cap_mb=1.0)


# --------------------------------------------------------------- an optimizer that owns the params

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MoveConfig(validate.Config):
  name = "move"
  output = "assign"

  step_size: float = validate.setting(0.5, check=validate.number)


class MoveState(NamedTuple):
  count: jax.Array
  config: MoveConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()
  PARAMS_PER_DEVICE = True


def move_step(config, state, grads_, params, axis_name):
  """Each device moves its own parameters; every 2nd step they are set to their mean."""
  moved = jax.tree.map(lambda p, g: p - config.step_size * g, params, grads_)
  averaged = phases.when(state.count % 2 == 1, phases.Phase("move.sync", 0.5),
                         lambda t: local_steps.varying_like(local_steps.mean_reduced(t, axis_name),
                                                            t), moved)
  return averaged, state


def move_init(config, signature, params):
  del params
  return MoveState(jnp.zeros([], jnp.int32), config, signature)


def test_an_optimizer_that_owns_the_parameters_returns_assign_and_needs_them():
  tx = local_steps.transformation(MoveConfig(), move_init, move_step, "batch")
  assert tx.owns_params and tx.scatter is None
  params = {"w": np.ones((3,), np.float32)}
  g = [{"w": np.arange(W * 3, dtype=np.float32).reshape(W, 3) * s} for s in (1, 2)]

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    assert all(isinstance(u, jaxcomp.Assign) for u in jax.tree.leaves(
        updates, is_leaf=lambda x: isinstance(x, jaxcomp.Assign)))
    return optax.apply_updates(p, updates), s

  pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  p, s = replicate(params, W), replicate(tx.init(params), W)
  p, s = jax.block_until_ready(pstep(p, s, g[0]))
  np.testing.assert_array_equal(p["w"], 1 - 0.5 * g[0]["w"])  # apart
  p, s = jax.block_until_ready(pstep(p, s, g[1]))
  expected = (1 - 0.5 * g[0]["w"] - 0.5 * g[1]["w"]).mean(0)
  np.testing.assert_allclose(p["w"], np.broadcast_to(expected, (W, 3)), rtol=1e-6)  # averaged
  assert_identical_across_devices(p)
  assert np.asarray(s.count).tolist() == [2] * W
  with pytest.raises(ValueError, match=r"move sets the parameters, so its update needs them"):
    tx.update({"w": jnp.ones(3)}, tx.init(params))
  with pytest.raises(TypeError, match=r"move: update needs the state move's init made; got "
                                      r"EmptyState"):
    tx.update({"w": jnp.ones(3)}, optax.EmptyState(), params)


# -------------------------------------------------------------------- every factory, every hook


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_registry_entry_is_built_by_the_adapter(name):
  tx = COMPRESSORS[name]()
  entry = REGISTRY[name]
  if entry.wraps_optimizer:  # the optimizer itself, which sets the parameters
    assert isinstance(tx, jaxcomp.Transformation) and tx.output == "assign" and tx.owns_params
    assert tx.scatter is None
  elif entry.is_optimizer:  # a whole optimizer whose output is the update
    assert isinstance(tx, jaxcomp.Transformation) and tx.output == "update", tx
    assert tx.scatter is None and not tx.owns_params
  else:  # the compressor first in the chain: a declared mean with its reduce-scatter
    first = entry.make(steps=30)
    assert isinstance(first, jaxcomp.Transformation) and first.output == "gradient"
    assert callable(first.scatter) and first.axis_name == "batch"


def test_every_built_in_hook_is_a_module_level_function_with_a_docstring():
  for name in jaxcomp.hooks.__all__:
    hook = getattr(jaxcomp.hooks, name)
    if name.endswith("_hook"):
      assert inspect.isfunction(hook) and hook.__qualname__ == name, name
      assert hook.__doc__ and len(hook.__doc__) > 40, name
      assert list(inspect.signature(hook).parameters) == ["state", "bucket"], name


def test_a_chain_holding_jaxcomp_transformations_keeps_their_declarations_out_of_the_state():
  # The declaration lives on the transformation; its state is what it always was.
  tx = jaxcomp.powersgd(1)
  state = tx.init({"w": jnp.ones((4, 4))})
  assert type(state).__name__ == "PowerSGDState"
  chex.assert_trees_all_equal_structs(state, jax.eval_shape(tx.init, {"w": jnp.ones((4, 4))}))
