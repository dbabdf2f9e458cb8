"""DiLoCo: H local steps of an inner optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

Every device trains its replica for ``sync_every`` (H) steps of the inner optimizer (the paper: AdamW)
on its own data, without communicating. Then the devices average their *pseudo-gradients* — how far
each moved from the parameters θ the period started from — and one outer optimizer step (SGD with
Nesterov momentum) moves θ; every device restarts from the new θ. One all-reduce of the parameters' size
per H steps: H times less traffic than data-parallel training, and with ``compressor`` (float16,
PowerSGD, …) on the pseudo-gradient less still.

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
4. averaged, Δ = (1/W) Σᵢ Δᵢ: ÷W, then one all-reduce SUM of all leaves packed per dtype — or through
   ``compressor``, a jaxcomp transformation whose output is the cross-device mean (``fp16_compress``,
   ``powersgd``, …), whose state persists across outer steps;
5. the "OuterOpt", SGD with Nesterov momentum μ and learning rate η: m ← μ·m + Δ; θ ← θ − η·(Δ + μ·m)
   (with ``nesterov=False``, θ ← θ − η·m), torch's and optax's ``sgd``, which runs it;
6. every device's parameters are set to the new θ (each replica starts the next period from θ). If the new θ is not
   finite (the average overflowed), θ and m are kept and the devices restart from the old θ. Every
   quantity of steps 4–6 is identical on every device, so the decision is too.

With ``sync_every=1``, η = 1 and μ = 0, θ ← θ − mean(θ − θᵢ) = mean(θᵢ): for an inner optimizer that
is linear in the gradient (SGD, with or without momentum) that is data-parallel training.

The parameters at ``init`` must be the same on every device (as for data-parallel training): they
are the first θ.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023 (https://arxiv.org/abs/2311.08105),
  Algorithm 1; an outer learning rate of 0.7 with Nesterov momentum 0.9 are its settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, finite, local_steps, phases, validate
from jaxcomp._src import tree as tree_lib


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
  """DiLoCo's settings, validated; a static node of the state.

  Attributes:
    sync_every: H, inner steps per outer step. The paper uses 500 and finds quality degrading slowly
      as H grows (communication falls as 1/H); small H approaches data-parallel training.
    outer_learning_rate: η of the outer SGD. The paper's 0.7: with η = 1 and no momentum DiLoCo is
      plain parameter averaging (FedAvg); η < 1 damps the noise of the averaged pseudo-gradient.
    outer_momentum: μ of the outer SGD (0 for none). The paper's 0.9: momentum across outer steps is
      what lets DiLoCo match synchronous training with few, large outer steps.
    nesterov: Nesterov momentum (the paper's outer optimizer) rather than heavy-ball.
  """
  sync_every: int
  outer_learning_rate: float = 0.7
  outer_momentum: float = 0.9
  nesterov: bool = True

  def __post_init__(self):
    checked = dict(
        sync_every=validate.integer(self.sync_every, "sync_every", 1,
                                    static="fixes when the devices communicate"),
        outer_learning_rate=validate.number(self.outer_learning_rate, "outer_learning_rate", 0,
                                            low_open=True),
        outer_momentum=validate.number(self.outer_momentum, "outer_momentum", 0, 1,
                                       high_open=True),
        nesterov=validate.boolean(self.nesterov, "nesterov"))
    for name, value in checked.items():
      object.__setattr__(self, name, value)

  def syncs_after(self, step):
    """Whether an outer step follows inner step ``step`` (0-based; an int or an array)."""
    return (step + 1) % self.sync_every == 0

  def outer_optimizer(self) -> optax.GradientTransformation:
    """The outer SGD of step 5."""
    return optax.sgd(self.outer_learning_rate, momentum=self.outer_momentum or None,
                     nesterov=self.nesterov)


class DiLoCoState(NamedTuple):
  """State of ``diloco``.

  Attributes:
    count: inner steps taken (int32), every step counted; the same on every device.
    outer_params: θ, the parameters of the last outer step, one entry per parameter leaf
      (``optax.MaskedNode()`` for leaves that are not reduced); the same on every device.
    outer_state: the outer SGD's state (its momentum m); the same on every device.
    compressor_state: the compressor's state (``optax.EmptyState()`` without one); it declares its own
      per-device fields (PowerSGD's error feedback).
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

  Example::

    tx = jaxcomp.diloco(optax.adamw(4e-4, weight_decay=0.1), sync_every=500,
                        compressor=jaxcomp.powersgd(4, start_iter=0, error_feedback=False))
    updates, opt_state = tx.update(grads, opt_state, params)   # inside pmap / shard_map
    params = optax.apply_updates(params, updates)

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
      setting); None sends the float32 mean.

  Returns:
    A ``GradientTransformation`` with a ``DiLoCoState``, whose update requires ``params``.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
    Algorithm 1.
  """
  inner = local_steps.check_transformation(inner, "inner", "optax.sgd(0.1, momentum=0.9)")
  if compressor is not None:
    local_steps.check_transformation(compressor, "compressor", "jaxcomp.fp16_compress()")
  config = DiLoCoConfig(sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, nesterov=nesterov)
  axis_name = axis.check_axis_name(axis_name)
  outer = config.outer_optimizer()

  def init_fn(params):
    params = tree_lib.unwrap(params)
    signature = tree_lib.TreeSignature.of(params)
    theta = tuple(jnp.array(x) if tree_lib.is_reduced(x) else optax.MaskedNode()
                  for x in jax.tree.leaves(params))
    return DiLoCoState(
        jnp.zeros([], jnp.int32), theta, outer.init(theta),
        optax.EmptyState() if compressor is None else compressor.init(params),
        local_steps.to_device(inner.init(params)), config, signature)

  def outer_step(state: DiLoCoState, local: list) -> tuple:
    """Steps 3–6: the new parameter leaves, θ, the outer state and the compressor's state."""
    signature, theta = state.signature, state.outer_params
    reduced = {i for i, t in enumerate(theta) if not isinstance(t, optax.MaskedNode)}
    # 3: Δᵢ = θ − θᵢ (leaves that are not reduced pass through the compressor as zeros).
    delta = [jnp.zeros_like(x) for x in local]
    for i in reduced:
      delta[i] = theta[i] - local[i]
    # 4: averaged, through the compressor when there is one.
    if compressor is None:
      mean, compressor_state = local_steps.mean_reduced(delta, axis_name), state.compressor_state
    else:
      mean, compressor_state = compressor.update(signature.unflatten(delta),
                                                 state.compressor_state)
      mean = jax.tree.leaves(mean)
    mean = tuple(mean[i] if i in reduced else optax.MaskedNode() for i in range(len(local)))
    # 5: the outer SGD on θ.
    updates, outer_state = outer.update(mean, state.outer_state, theta)
    new_theta = optax.apply_updates(theta, updates)
    # 6: kept if not finite; the same decision on every device (every input is identical).
    ok = finite.all_finite(new_theta, None)
    new_theta, outer_state = finite.keep_if_finite(ok, (new_theta, outer_state),
                                                   (theta, state.outer_state))
    params = [new_theta[i] if i in reduced else x for i, x in enumerate(local)]
    return local_steps.varying_like(params, local), new_theta, outer_state, compressor_state

  def update_fn(updates, state: DiLoCoState, params=None):
    state.signature.check(updates)
    params = local_steps.require_params(params, "diloco")
    state.signature.check(params, "params")
    # 1: the inner step on this device.
    local, inner_state = local_steps.local_update(
        inner, updates, local_steps.from_device(state.inner_state), params)
    # 2: the outer step after every H-th inner step.
    new_leaves, theta, outer_state, compressor_state = phases.cond(
        state.config.syncs_after(state.count),
        phases.Phase("diloco.sync", 1 / state.config.sync_every),
        lambda leaves: outer_step(state, leaves),
        lambda leaves: (leaves, state.outer_params, state.outer_state, state.compressor_state),
        jax.tree.leaves(local))
    new_state = state._replace(count=state.count + 1, outer_params=theta, outer_state=outer_state,
                               compressor_state=compressor_state,
                               inner_state=local_steps.to_device(inner_state))
    return local_steps.assign(tree_lib.like(local, new_leaves)), new_state

  return optax.GradientTransformation(init_fn, update_fn)
