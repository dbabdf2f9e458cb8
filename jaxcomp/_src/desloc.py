"""DES-LOC: Local Adam whose parameters, first moments and second moments are averaged on periods
of their own.

Local Adam (every device runs Adam on its own gradient, and every K steps the devices average the
parameters and both of Adam's moments) sends three copies of the parameters per period. DES-LOC
averages each of the three on its own period: the parameters every Kx steps, the first moment
every Ku and the second every Kv steps, Kx ≤ Ku ≤ Kv, since a moment with a longer half-life
(ln ½ / ln β: 6.6 steps for β₁ = 0.9, 13.5 for β₂ = 0.95) drifts apart more slowly. The paper's
choice Ku = 3·Kx, Kv = 6·Kx sends (1/Kx + 1/Ku + 1/Kv) = 1.5/Kx parameters' worth per step, half of
Local Adam's 3/Kx at the same Kx.

The steps at step t (0-based), per device (the ``# n:`` comments below point here; u and v are the
paper's names of Adam's moments, optax's ``mu`` and ``nu``):

1. Inner step: the inner optimizer — Adam or AdamW, with whatever is chained before it (clipping,
   the paper's ĝ = clip(g, ρ)) — steps on this device's gradient: u ← β₁u + (1 − β₁)ĝ,
   v ← β₂v + (1 − β₂)ĝ², x ← x − η·û/(√v̂ + ε) (optax's bias corrections û, v̂). No communication;
   a device whose new parameters are not finite keeps them and its state (``local_steps``).
2. After the steps with (t + 1) % Kx == 0: x ← the mean of the devices' x (÷W, then an all-reduce
   SUM), the phase ``"desloc.params"``.
3. After the steps with (t + 1) % Ku == 0: u ← the mean of the devices' u
   (``"desloc.first_moment"``).
4. After the steps with (t + 1) % Kv == 0: v ← the mean of the devices' v
   (``"desloc.second_moment"``).

Each average replaces a state by its mean before the next step uses it, as the paper's
x̄ = E[x] if t mod Kx = 0 does; the parameters are averaged after the update, as Local SGD's and
Local Adam's are, so every device holds the same parameters right after step 2 (until the next
step's own gradient moves them apart). With Kx = Ku = Kv = K it is Local Adam; with K = 1 and SGD
inside it would be data-parallel training, but Adam is not linear in its gradient: the mean of W
Adam steps is not one Adam step on the mean gradient.

The moments are found in the inner optimizer's state as ``optax.ScaleByAdamState`` (optax's
``adam``, ``adamw``, and chains that hold them); the moments' step count is left per device, as it
is the same on every device that never skipped a step. The inner optimizer keeps state for the
trained leaves only (floating point, non-empty: ``optax.masked``), which are the ones averaged.

References:
  Iacob, Sani, Safaryan, Giampouras, Horváth, Jovanovic, Kurmanji, Aleksandrov, Shen, Qiu, Lane,
  "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation Models", ICLR
  2026 (https://arxiv.org/abs/2505.22549), Algorithm 1: separate periods Kx, Ku, Kv for the
  parameters and the two moments, Ku = 3Kx and Kv = 6Kx recommended, 170× less traffic than
  data-parallel training and 2× less than Local Adam.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, local_steps, phases, validate
from jaxcomp._src import tree as tree_lib

_PERIOD = functools.partial(validate.integer, minimum=1,
                            static="fixes when the devices communicate")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DesLocConfig(local_steps.LocalStepsConfig):
  """DES-LOC's settings, validated; a static node of the state.

  Attributes:
    inner: the Adam each device runs (``optax.adamw(...)``, ``optax.adam(...)``, or a chain holding
      one: its ``optax.ScaleByAdamState`` holds the moments that are averaged).
    param_sync_every: Kx, steps between two averages of the parameters.
    first_moment_sync_every: Ku, steps between two averages of Adam's first moment; at least Kx (the
      paper: 3·Kx).
    second_moment_sync_every: Kv, steps between two averages of the second moment; at least Kx (the
      paper: 6·Kx).
  """
  name = "desloc"

  inner: optax.GradientTransformation = validate.setting(check=functools.partial(
      validate.transformation, example="optax.adamw(1e-3)"))
  param_sync_every: int = validate.setting(check=_PERIOD)
  first_moment_sync_every: int = validate.setting(check=_PERIOD)
  second_moment_sync_every: int = validate.setting(check=_PERIOD)

  def check(self):
    for name in ("first_moment_sync_every", "second_moment_sync_every"):
      if getattr(self, name) < self.param_sync_every:
        raise ValueError(f"{name} must be at least param_sync_every ({self.param_sync_every}): a "
                         f"moment drifts more slowly than the parameters; got {getattr(self, name)}"
                         ". The paper's are 3 and 6 times param_sync_every")

  def periods(self) -> dict:
    """Each averaged state's phase name and period (steps 2–4)."""
    return {"params": self.param_sync_every, "first_moment": self.first_moment_sync_every,
            "second_moment": self.second_moment_sync_every}

  def averages_after(self, period: int, step):
    """Whether a state of ``period`` is averaged after step ``step`` (0-based; int or array)."""
    return (step + 1) % period == 0

  def syncs_after(self, step):
    """Whether every device holds the same parameters after step ``step``: after their average."""
    return self.averages_after(self.param_sync_every, step)


class DesLocState(NamedTuple):
  """State of ``desloc``.

  Attributes:
    count: steps taken (int32), every step counted; the same on every device.
    inner_state: the inner optimizer's state (Adam's moments among it), with a leading axis of
      length 1 on every leaf. PER DEVICE: averaged on the moments' periods only.
    config: the static settings.
    signature: the gradient pytree's signature.
  """
  count: jax.Array
  inner_state: Any
  config: DesLocConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner_state",)  # see jaxcomp.sharding
  PARAMS_PER_DEVICE = True  # the parameters differ between synchronizations


def _is_adam(node) -> bool:
  return isinstance(node, optax.ScaleByAdamState)


def init(config: DesLocConfig, signature: tree_lib.TreeSignature, params) -> DesLocState:
  """The inner optimizer's state for ``params``, kept per device.

  Raises:
    ValueError: the inner optimizer holds no Adam moments.
  """
  inner_state = config.inner.init(params)
  if not any(_is_adam(n) for n in jax.tree.leaves(inner_state, is_leaf=_is_adam)):
    raise ValueError("desloc: its inner optimizer holds no Adam moments (optax.ScaleByAdamState): "
                     "pass optax.adamw(...) or optax.adam(...), alone or in an optax.chain")
  return DesLocState(jnp.zeros([], jnp.int32), local_steps.to_device(inner_state), config,
                     signature)


def _averaged(axis_name: axis.AxisName, tree):
  """The mean over the devices of ``tree``'s reduced leaves, typed as ``tree``."""
  return local_steps.varying_like(local_steps.mean_reduced(tree, axis_name), tree)


def _moment(inner_state, field: str, value=None):
  """Every ``field`` (``"mu"`` or ``"nu"``) of the Adam states in ``inner_state``, as a list; or,
  given ``value`` (such a list), ``inner_state`` with them replaced."""
  found = [n for n in jax.tree.leaves(inner_state, is_leaf=_is_adam) if _is_adam(n)]
  if value is None:
    return [getattr(n, field) for n in found]
  replaced = iter(value)
  return jax.tree.map(lambda n: n._replace(**{field: next(replaced)}) if _is_adam(n) else n,
                      inner_state, is_leaf=_is_adam)


def step(config: DesLocConfig, state: DesLocState, grads, params,
         axis_name: axis.AxisName) -> tuple:
  """Steps 1–4 (the module docstring): ``(new params, new state)``."""
  periods = config.periods()
  # 1: the inner Adam step on this device.
  new_params, inner_state = local_steps.local_update(
      config, grads, local_steps.from_device(state.inner_state), params, axis_name)

  def sync(name: str, tree):
    return phases.when(config.averages_after(periods[name], state.count),
                       phases.Phase(f"{config.name}.{name}", 1 / periods[name]),
                       functools.partial(_averaged, axis_name), tree)

  # 2: the parameters every Kx steps.
  new_params = sync("params", new_params)
  # 3–4: the first moment every Ku steps, the second every Kv.
  for name, field in (("first_moment", "mu"), ("second_moment", "nu")):
    inner_state = _moment(inner_state, field, sync(name, _moment(inner_state, field)))
  return new_params, state._replace(inner_state=local_steps.to_device(inner_state))


def desloc(inner: optax.GradientTransformation, *, param_sync_every: int,
           first_moment_sync_every: int, second_moment_sync_every: int,
           axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """DES-LOC: Local Adam that averages the parameters and Adam's two moments on three periods.

  The module docstring numbers the steps. Every device runs ``inner`` (an Adam) on its own
  gradient; after every ``param_sync_every``-th step the devices' parameters are averaged, after
  every ``first_moment_sync_every``-th their first moments and after every
  ``second_moment_sync_every``-th their second moments. ``comm_report`` shows the three as the
  phases ``desloc.params``, ``desloc.first_moment`` and ``desloc.second_moment``, each with its
  share 1/K of the steps.

  It is the whole optimizer, as ``jaxcomp.local_sgd``: its update needs ``params`` and returns
  ``jaxcomp.Assign`` updates, which set every device's parameters to the same average at its
  synchronizations; under ``jaxcomp.data_parallel`` the parameters are kept per device
  (``make_params``). Chain nothing after it; put gradient clipping into ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = jaxcomp.desloc(optax.adamw(1e-3), param_sync_every=4, first_moment_sync_every=12,
    ...                     second_moment_sync_every=24)
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> params = jnp.ones((64, 16))  # 4 KiB of float32
    >>> opt_state, params = dp.make_state(params), dp.make_params(params)
    >>> report = jaxcomp.comm_report(dp.step, params, opt_state, dp.shard(jnp.ones((16, 64))))
    >>> report.phase_names  # each sends 4 KiB: every 4, 12 and 24 steps
    ('desloc.params', 'desloc.first_moment', 'desloc.second_moment')
    >>> round(report.payload_bytes)  # per step, on average: 4 KiB · (1/4 + 1/12 + 1/24)
    1536

  Args:
    inner: the optimizer each device runs: ``optax.adamw(...)`` or ``optax.adam(...)``, alone or
      chained after gradient processing.
    param_sync_every: Kx, average the parameters every this many steps.
    first_moment_sync_every: Ku ≥ Kx, average Adam's first moment every this many steps.
    second_moment_sync_every: Kv ≥ Kx, average its second moment every this many steps.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A ``GradientTransformation`` with a ``DesLocState``, whose update requires ``params``.

  References:
    Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
    Foundation Models", ICLR 2026, Algorithm 1.
  """
  trained = lambda params: jax.tree.map(tree_lib.is_reduced, params)  # noqa: E731
  config = DesLocConfig(inner=optax.masked(inner, trained), param_sync_every=param_sync_every,
                        first_moment_sync_every=first_moment_sync_every,
                        second_moment_sync_every=second_moment_sync_every)
  return local_steps.transformation(config, init, step, axis_name)
