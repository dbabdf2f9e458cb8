"""The compressor protocol, and the one adapter that derives everything else from it.

Every jaxcomp compressor is an algorithm module that holds its math and nothing else:

* a **configuration**: a frozen dataclass (data) that validates itself; it never holds ``axis_name``.
  The settings that may be arrays (``optax.inject_hyperparams`` schedules) are listed in
  ``Algorithm.traceable``; the configuration holds ``validate.TRACED`` in their place;
* **``init(config, signature) -> state``**: the per-device state for gradients of that
  ``tree.TreeSignature``, a NamedTuple with ``count`` (steps taken; stateful algorithms), ``config``
  and ``signature``, and ``PER_DEVICE_FIELDS`` naming the fields that differ from device to device;
* **a pure step** ``step(config, state, leaves, axis_name, phase) -> (means, new_state)``: the math
  on the reduced leaves (floating point, non-empty, in the signature's order; any float dtype), every
  collective through ``jaxcomp._src.axis``, returning the cross-device mean of each (the same on every
  device) and the new state (``count`` is the adapter's); ``phase`` is the ``phases.Phase`` this step
  is in (warm-up or steady), static.

``Algorithm`` bundles them. From it the adapter derives, for every algorithm alike:

1. ``transformation``: the optax ``GradientTransformation`` — the state and signature checks, the
   refusal of a gradient that autodiff already summed over the devices, the phase switch (each
   phase's collectives labelled for ``comm_report``), ``count``, and the non-finite policy of
   ``finite.py``: a step whose gradient is not finite on some device keeps the state exactly and
   returns NaN on every device. By default the step is skipped by a ``lax.cond`` on the all-device
   flag (the same everywhere, so every device takes the same branch): such a step runs no
   collective but the flag's 4 bytes. An algorithm may instead have its step run and its results
   replaced (``Algorithm.nonfinite="select"``: the outputs by NaN, the new state by the old,
   ``finite.gated``), where XLA compiles the step inside a conditional with more memory (see
   ``Algorithm``);
2. with ``bucket_cap_mb``, the same on DDP's buckets: one state and one set of collectives per bucket
   (``buckets.comm_hook`` with the algorithm's hook), so that each bucket's collectives depend on its
   own gradients only;
3. ``hook`` and ``bucket_state``: the per-bucket hook ``hook(state, bucket)`` of ``comm_hook`` and the
   factory of its per-bucket state, running the same step on the bucket's parameters;
4. traced hyperparameters: ``configure`` refuses every static setting given as an array in one error
   that lists them all (the ``static_args`` that ``optax.inject_hyperparams`` needs), and hands the
   traceable ones to the step as arrays;
5. the reduce-scatter for sharded optimizer state (``jaxcomp.sharded_optimizer``): the
   transformation's ``update.scatter(updates, state) -> (shards, state)`` gives this device its
   shard (``shards.py``'s layout) of each leaf's mean, with 1–4 as for ``update``: the algorithm's
   own ``scatter`` where it has one (the dense means' ``psum_scatter``), else the whole mean with
   this device's shard kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp._src import axis, buckets, finite, kernels, phases, shards, validate
from jaxcomp._src import tree as tree_lib

_MIB = 1024 * 1024
STEADY = phases.Phase("steady", 1.0)


def _one_phase(config) -> tuple:
  del config
  return (STEADY,)


def _first_phase(config, count) -> jax.Array:
  del config, count
  return jnp.zeros([], jnp.int32)


def _anywhere(config) -> Optional[str]:
  del config
  return None


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An algorithm, as the adapter sees it.

  Attributes:
    name: the public name of its transformation, for messages and phase labels (``"powersgd"``).
    state: the type of its state.
    configure: ``configure(**settings) -> config``: the configuration from the public factory's
      keyword arguments (usually the configuration class itself).
    init: ``init(config, signature) -> state``.
    step: ``step(config, state, leaves, axis_name, phase) -> (means, state)``.
    phases: ``phases(config) -> tuple of phases.Phase``, the branches of the step; one by default.
    phase_of: ``phase_of(config, count) -> int32``: the index into ``phases(config)`` of the step
      taken at ``count``.
    stateful: it keeps a state that a non-finite gradient must not touch (and a ``count``). The
      dense means keep none: a NaN on one device makes that coordinate of the mean NaN everywhere.
    traceable: the settings that may be arrays (``optax.inject_hyperparams`` schedules).
    unbucketable: ``unbucketable(config) -> reason or None``: why it cannot run bucket by bucket
      (DGC's local clipping needs the whole gradient's norm).
    nonfinite: how a non-finite step keeps the state: ``"skip"``, a ``lax.cond`` that does not run
      the step (no collectives; with the state donated, XLA updates it in place inside the
      branch); or ``"select"``, the step runs and ``finite.gated`` keeps the old state (written in
      place: ``finite.keep_if_finite``) and outputs NaN — for steps XLA:CPU compiles worse inside a
      conditional branch (it leaves their concatenations unfused and copies the state in and out:
      quantized's and 1-bit Adam's updates need more temporaries and time under the cond).
    scatter: ``scatter(config, state, leaves, axis_name, phase) -> (shards, state)``: the step as a
      reduce-scatter, this device's shard (``shards.own``) of each leaf's mean; None (the default):
      the step's mean, of which each device keeps its shard.
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
  scatter: Optional[Callable] = None


def configure(algorithm: Algorithm, settings: dict) -> tuple:
  """``(config, traced)``: the configuration, with ``validate.TRACED`` for the traceable settings
  given as arrays, and those arrays by name.

  Raises:
    TypeError: static settings were given as arrays; the message lists all of them at once.
  """
  arrays = [name for name, value in settings.items() if validate.is_array(value)]
  static = [name for name in arrays if name not in algorithm.traceable]
  if static:
    names = ", ".join(static)
    listed = ", ".join(repr(n) for n in static) + ("," if len(static) == 1 else "")
    raise TypeError(
        f"{algorithm.name}: {names} "
        + ("is static (it fixes shapes or which program runs) and must be a Python value"
           if len(static) == 1 else
           "are static (they fix shapes or which program runs) and must be Python values")
        + ", not arrays. Under optax.inject_hyperparams "
        f"pass static_args=({listed})"
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
  """The phase switch, the step (``algorithm.step``, or ``step`` of the same signature) and the
  count, on the reduced ``leaves``; no non-finite policy."""
  step = step or algorithm.step
  all_phases = algorithm.phases(config)
  qualified = [p._replace(name=f"{algorithm.name}.{p.name}") for p in all_phases]
  branches = [lambda s, g, p=p: step(config, s, g, axis_name, p) for p in all_phases]
  if len(all_phases) == 1 and all_phases[0] is STEADY:
    means, new_state = branches[0](state, leaves)
  else:
    means, new_state = phases.switch(algorithm.phase_of(config, state.count), qualified, branches,
                                     state, leaves)
  if algorithm.stateful:
    new_state = new_state._replace(count=state.count + 1)
  return list(means), new_state


def _skip(shape_of: Callable, state, leaves: list) -> tuple:
  """The non-finite branch: NaN outputs (of ``shape_of(leaf)``) on every device, the state as it
  was."""
  return [jnp.full(shape_of(x), jnp.nan, x.dtype) for x in leaves], state


def _owning(update: Callable, axis_name: axis.AxisName) -> Callable:
  """``scatter`` from ``update``: the whole mean, of which this device keeps its shard."""
  def scatter(updates, state):
    means, state = update(updates, state)
    return tree_lib.map_reduced(lambda m: shards.own(m, axis_name), means), state
  return scatter


def _guarded(algorithm: Algorithm, config, state, leaves: list, axis_name,
             step: Optional[Callable], shape_of: Callable) -> tuple:
  """``run_step`` under the non-finite policy (``Algorithm.nonfinite`` says how); ``shape_of(leaf)``
  is the shape of its output (a shard's with ``step=algorithm.scatter``)."""
  with kernels.part("nonfinite"):
    ok = finite.all_finite(leaves, axis_name)
  run = lambda s, g: run_step(algorithm, config, s, g, axis_name, step)  # noqa: E731
  if algorithm.nonfinite == "skip":
    return lax.cond(ok, run, functools.partial(_skip, shape_of), state, leaves)
  means, new_state = run(state, leaves)
  with kernels.part("nonfinite"):
    return finite.gated(ok, means, new_state, state)


def transformation(algorithm: Algorithm, axis_name: axis.AxisName,
                   bucket_cap_mb: Optional[float] = None,
                   **settings) -> optax.GradientTransformation:
  """The optax transformation of ``algorithm`` with ``settings`` (the module docstring, 1–2 and 4).

  Args:
    algorithm: the algorithm.
    axis_name: the mapped axis to average over.
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one set of collectives per bucket.
    **settings: the configuration's settings (``algorithm.configure``'s arguments).

  Returns:
    A ``GradientTransformation`` whose output is the cross-device mean, identical on every device.
  """
  axis_name = axis.check_axis_name(axis_name)
  config, traced = configure(algorithm, settings)
  if bucket_cap_mb is not None:
    cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True,
                          static="decides which leaves share a collective")
    reason = algorithm.unbucketable(config)
    if reason:
      raise ValueError(f"{algorithm.name}: bucket_cap_mb cannot be used here: {reason}")
    bucketed = buckets.comm_hook(hook(algorithm, traced), bucket_state(algorithm, config),
                                 axis_name=axis_name, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    bucketed.update.scatter = _owning(bucketed.update, axis_name)
    return bucketed

  def init_fn(params):
    return algorithm.init(config, tree_lib.TreeSignature.of(params))

  def apply(updates, state, step: Optional[Callable], shape_of: Callable):
    """1 (and 5 with ``step=algorithm.scatter``): ``(outputs, new_state)``."""
    tree_lib.check_state(state, init_fn, algorithm.name)
    leaves = state.signature.check(updates)
    reduced = [leaves[i] for i in state.signature.reduced]
    axis.refuse_summed_gradient(reduced, axis_name, algorithm.name)
    live = _live(state.config, traced)
    if algorithm.stateful and reduced:
      means, new_state = _guarded(algorithm, live, state, reduced, axis_name, step, shape_of)
    else:
      means, new_state = run_step(algorithm, live, state, reduced, axis_name, step)
    for i, mean in zip(state.signature.reduced, means):
      leaves[i] = mean
    return tree_lib.like(updates, leaves), new_state

  def update_fn(updates, state, params=None):
    del params
    with kernels.part("update"):
      return apply(updates, state, None, lambda x: x.shape)

  def scatter_fn(updates, state):
    cut = shards.layout(axis_name)
    with kernels.part("update"):
      return apply(updates, state, algorithm.scatter, lambda x: cut.shape(x.shape))

  update_fn.scatter = scatter_fn if algorithm.scatter else _owning(update_fn, axis_name)
  return optax.GradientTransformation(init_fn, update_fn)


def hook(algorithm: Algorithm, traced: Optional[dict] = None,
         name: Optional[str] = None) -> buckets.Hook:
  """``algorithm``'s per-bucket hook for ``comm_hook``: ``hook(state, bucket) -> (buffer, state)``.

  The step runs on the bucket's parameters (their paths name them, as in the whole pytree), in the
  bucket's dtype (a hook under ``fp16_compress_wrapper`` computes in float16; the state keeps its
  own dtypes); ``comm_hook`` applies the non-finite policy. ``name`` is the public prefix of the
  hook and its state factory in ``jaxcomp.hooks`` (default the algorithm's name).
  """
  name = name or algorithm.name

  def run_hook(state, bucket: buckets.GradBucket):
    if not isinstance(state, algorithm.state):
      raise TypeError(f"{name}_hook needs the per-bucket state made by jaxcomp.hooks.{name}_state"
                      f"(...), as in comm_hook(jaxcomp.hooks.{name}_hook, "
                      f"jaxcomp.hooks.{name}_state()); got {type(state).__name__}")
    leaves = state.signature.check(bucket.gradients(), "bucket", dtypes=False)
    reduced = [leaves[i] for i in state.signature.reduced]
    means, state = run_step(algorithm, _live(state.config, traced or {}), state, reduced,
                            bucket.axis_name)
    for i, mean in zip(state.signature.reduced, means):
      leaves[i] = mean
    return tree_lib.flatten(leaves), state

  run_hook.__name__ = f"{name}_hook"
  return run_hook


def bucket_state(algorithm: Algorithm, config) -> Callable[[buckets.GradBucket], Any]:
  """The per-bucket state factory of ``comm_hook``: ``init`` on the bucket's parameters."""
  return lambda bucket: algorithm.init(
      config, tree_lib.TreeSignature.of(bucket.gradients(), paths=bucket.paths))


def hook_state(algorithm: Algorithm, settings: dict) -> Callable[[buckets.GradBucket], Any]:
  """``bucket_state`` from the public factory's settings (``jaxcomp.hooks.*_state``)."""
  config, traced = configure(algorithm, settings)
  if traced:
    raise TypeError(f"{algorithm.name}_state: {', '.join(traced)} must be Python values: a hook's "
                    "state is made once, outside any step; schedule them with the transformation, "
                    f"jaxcomp.{algorithm.name}(..., bucket_cap_mb=...), under optax.inject_hyperparams")
  reason = algorithm.unbucketable(config)
  if reason:
    raise ValueError(f"{algorithm.name}_state: {reason}")
  return bucket_state(algorithm, config)

