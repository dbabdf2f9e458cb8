"""The compressor protocol, and the one adapter that derives everything else from it.

Every jaxcomp algorithm is a module that holds its math and nothing else:

* a **configuration**: a frozen dataclass (data) that validates itself; it never holds ``axis_name``.
  The settings that may be arrays (``optax.inject_hyperparams`` schedules) are listed in
  ``Algorithm.traceable``; the configuration holds ``validate.TRACED`` in their place;
* **``init``**: the per-device state, a NamedTuple with ``count`` (steps taken; stateful algorithms),
  ``config`` and ``signature`` (the ``tree.TreeSignature`` of the gradient), and
  ``PER_DEVICE_FIELDS`` naming the fields that differ from device to device;
* **a pure step**, its steps numbered as in the module docstring, every collective through
  ``jaxcomp._src.axis``.

Two families share the protocol:

* **a cross-device mean** (the compressors): ``init(config, signature)``; ``step(config, state,
  leaves, axis_name, phase) -> (means, new_state)`` on the reduced leaves (floating point,
  non-empty, in the signature's order; any float dtype), returning the cross-device mean of each,
  the same on every device; ``phase`` is the ``phases.Phase`` this step is in (warm-up or steady),
  static. With ``Algorithm.nonfinite="own"`` it applies the non-finite policy itself, from values it
  already reduced (``finite.reduced_finite``) and where it costs least (the old state kept in the
  pass that writes the new one, NaN through a small factor), and returns ``(means, new_state,
  finite)``: no extra pass over the gradient, no flag sent. A whole optimizer whose output is the update
  (``Algorithm.output="update"``: 1-bit Adam) has the same step with a last argument ``params``,
  the reduced leaves of the parameters (None when ``update`` was not given them), for its weight
  decay;
* **an optimizer that owns the parameters** (``Algorithm.output="assign"``: local SGD, DiLoCo,
  Streaming DiLoCo, SparseLoCo): ``init(config, signature, params)``; ``step(config, state, grads,
  params, axis_name) -> (new_params, new_state)`` on whole pytrees. Its phases (``"sync"``, a
  fragment's pieces) are ``phases.when`` branches inside the step, and it applies the local-step
  part of the non-finite policy (``finite.kept_locally``, ``finite.keep_if_finite``).

``Algorithm`` bundles them. From it the adapter derives, for every algorithm alike:

1. ``transformation``: an ``interface.Transformation``, the optax ``GradientTransformation``
   that declares what it is — the state and signature checks, the refusal of a gradient that
   autodiff already summed over the devices, the phase labels (``phases.owned_by`` the
   algorithm's public name, read by ``comm_report``), ``count``, the refusal of the optax wrappers
   a step must not run inside (``optax_wrappers.check``, once per trace), and the non-finite
   policy of ``finite.py``. A mean is gated: by a ``lax.cond`` on ``finite.all_finite``
   (``"skip"``: no collective but the flag's 4 bytes on such a step), by replacing its results
   (``"select"``), or by its own flag (``"own"``). A whole optimizer whose output is the update
   (``output="update"``) refuses an optimizer after it in an ``optax.chain``; one that owns the
   parameters needs them (``update(grads, state, params)``), returns ``local_steps.Assign``
   updates, refuses anything after it, and its inner optimizer may not communicate over its axis
   (``local_steps.local_update``);
2. with ``bucket_cap_mb``, the same on DDP's buckets: one state and one set of collectives per bucket
   (``buckets.comm_hook`` with the algorithm's hook), so that each bucket's collectives depend on its
   own gradients only;
3. ``run_hook`` and ``bucket_state``: the per-bucket hook ``hook(state, bucket)`` of ``comm_hook``
   (``jaxcomp.hooks`` defines one per algorithm with it) and the factory of its per-bucket state,
   running the same step on the bucket's parameters;
4. traced hyperparameters: ``configure`` refuses every static setting given as an array in one error
   that names every setting ``optax.inject_hyperparams`` must leave static, and hands the
   traceable ones to the step as arrays;
5. the reduce-scatter for sharded optimizer state (``jaxcomp.sharded_optimizer``):
   ``interface.Transformation.scatter(updates, state) -> (shards, state)`` gives this device its
   shard (``shards.py``'s layout) of each leaf's mean, with 1–4 as for ``update``: the algorithm's own
   ``scatter`` where it has one (the dense means' ``psum_scatter``), else the whole mean with this
   device's shard kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, buckets, finite, interface, kernels, local_steps, optax_wrappers
from jaxcomp._src import phases, shards, validate
from jaxcomp._src import tree as tree_lib

STEADY = phases.Phase("steady", 1.0)
NONFINITE = ("skip", "select", "own")


def _one_phase(config) -> tuple:
  del config
  return (STEADY,)


def _first_phase(config, count) -> jax.Array:
  del config, count
  return jnp.zeros([], jnp.int32)


def _anywhere(config) -> Optional[str]:
  del config
  return None


def _any(config) -> bool:
  del config
  return True


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An algorithm, as the adapter sees it.

  Attributes:
    name: the public name of its transformation, for messages and phase labels (``"powersgd"``).
    state: the type of its state.
    configure: ``configure(**settings) -> config``: the configuration from the public factory's
      keyword arguments (usually the configuration class itself).
    init: ``init(config, signature) -> state`` (``init(config, signature, params)`` with
      ``owns_params``).
    step: the step of its family (the module docstring).
    phases: ``phases(config) -> tuple of phases.Phase``, the branches of a mean's step; one by
      default.
    phase_of: ``phase_of(config, count) -> int32``: the index into ``phases(config)`` of the step
      taken at ``count``.
    stateful: it keeps a state that a non-finite gradient must not touch (and a ``count``). The
      dense means keep none: a NaN on one device makes that coordinate of the mean NaN everywhere.
    traceable: the settings that may be arrays (``optax.inject_hyperparams`` schedules).
    unbucketable: ``unbucketable(config) -> reason or None``: why it cannot run bucket by bucket
      (DGC's local clipping needs the whole gradient's norm).
    nonfinite: how a mean's non-finite step keeps the state (``finite.guarded``): ``"skip"``, a
      ``lax.cond`` that does not run the step (no collectives; with the state donated, XLA updates
      it in place inside the branch); ``"select"``, the step runs and its results are replaced —
      for steps XLA:CPU compiles worse inside a conditional branch (it leaves their
      concatenations unfused and copies the state in and out: quantized's and 1-bit Adam's
      updates need more temporaries and time under the cond); ``"own"``, the step returns the
      all-device flag from values it reduces anyway, keeps its state and makes its outputs NaN
      itself where the flag is false (no extra pass over the gradient); the adapter counts only
      the finite steps.
    is_own_config: ``is_own_config(config) -> bool``: whether a state of type ``state`` holding
      ``config`` is this algorithm's, for two algorithms with one state type (PowerSGD and batched
      PowerSGD): a hook given the other's state is refused. Any, by default.
    scatter: ``scatter(config, state, leaves, axis_name, phase) -> (shards, state)``: the step as a
      reduce-scatter, this device's shard (``shards.own``) of each leaf's mean; None (the default):
      the step's mean, of which each device keeps its shard.
    scatter_unused: the state's fields that ``scatter`` neither reads nor writes, which the
      state made for it (``interface.Transformation.scatter_init``) holds as ``optax.MaskedNode``.
    output: what the transformation returns (``interface.OUTPUTS``): ``"gradient"``, the mean
      (or a direction from it, for an optimizer to follow); ``"update"``, a whole optimizer's
      update (the step scales its direction by the learning rate; nothing but guards may follow
      it); ``"assign"``, for the family that owns the parameters (its own init and step).
    direction: for an ``"update"``, the public name of the transformation that computes the same
      direction without the learning rate (``"scale_by_onebit_adam"``), which the refusal of an
      optimizer after it offers; None if there is none.
  """
  name: str
  state: type
  configure: Callable
  init: Callable
  step: Callable
  phases: Callable = _one_phase
  phase_of: Callable = _first_phase
  stateful: bool = True
  traceable: tuple = ()
  unbucketable: Callable = _anywhere
  nonfinite: str = "skip"
  is_own_config: Callable = _any
  scatter: Optional[Callable] = None
  scatter_unused: tuple = ()
  output: str = "gradient"
  direction: Optional[str] = None

  def __post_init__(self):
    validate.choice(self.nonfinite, "nonfinite", NONFINITE)
    validate.choice(self.output, "output", interface.OUTPUTS)

  @property
  def owns_params(self) -> bool:
    """The family that owns the parameters (``output="assign"``)."""
    return self.output == "assign"


def configure(algorithm: Algorithm, settings: dict) -> tuple:
  """``(config, traced)``: the configuration, with ``validate.TRACED`` for the traceable settings
  given as arrays, and those arrays by name.

  Raises:
    TypeError: static settings were given as arrays; the message lists every setting that must be
      static under ``optax.inject_hyperparams`` (those already Python numbers too).
  """
  arrays = [name for name, value in settings.items() if validate.is_array(value)]
  static = [name for name in arrays if name not in algorithm.traceable]
  if static:
    # inject_hyperparams turns every number it is not told is static into an array: the fix names
    # them all, those already static included, or copying it would drop them.
    numbers = [name for name, value in settings.items() if name not in algorithm.traceable and (
        name in static or (isinstance(value, (int, float)) and not isinstance(value, bool)))]
    listed = ", ".join(repr(n) for n in numbers) + ("," if len(numbers) == 1 else "")
    raise TypeError(
        f"{algorithm.name}: {', '.join(static)} "
        + ("is static (it fixes shapes or which program runs) and must be a Python value, not an "
           "array" if len(static) == 1 else
           "are static (they fix shapes or which program runs) and must be Python values, not "
           "arrays")
        + f". Under optax.inject_hyperparams pass static_args=({listed})"
        + (f"; only {', '.join(algorithm.traceable)} may be scheduled" if algorithm.traceable
           else ""))
  traced = {name: settings[name] for name in arrays}
  try:
    config = algorithm.configure(**{name: validate.TRACED if name in traced else value
                                    for name, value in settings.items()})
  except TypeError as e:
    if "unexpected keyword argument" not in str(e):
      raise
    unexpected = e.args[0].split("argument ")[-1]
    raise TypeError(f"{algorithm.name}: no setting named {unexpected}; the settings are "
                    f"jaxcomp.{algorithm.name}'s arguments, but axis_name (a hook uses its bucket's) "
                    "and bucket_cap_mb (comm_hook's)") from None
  # A concrete array is checked as its number would be (a tracer cannot be).
  _live(config, {n: v for n, v in traced.items() if not isinstance(v, jax.core.Tracer)})
  return config, traced


def _live(config, traced: dict):
  """The configuration the step computes with: the traced arrays in place of ``TRACED``."""
  return dataclasses.replace(config, **traced) if traced else config


def run_step(algorithm: Algorithm, config, state, leaves: list, axis_name,
             step: Optional[Callable] = None) -> tuple:
  """A mean's phase switch, step (``algorithm.step``, or ``step`` of the same signature) and count
  on the reduced ``leaves``: ``(means, new_state, finite)``, ``finite`` the step's own flag
  (``nonfinite="own"``) or None."""
  step = step or algorithm.step
  all_phases = algorithm.phases(config)
  branches = [lambda s, g, p=p: step(config, s, g, axis_name, p) for p in all_phases]
  with phases.owned_by(algorithm.name):
    if len(all_phases) == 1 and all_phases[0] is STEADY:
      results = branches[0](state, leaves)
    else:
      results = phases.switch(algorithm.phase_of(config, state.count), all_phases, branches,
                              state, leaves)
  means, new_state, ok = results if algorithm.nonfinite == "own" else (*results, None)
  if algorithm.stateful:
    new_state = new_state._replace(count=state.count + (1 if ok is None else ok.astype(jnp.int32)))
  return list(means), new_state, ok


def _mean(algorithm: Algorithm, config, state, leaves: list, axis_name,
          step: Optional[Callable], shape_of: Callable) -> tuple:
  """``run_step`` under the non-finite policy (``Algorithm.nonfinite`` says how); ``shape_of(leaf)``
  is the shape of its output (a shard's with ``step=algorithm.scatter``)."""
  if not algorithm.stateful or not leaves or algorithm.nonfinite == "own":  # "own": its step's
    return run_step(algorithm, config, state, leaves, axis_name, step)[:2]
  with kernels.part("nonfinite"):
    ok = finite.all_finite(leaves, axis_name)
  run = lambda s, g: run_step(algorithm, config, s, g, axis_name, step)[:2]  # noqa: E731
  return finite.guarded(algorithm.nonfinite, ok, run, shape_of, state, leaves)


def transformation(algorithm: Algorithm, axis_name: axis.AxisName,
                   bucket_cap_mb: Optional[float] = None, **settings) -> interface.Transformation:
  """The optax transformation of ``algorithm`` with ``settings`` (the module docstring, 1–2 and 4).

  Args:
    algorithm: the algorithm.
    axis_name: the mapped axis to average over.
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one set of collectives per bucket.
    **settings: the configuration's settings (``algorithm.configure``'s arguments).

  Returns:
    An ``interface.Transformation``: the cross-device mean (or what ``algorithm.output`` says),
    identical on every device, or the ``Assign`` updates of an optimizer that owns the
    parameters.
  """
  axis_name = axis.check_axis_name(axis_name)
  config, traced = configure(algorithm, settings)
  if algorithm.owns_params:
    return _owning_params(algorithm, config, axis_name)
  if bucket_cap_mb is not None:
    cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True,
                          static="decides which leaves share a collective")
    reason = algorithm.unbucketable(config)
    if reason:
      raise ValueError(f"{algorithm.name}: bucket_cap_mb cannot be used here: {reason}")
    bucketed = buckets.comm_hook(_bucket_hook(algorithm, traced), bucket_state(algorithm, config),
                                 axis_name=axis_name, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    return _declared(algorithm, axis_name, bucketed.init, bucketed.update, bucketed.scatter)

  def init_fn(params):
    return algorithm.init(config, tree_lib.TreeSignature.of(params))

  def scatter_init_fn(params):
    state = init_fn(params)
    return state._replace(**{field: jax.tree.map(lambda _: optax.MaskedNode(),
                                                 getattr(state, field))
                             for field in algorithm.scatter_unused})

  def apply(updates, state, params, step: Optional[Callable], shape_of: Callable,
            made_by: Callable = init_fn):
    """1 (and 5 with ``step=algorithm.scatter``, on the state ``made_by`` makes):
    ``(outputs, new_state)``."""
    optax_wrappers.check(algorithm.name, axis_name)
    tree_lib.check_state(state, made_by, algorithm.name)
    leaves = state.signature.check(updates)
    reduced = [leaves[i] for i in state.signature.reduced]
    axis.refuse_summed_gradient(reduced, axis_name, algorithm.name)
    if algorithm.output == "update":  # a whole optimizer's step sees the parameters (or None)
      picked = None if params is None else state.signature.pick(tree_lib.unwrap(params))
      step = functools.partial(step or algorithm.step, params=picked)
    means, new_state = _mean(algorithm, _live(state.config, traced), state, reduced, axis_name,
                             step, shape_of)
    for i, mean in zip(state.signature.reduced, means):
      leaves[i] = mean
    return tree_lib.like(updates, leaves), new_state

  def update_fn(updates, state, params=None):
    with kernels.part("update"):
      return apply(updates, state, params, None, lambda x: x.shape)

  def scatter_fn(updates, state):
    cut = shards.layout(axis_name)
    with kernels.part("update"):
      return apply(updates, state, None, algorithm.scatter, lambda x: cut.shape(x.shape),
                   scatter_init_fn)

  if not algorithm.scatter:
    return _declared(algorithm, axis_name, init_fn, update_fn,
                     interface.own_shard_of(update_fn, axis_name))
  return _declared(algorithm, axis_name, init_fn, update_fn, scatter_fn, scatter_init_fn)


def _declared(algorithm: Algorithm, axis_name: axis.AxisName, init_fn: Callable,
              update_fn: Callable, scatter: Callable,
              scatter_init: Optional[Callable] = None) -> interface.Transformation:
  """The ``interface.Transformation`` of a mean's ``init_fn`` and ``update_fn``: with its scatter
  (and the state for it) for a ``"gradient"``; for an ``"update"`` (a whole optimizer) refusing an
  optimizer after it in an ``optax.chain``, which would take its update for a gradient."""
  if algorithm.output == "gradient":
    return interface.Transformation(init_fn, update_fn, name=algorithm.name, axis_name=axis_name,
                                    scatter=scatter, scatter_init=scatter_init)

  def last_in_chain(updates, state, params=None):
    optax_wrappers.check_last_in_chain(
        f"jaxcomp.{algorithm.name}",
        alternative=algorithm.direction and f"jaxcomp.{algorithm.direction}")
    return update_fn(updates, state, params)

  return interface.Transformation(init_fn, last_in_chain, name=algorithm.name,
                                  axis_name=axis_name, output=algorithm.output)


def _owning_params(algorithm: Algorithm, config,
                   axis_name: axis.AxisName) -> interface.Transformation:
  """1 for an optimizer that owns the parameters."""
  name = algorithm.name

  def init_fn(params):
    params = tree_lib.unwrap(params)
    return algorithm.init(config, tree_lib.TreeSignature.of(params), params)

  def update_fn(updates, state, params=None):
    optax_wrappers.check(name, axis_name)
    optax_wrappers.check_last_in_chain(f"jaxcomp.{name}", sets_params=True)
    if not isinstance(state, algorithm.state):
      raise TypeError(f"{name}: update needs the state {name}'s init made, a "
                      f"{algorithm.state.__name__}; got {type(state).__name__}")
    grads = state.signature.unflatten(state.signature.check(updates))
    if params is None:
      raise ValueError(f"{name} sets the parameters, so its update needs them: call "
                       "tx.update(grads, state, params) (nnx.Optimizer and the usual optax loop "
                       "do)")
    params = state.signature.unflatten(state.signature.check(params, "params"))
    axis.refuse_summed_gradient(state.signature.pick(grads), axis_name, name)
    with kernels.part("update"), phases.owned_by(name):
      new_params, new_state = algorithm.step(state.config, state, grads, params, axis_name)
    new_state = new_state._replace(count=state.count + 1)
    return local_steps.assign(new_params), new_state

  return interface.Transformation(init_fn, update_fn, name=name, axis_name=axis_name,
                                  output="assign")


def run_hook(algorithm: Algorithm, state, bucket: buckets.GradBucket, traced: Optional[dict] = None,
             name: Optional[str] = None) -> tuple:
  """``algorithm``'s step as a hook of ``comm_hook``: ``(buffer, state)`` for ``bucket``.

  The step runs on the bucket's parameters (their paths name them, as in the whole pytree), in the
  bucket's dtype (a hook under ``fp16_compress_wrapper`` computes in float16; the state keeps its
  own dtypes); ``comm_hook`` applies the non-finite policy. ``name`` is the public prefix of the
  hook and its state factory in ``jaxcomp.hooks`` (default the algorithm's name).
  """
  name = name or algorithm.name
  if not isinstance(state, algorithm.state) or not algorithm.is_own_config(state.config):
    raise TypeError(f"{name}_hook needs the per-bucket state made by jaxcomp.hooks.{name}_state"
                    f"(...), as in comm_hook(jaxcomp.hooks.{name}_hook, "
                    f"jaxcomp.hooks.{name}_state()); got {type(state).__name__}")
  leaves = state.signature.check(bucket.gradients(), "bucket", dtypes=False)
  reduced = [leaves[i] for i in state.signature.reduced]
  means, state, _ = run_step(algorithm, _live(state.config, traced or {}), state, reduced,
                             bucket.axis_name)
  for i, mean in zip(state.signature.reduced, means):
    leaves[i] = mean
  return tree_lib.flatten(leaves), state


def _bucket_hook(algorithm: Algorithm, traced: dict) -> buckets.Hook:
  """The hook of ``algorithm`` with its traced settings, for ``transformation``'s buckets."""
  def hook(state, bucket):
    return run_hook(algorithm, state, bucket, traced)
  hook.__name__ = f"{algorithm.name}_hook"
  return hook


def bucket_state(algorithm: Algorithm, config) -> Callable[[buckets.GradBucket], Any]:
  """The per-bucket state factory of ``comm_hook``: ``init`` on the bucket's parameters."""
  return lambda bucket: algorithm.init(
      config, tree_lib.TreeSignature.of(bucket.gradients(), paths=bucket.paths))


def hook_state(algorithm: Algorithm, settings: dict,
               name: Optional[str] = None) -> Callable[[buckets.GradBucket], Any]:
  """``bucket_state`` from the public factory's settings (``jaxcomp.hooks.<name>_state``; ``name``
  defaults to the algorithm's)."""
  name = name or algorithm.name
  arrays = [key for key, value in settings.items() if validate.is_array(value)]
  if arrays:
    raise TypeError(f"{name}_state: {', '.join(arrays)} must be Python values: a hook's state is "
                    "made once, outside any step; schedule them with the transformation, "
                    f"jaxcomp.{algorithm.name}(..., bucket_cap_mb=...), under "
                    "optax.inject_hyperparams")
  config, _ = configure(algorithm, settings)
  reason = algorithm.unbucketable(config)
  if reason:
    raise ValueError(f"{name}_state: {reason}")
  return bucket_state(algorithm, config)
