"""DiLoCo: H local steps of an inner optimizer, then an outer Nesterov step on the averaged
pseudo-gradient.

Every device trains its replica for ``sync_every`` (H) steps of the inner optimizer (the paper:
AdamW) on its own data, without communicating. Then the devices average their *pseudo-gradients* —
how far each moved from the parameters θ the period started from — and one outer optimizer step (SGD
with Nesterov momentum) moves θ; every device restarts from the new θ. One all-reduce of the
parameters' size per H steps: H times less traffic than data-parallel training, and with
``compressor`` (float16, PowerSGD, …) on the pseudo-gradient less still.

Like ``local_sgd``, ``diloco`` is the whole optimizer: its update needs ``params`` and returns
``jaxcomp.Assign`` updates, which ``optax.apply_updates`` applies exactly, so every device holds
bitwise the same θ after every outer step.

The steps, per device (the ``# n:`` comments below point here; the names in quotes are those of the
paper's Algorithm 1):

1. Inner step: the inner optimizer steps on this device's gradient, θᵢ ← "InnerOpt"(θᵢ, ∇L). No
   communication; a device whose new parameters are not finite keeps them and its inner
   state as they were (``local_steps``). The inner state persists across outer steps, per device.
2. After every H-th step (steps H − 1, 2H − 1, … counted from 0), the outer step:
3. the "outer gradient" (pseudo-gradient) Δᵢ = θ − θᵢ, θ being the parameters of the last outer
   step, kept in the state and the same on every device;
4. averaged, Δ = (1/W) Σᵢ Δᵢ: ÷W, then an all-reduce SUM of every leaf (XLA sends them as one) — or
   through ``compressor``, a jaxcomp transformation whose output is the cross-device mean
   (``fp16_compress``, ``powersgd``, …), whose state persists across outer steps;
5. the "OuterOpt", SGD with Nesterov momentum μ and learning rate η: m ← μ·m + Δ; θ ← θ − η·(Δ +
   μ·m) (with ``nesterov=False``, θ ← θ − η·m), torch's and optax's ``sgd``, which runs it;
6. every device's parameters are set to the new θ (each replica starts the next period from θ). If
   the new θ is not finite (the average overflowed), θ and m are kept and the devices restart from
   the old θ. Every quantity of steps 4–6 is identical on every device, so the decision is too.

With ``sync_every=1``, η = 1 and μ = 0, θ ← θ − mean(θ − θᵢ) = mean(θᵢ): for an inner optimizer that
is linear in the gradient (SGD, with or without momentum) that is data-parallel training.

The parameters at ``init`` must be the same on every device (as for data-parallel training): they
are the first θ.

``streaming_diloco`` (its own module) runs the same steps one fragment of the parameters at a time;
``sparseloco`` runs them with a sparse 2-bit exchange and no outer momentum.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023 (https://arxiv.org/abs/2311.08105),
  Algorithm 1; an outer learning rate of 0.7 with Nesterov momentum 0.9 are its settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, finite, interface, local_steps, phases, spmd, validate
from jaxcomp._src import tree as tree_lib


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DiLoCoConfig(local_steps.LocalStepsConfig):
  """DiLoCo's settings, validated; a static node of the state.

  Attributes:
    inner: the optimizer each device runs between outer steps (the paper: AdamW).
    sync_every: H, inner steps per outer step. The paper uses 500 and finds quality degrading slowly
      as H grows (communication falls as 1/H); small H approaches data-parallel training.
    outer_learning_rate: η of the outer SGD. The paper's 0.7: with η = 1 and no momentum DiLoCo is
      plain parameter averaging (FedAvg); η < 1 damps the noise of the averaged pseudo-gradient.
    outer_momentum: μ of the outer SGD (0 for none). The paper's 0.9: momentum across outer steps is
      what lets DiLoCo match synchronous training with few, large outer steps.
    nesterov: Nesterov momentum (the paper's outer optimizer) rather than heavy-ball.
    compressor: the jaxcomp transformation that averages the pseudo-gradient (step 4), or None
      for the float32 mean. Its state persists across outer steps; its ``start_iter`` counts them.
  """
  name = "diloco"

  inner: optax.GradientTransformation = validate.setting(check=functools.partial(
      validate.transformation, example="optax.adamw(1e-3)"))
  sync_every: int = validate.setting(check=functools.partial(
      validate.integer, minimum=1, static="fixes when the devices communicate"))
  outer_learning_rate: float = validate.setting(0.7, check=functools.partial(
      validate.number, low=0, low_open=True))
  outer_momentum: float = validate.setting(0.9, check=functools.partial(
      validate.number, low=0, high=1, high_open=True))
  nesterov: bool = validate.setting(True, check=validate.boolean)
  compressor: Optional[interface.Transformation] = validate.setting(
      None, check=validate.optional(functools.partial(interface.mean,
                                                      example="jaxcomp.fp16_compress()")))

  def syncs_after(self, step):
    """Whether an outer step follows inner step ``step`` (0-based; an int or an array)."""
    return (step + 1) % self.sync_every == 0

  def outer_optimizer(self) -> optax.GradientTransformation:
    """The outer SGD of step 5."""
    return optax.sgd(self.outer_learning_rate, momentum=self.outer_momentum or None,
                     nesterov=self.nesterov)

  def outer_step(self, theta, outer_state, mean) -> tuple:
    """Steps 5–6 with this configuration's outer SGD: ``(θ, outer state)`` (``outer_step``)."""
    return outer_step(self.outer_optimizer(), theta, outer_state, mean)


class DiLoCoState(NamedTuple):
  """State of ``diloco`` (and ``sparseloco``).

  Attributes:
    count: inner steps taken (int32), every step counted; the same on every device.
    outer_params: θ, the parameters of the last outer step, one entry per parameter leaf
      (``optax.MaskedNode()`` for leaves that are not reduced); the same on every device.
    outer_state: the outer SGD's state (its momentum m); the same on every device.
    compressor_state: the compressor's state (``optax.EmptyState()`` without one); it declares its
      own per-device fields (PowerSGD's error feedback).
    inner_state: the inner optimizer's state, with a leading axis of length 1 on every leaf. PER
      DEVICE: each device's optimizer steps on its own gradients.
    config: the static settings.
    signature: the gradient pytree's signature.
  """
  count: jax.Array
  outer_params: tuple
  outer_state: Any
  compressor_state: Any
  inner_state: Any
  config: DiLoCoConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner_state",)  # see jaxcomp.sharding
  PARAMS_PER_DEVICE = True  # the parameters differ between synchronizations


def outer_params(leaves: list) -> tuple:
  """θ from the parameter ``leaves``: a copy of each reduced leaf, ``optax.MaskedNode()`` for the
  others (never trained, never averaged)."""
  return tuple(jnp.array(x) if tree_lib.is_reduced(x) else optax.MaskedNode() for x in leaves)


def init(config: DiLoCoConfig, signature: tree_lib.TreeSignature, params) -> DiLoCoState:
  """θ = ``params`` (the same on every device), the outer and compressor states, and the inner
  optimizer's state, kept per device."""
  theta = outer_params(jax.tree.leaves(params))
  return DiLoCoState(
      jnp.zeros([], jnp.int32), theta, config.outer_optimizer().init(theta),
      optax.EmptyState() if config.compressor is None else config.compressor.init(params),
      local_steps.to_device(config.inner.init(params)), config, signature)


def average(compressor: Optional[interface.Transformation], axis_name: axis.AxisName, tree,
            compressor_state) -> tuple:
  """Step 4: ``(mean over the devices of tree's reduced leaves, compressor state)``: an all-reduce
  of every leaf, or ``compressor``'s mean."""
  if compressor is None:
    return local_steps.mean_reduced(tree, axis_name), compressor_state
  return compressor.update(tree, compressor_state)


def outer_step(outer: optax.GradientTransformation, theta: tuple, outer_state,
               mean: tuple) -> tuple:
  """Steps 5–6: ``(θ, outer state)`` after the outer SGD on the mean pseudo-gradient, both kept as
  they were if the new θ is not finite (``finite.keep_if_finite``: every input is the same on
  every device, so the decision is too)."""
  updates, new_state = outer.update(mean, outer_state, theta)
  new_theta = optax.apply_updates(theta, updates)
  return finite.keep_if_finite(finite.reduced_finite(new_theta), (new_theta, new_state),
                               (theta, outer_state))


def _sync(config: DiLoCoConfig, axis_name: axis.AxisName, state: DiLoCoState, local: list, theta,
          outer_state, compressor_state) -> tuple:
  """Steps 3–6: the new parameter leaves, θ, the outer state and the compressor's state."""
  reduced = {i for i, t in enumerate(theta) if not isinstance(t, optax.MaskedNode)}
  # 3: Δᵢ = θ − θᵢ (leaves that are not reduced pass through the compressor as zeros).
  delta = [theta[i] - x if i in reduced else jnp.zeros_like(x) for i, x in enumerate(local)]
  # 4: averaged, through the compressor when there is one.
  mean, compressor_state = average(config.compressor, axis_name,
                                   state.signature.unflatten(delta), compressor_state)
  mean = tuple(m if i in reduced else optax.MaskedNode()
               for i, m in enumerate(jax.tree.leaves(mean)))
  # 5–6: the outer SGD on θ, kept if not finite; every device set to it.
  new_theta, outer_state = outer_step(config.outer_optimizer(), theta, outer_state, mean)
  params = [new_theta[i] if i in reduced else x for i, x in enumerate(local)]
  return local_steps.varying_like(params, local), new_theta, outer_state, compressor_state


def step(config: DiLoCoConfig, state: DiLoCoState, grads, params,
         axis_name: axis.AxisName) -> tuple:
  """Steps 1–6 (the module docstring): ``(new params, new state)``."""
  # 1: the inner step on this device.
  local, inner_state = local_steps.local_update(
      config, grads, local_steps.from_device(state.inner_state), params, axis_name)
  # 2: the outer step after every H-th inner step.
  leaves, theta, outer_state, compressor_state = phases.when(
      config.syncs_after(state.count), phases.Phase(f"{config.name}.sync", 1 / config.sync_every),
      lambda *operands: _sync(config, axis_name, state, *operands),
      jax.tree.leaves(local), state.outer_params, state.outer_state, state.compressor_state)
  return tree_lib.like(local, leaves), state._replace(
      outer_params=theta, outer_state=outer_state, compressor_state=compressor_state,
      inner_state=local_steps.to_device(inner_state))


def same_axis(compressor: Optional[interface.Transformation], axis_name: axis.AxisName,
              name: str) -> None:
  """Raises unless ``compressor`` (if any) averages over ``axis_name``, the optimizer's axis, and
  perhaps over more: ``jaxcomp.hierarchical`` averages over the slow axis and, exactly, over the
  devices of a node, where the pseudo-gradient is the same when the inner step averages the
  gradient over them (each device then sends 1/F of it between nodes, not all of it).

  Raises:
    ValueError: naming both axes and the fix.
  """
  if compressor is not None and not set(spmd.axes(axis_name)) <= set(
      spmd.axes(compressor.axis_name)):
    raise ValueError(
        f"{name}: its compressor averages over {compressor.axis_name!r}, but {name} synchronizes "
        f"over {axis_name!r}: pass axis_name={axis_name!r} to the compressor too")


def diloco(inner: optax.GradientTransformation, *, sync_every: int,
           outer_learning_rate: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
           compressor: Optional[optax.GradientTransformation] = None,
           axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """DiLoCo: ``sync_every`` local steps of ``inner``, then an outer Nesterov step on the mean drift.

  The module docstring numbers the steps. Every device runs ``inner`` on its own gradient; after
  every ``sync_every``-th step the pseudo-gradients θ − θᵢ are averaged over the devices (through
  ``compressor`` when given), the outer SGD with Nesterov momentum moves θ, and every device is set
  to the new θ.

  It is the whole optimizer: its update needs ``params`` and returns ``jaxcomp.Assign`` updates,
  which ``optax.apply_updates`` and ``nnx.Optimizer`` apply exactly — so the replicas are bitwise
  identical after every outer step. Integer, boolean and zero-size parameters are left as they are.
  Chain nothing after it; put gradient processing into ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
    >>> tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, compressor=jaxcomp.fp16_compress())
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> opt_state, params = dp.make_state(jnp.ones((4, 1))), dp.make_params(jnp.ones((4, 1)))
    >>> x = dp.shard(jnp.linspace(0, 1, 64).reshape(16, 4))  # 2 examples per device
    >>> for _ in range(2):  # H = 2 inner steps apart, then the outer step: the same again
    ...   params, opt_state, loss = dp.step(params, opt_state, x)
    ...   print(bool((np.asarray(params) == np.asarray(params)[0]).all()))
    False
    True

  The parameters differ between outer steps, so they are per device, as for ``jaxcomp.local_sgd``
  (``jaxcomp.data_parallel`` keeps them stacked per device itself: see ``make_params``).

  Args:
    inner: the optimizer each device runs between outer steps (the paper: AdamW).
    sync_every: H, inner steps per outer step.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    outer_learning_rate: η of the outer SGD.
    outer_momentum: μ of the outer SGD; 0 for none.
    nesterov: Nesterov momentum (the paper's) rather than heavy-ball.
    compressor: a jaxcomp transformation that averages the pseudo-gradient over the same axis, e.g.
      ``jaxcomp.fp16_compress()`` or ``jaxcomp.powersgd(4, start_iter=0, error_feedback=False)``
      (its ``start_iter`` counts outer steps; the outer momentum already carries what a step leaves
      out, and error feedback on top of it made DiLoCo much worse in tests/test_diloco_training.py's
      setting); None sends the float32 mean. Between nodes of several devices,
      ``jaxcomp.hierarchical(jaxcomp.allreduce(axis_name="replica"))`` (over the slow axis and the
      node's, with ``inner`` averaging the gradient over the node's) sends 1/F of it per device.

  Returns:
    A ``GradientTransformation`` with a ``DiLoCoState``, whose update requires ``params``.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
    Algorithm 1.
  """
  config = DiLoCoConfig(inner=inner, sync_every=sync_every,
                        outer_learning_rate=outer_learning_rate, outer_momentum=outer_momentum,
                        nesterov=nesterov, compressor=compressor)
  same_axis(config.compressor, axis.check_axis_name(axis_name), config.name)
  return local_steps.transformation(config, init, step, axis_name)
