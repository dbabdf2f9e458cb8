"""The protocol of a cross-device mean, and the one adapter that derives everything else from it.

A compressor module (``dense``, ``powersgd``, ``dgc``, ``quantized``, ``sign``, ``chunked_topk``,
``onebit_adam``'s direction, ``dion``'s, ``demo``'s) holds its math and nothing else:

* a **configuration**: a frozen dataclass derived from ``MeanConfig``, its fields declared with
  ``validate.setting``, never holding ``axis_name``. It says what the adapter needs to know of the
  algorithm: its public ``name``, its ``phases`` and which one a step at ``count`` is in
  (``phase_of``), how it keeps to the non-finite policy (``NONFINITE``), whether it keeps a state
  that policy protects (``STATEFUL``), and why it could not run bucket by bucket
  (``unbucketable``);
* ``init(config, signature) -> state``: the per-device state, a NamedTuple with ``count`` (steps
  taken; stateful algorithms), ``config`` and ``signature`` (the ``tree.TreeSignature`` of the
  gradient), and ``PER_DEVICE_FIELDS`` naming the fields that differ from device to device;
* ``step(config, state, leaves, axis_name, phase) -> (means, new_state)`` on the reduced leaves
  (floating point, non-empty, in the signature's order), returning the cross-device mean of each
  (or a direction computed from it, ``scale_by_onebit_adam``'s), the same on every device; with
  ``NONFINITE = "own"`` it applies the non-finite policy itself, from values it already reduced,
  and returns ``(means, new_state, finite)``. Its steps are numbered in the module docstring. A
  whole optimizer whose output is the parameter update (``config.output == "update"``:
  ``onebit_adam``, ``demo``) takes the reduced leaves of the parameters too, ``params=`` (None
  where ``update`` was not given them), for its weight decay.

The factory builds the configuration once and hands it, with ``init`` and ``step``, to
``transformation``, which derives, for every compressor alike:

1. the optax transformation (an ``interface.Transformation``): the state and signature checks,
   the refusal of a gradient that is already the same on every device, the phase switch, ``count``
   and the non-finite policy of ``finite.py`` (a mean is gated by a ``lax.cond`` on
   ``finite.all_finite`` — ``"skip"``: no collective but the flag's 4 bytes on such a step —, by
   replacing its results — ``"select"`` —, or by its own flag — ``"own"``);
2. with ``bucket_cap_mb``, the same on DDP's buckets: one state and one set of collectives per
   bucket (``buckets.comm_hook``), so that each bucket's collectives depend on its own gradients;
3. ``run_hook`` and ``bucket_state``: the per-bucket hook ``hook(state, bucket)`` of
   ``comm_hook`` (``jaxcomp.hooks`` defines one per compressor with them) and its state factory;
4. traced hyperparameters: the configuration's arrays (``optax.inject_hyperparams`` schedules of
   its traceable settings) are kept out of the state (``validate.split_traced``) and handed to
   each step;
5. the reduce-scatter of sharded optimizer state (``jaxcomp.sharded_optimizer``):
   ``interface.Transformation.scatter(updates, state) -> (shards, state)`` gives this device its
   shard (``shards.py``'s layout) of each leaf's mean, with 1–4 as for ``update``: the algorithm's
   own ``scatter`` step where it has one (the dense means' ``psum_scatter``, quantized's qgZ), else
   the whole mean with this device's shard kept.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, buckets, finite, interface, kernels, phases, shards, validate
from jaxcomp._src import tree as tree_lib

STEADY = phases.Phase("steady", 1.0)  # the one phase of a step without phases: unlabelled


class MeanConfig(validate.Config):
  """The configuration of a cross-device mean: its settings, and what the adapter must know.

  Attributes:
    NONFINITE: how a step with a non-finite gradient keeps the state (``finite.guarded``):
      ``"skip"``, a ``lax.cond`` that does not run the step (no collectives; with the state
      donated, XLA updates it in place inside the branch); ``"select"``, the step runs and its
      results are replaced, for steps XLA:CPU compiles worse inside a conditional branch;
      ``"own"``, the step returns the all-device flag from values it reduces anyway, keeps its
      state and makes its outputs NaN itself (no extra pass over the gradient).
    STATEFUL: it keeps a state (and a ``count``) that a non-finite gradient must not touch. The
      dense means keep none: a NaN on one device makes that coordinate NaN everywhere.
  """
  NONFINITE: ClassVar[str] = "skip"
  STATEFUL: ClassVar[bool] = True

  def phases(self) -> tuple:
    """The branches of the step, ``phases.Phase``\\ s named ``"<name>.<phase>"``; one by default."""
    return (STEADY,)

  def phase_of(self, count) -> jax.Array:
    """The index into ``phases()`` of the step taken at ``count``."""
    del count
    return jnp.zeros([], jnp.int32)

  @property
  def output(self) -> str:
    """What the transformation returns (``interface.OUTPUTS``): ``"gradient"``, the mean (or a
    direction from it, for an optimizer to follow), or ``"update"``, a whole optimizer's update
    (its step takes the parameters too; nothing but guards may follow it)."""
    return "gradient"

  def unbucketable(self) -> Optional[str]:
    """Why the step cannot run bucket by bucket (DGC's clipping needs the whole gradient's norm),
    or None."""
    return None


class ErrorFeedbackState(NamedTuple):
  """The state of a compressor whose only memory is its error feedback (``sign_compress``,
  ``chunked_topk``).

  Attributes:
    count: steps taken (int32); steps with a non-finite gradient are not counted.
    error: what this device has not sent yet, in the params' structure (``optax.MaskedNode()`` at
      leaves that are not reduced, and everywhere without error feedback). PER DEVICE.
    config: the static settings.
    signature: the gradient pytree's structure, shapes, dtypes and paths.
  """
  count: jax.Array
  error: Any
  config: MeanConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("error",)  # see jaxcomp.sharding


class Init(Protocol):
  def __call__(self, config: MeanConfig, signature: tree_lib.TreeSignature) -> Any: ...


class Step(Protocol):
  def __call__(self, config: MeanConfig, state: Any, leaves: list, axis_name: axis.AxisName,
               phase: phases.Phase) -> tuple: ...


def run_step(step: Step, config: MeanConfig, state, leaves: list, axis_name) -> tuple:
  """The phase switch, ``step`` and ``count`` on the reduced ``leaves``: ``(means, new_state,
  finite)``, ``finite`` the step's own flag (``NONFINITE == "own"``) or None."""
  all_phases = config.phases()
  branches = [lambda s, g, p=p: step(config, s, g, axis_name, p) for p in all_phases]
  if len(all_phases) == 1 and all_phases[0] is STEADY:
    results = branches[0](state, leaves)
  else:
    results = phases.switch(config.phase_of(state.count), all_phases, branches, state, leaves)
  means, new_state, ok = results if config.NONFINITE == "own" else (*results, None)
  if config.STATEFUL:
    new_state = new_state._replace(count=state.count + (1 if ok is None else ok.astype(jnp.int32)))
  return list(means), new_state, ok


def _mean(step: Step, config: MeanConfig, state, leaves: list, axis_name,
          shape_of: Callable) -> tuple:
  """``run_step`` under the non-finite policy; ``shape_of(leaf)`` is the shape of its output (a
  shard's for a scatter step)."""
  if not config.STATEFUL or not leaves or config.NONFINITE == "own":
    return run_step(step, config, state, leaves, axis_name)[:2]
  with kernels.part("nonfinite"):
    ok = finite.all_finite(leaves, axis_name)
  run = lambda s, g: run_step(step, config, s, g, axis_name)[:2]  # noqa: E731
  return finite.guarded(config.NONFINITE, ok, run, shape_of, state, leaves)


def transformation(config: MeanConfig, init: Init, step: Step, axis_name: axis.AxisName, *,
                   bucket_cap_mb: Optional[float] = None, scatter: Optional[Step] = None,
                   scatter_unused: tuple = ()) -> interface.Transformation:
  """The optax transformation of a mean (the module docstring, 1–5).

  Args:
    config: the validated configuration, as the factory built it (arrays in its traceable
      settings, under ``optax.inject_hyperparams``).
    init: ``init(config, signature) -> state``.
    step: the step on the reduced leaves.
    axis_name: the mapped axis to average over.
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one set of collectives per
      bucket.
    scatter: the step as a reduce-scatter (``shards.own`` of each leaf's mean), or None: the
      step's mean, of which each device keeps its shard.
    scatter_unused: the state's fields ``scatter`` neither reads nor writes, held as
      ``optax.MaskedNode`` in the state made for it (``interface.Transformation.scatter_init``).

  Returns:
    An ``interface.Transformation`` whose output is identical on every device.
  """
  axis_name = axis.check_axis_name(axis_name)
  static, traced = validate.split_traced(config)
  if bucket_cap_mb is not None:
    cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True,
                          static="decides which leaves share a collective")
    reason = static.unbucketable()
    if reason:
      raise ValueError(f"{static.name}: bucket_cap_mb cannot be used here: {reason}")

    def hook(state, bucket):
      return run_hook(step, state, bucket, static.name, traced=traced)

    bucketed = buckets.comm_hook(hook, bucket_state(static, init), axis_name=axis_name,
                                 bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    if static.output == "update":
      return interface.Transformation(bucketed.init, bucketed.update, name=static.name,
                                      axis_name=axis_name, output="update")
    return interface.Transformation(bucketed.init, bucketed.update, name=static.name,
                                    axis_name=axis_name, scatter=bucketed.scatter)

  def init_fn(params):
    return init(static, tree_lib.TreeSignature.of(params))

  def scatter_init_fn(params):
    state = init_fn(params)
    return state._replace(**{field: jax.tree.map(lambda _: optax.MaskedNode(),
                                                 getattr(state, field))
                             for field in scatter_unused})

  def apply(updates, state, params, the_step: Step, shape_of: Callable, made_by: Callable):
    """1 (and 5 with ``the_step=scatter``, on the state ``made_by`` makes)."""
    tree_lib.check_state(state, made_by, static.name)
    leaves = state.signature.check(updates)
    reduced = [leaves[i] for i in state.signature.reduced]
    axis.refuse_summed_gradient(reduced, axis_name, static.name)
    if static.output == "update":  # a whole optimizer's step sees the parameters (or None)
      picked = None if params is None else state.signature.pick(tree_lib.unwrap(params))
      the_step = functools.partial(the_step, params=picked)
    means, new_state = _mean(the_step, validate.with_traced(state.config, traced), state, reduced,
                             axis_name, shape_of)
    for i, mean in zip(state.signature.reduced, means):
      leaves[i] = mean
    return tree_lib.like(updates, leaves), new_state

  def update_fn(updates, state, params=None):
    with kernels.part("update"):
      return apply(updates, state, params, step, lambda x: x.shape, init_fn)

  if static.output == "update":
    return interface.Transformation(init_fn, update_fn, name=static.name, axis_name=axis_name,
                                    output="update")
  if scatter is None:
    return interface.Transformation(init_fn, update_fn, name=static.name, axis_name=axis_name,
                                    scatter=interface.own_shard_of(update_fn, axis_name))

  def scatter_fn(updates, state):
    cut = shards.layout(axis_name)
    with kernels.part("update"):
      return apply(updates, state, None, scatter, lambda x: cut.shape(x.shape), scatter_init_fn)

  return interface.Transformation(init_fn, update_fn, name=static.name, axis_name=axis_name,
                                  scatter=scatter_fn, scatter_init=scatter_init_fn)


def run_hook(step: Step, state, bucket: buckets.GradBucket, name: str,
             made_by: Optional[str] = None, traced: Optional[dict] = None) -> tuple:
  """A mean's step as a hook of ``comm_hook``: ``(buffer, state)`` for ``bucket``.

  The step runs on the bucket's parameters (their paths name them, as in the whole pytree), in the
  bucket's dtype (a hook under ``fp16_compress_wrapper`` computes in float16; the state keeps its
  own dtypes); ``comm_hook`` applies the non-finite policy.

  Args:
    step: the compressor's step.
    state: the bucket's state, made by ``bucket_state``.
    bucket: the bucket.
    name: the hook's public prefix in ``jaxcomp.hooks`` (``"powersgd"``: ``powersgd_hook``,
      ``powersgd_state``).
    made_by: the configuration name of the states it takes (default ``name``).
    traced: the transformation's traced settings (``validate.split_traced``), if any.
  """
  config = getattr(state, "config", None)
  if getattr(config, "name", None) != (made_by or name):
    raise TypeError(f"{name}_hook needs the per-bucket state made by jaxcomp.hooks.{name}_state"
                    f"(...), as in comm_hook(jaxcomp.hooks.{name}_hook, "
                    f"jaxcomp.hooks.{name}_state()); got {type(state).__name__}")
  leaves = state.signature.check(bucket.gradients(), "bucket", dtypes=False)
  reduced = [leaves[i] for i in state.signature.reduced]
  means, state, _ = run_step(step, validate.with_traced(config, traced or {}), state, reduced,
                             bucket.axis_name)
  for i, mean in zip(state.signature.reduced, means):
    leaves[i] = mean
  return tree_lib.flatten(leaves), state


def bucket_state(config: MeanConfig, init: Init) -> Callable[[buckets.GradBucket], Any]:
  """The per-bucket state factory of ``comm_hook``: ``init`` on the bucket's parameters."""
  return lambda bucket: init(config, tree_lib.TreeSignature.of(bucket.gradients(),
                                                               paths=bucket.paths))


def hook_state(name: str, config: MeanConfig, init: Init) -> Callable[[buckets.GradBucket], Any]:
  """``bucket_state`` for ``jaxcomp.hooks.<name>_state`` (``config`` from ``config_of``): the
  configuration must run bucket by bucket.

  Raises:
    ValueError: it cannot.
  """
  reason = config.unbucketable()
  if reason:
    raise ValueError(f"{name}_state: {reason}")
  return bucket_state(config, init)


def config_of(config_type: type, name: str, **settings) -> MeanConfig:
  """``config_type(**settings)`` for a hook state factory, whose keyword arguments are the
  transformation's: an unknown one is named with the settings there are, and every one must be a
  Python value (a hook's state is made once, outside any step).

  Raises:
    TypeError: a setting is an array, or there is no setting of that name.
  """
  arrays = [key for key, value in settings.items() if validate.is_array(value)]
  if arrays:
    raise TypeError(f"{name}_state: {', '.join(arrays)} must be Python values: a hook's state is "
                    "made once, outside any step; schedule them with the transformation itself "
                    "(its bucket_cap_mb= gives the same buckets) under optax.inject_hyperparams")
  try:
    return config_type(**settings)
  except TypeError as e:
    if "unexpected keyword argument" not in str(e):
      raise
    unexpected = e.args[0].split("argument ")[-1]
    raise TypeError(f"{name}_state: no setting named {unexpected}; the settings are those of "
                    "the transformation, but axis_name (a hook uses its bucket's) and "
                    "bucket_cap_mb (comm_hook's)") from None

