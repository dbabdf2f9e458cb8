"""Post-local SGD with periodic model averaging: torch's ``post_localSGD_hook`` +
``PeriodicModelAverager``.

Data-parallel SGD averages the gradients at every step. Local SGD lets every device step its own
optimizer on its own gradients and averages the *parameters* every ``sync_every`` steps: one
all-reduce of the parameters per period instead of one of the gradients per step. Post-local SGD
begins with ``start_iter`` steps of ordinary gradient averaging, while training moves fastest.

``local_sgd`` is the whole optimizer, not a gradient transformation before one: between averagings
the parameters differ from device to device, which only the optimizer that moves them can arrange.
Its ``update(grads, state, params)`` needs the parameters and returns ``jaxcomp.Assign`` updates
that ``optax.apply_updates`` turns into the new parameters exactly (``local_steps`` says why a
difference ``new − params`` would not do).

The steps at step t (0-based), per device (the ``# n:`` comments below point here):

1. Before ``start_iter``: the gradient is averaged over the devices (÷W, then an all-reduce SUM of
   every floating-point leaf, which XLA sends as one) and the inner optimizer steps on the mean, so
   every device holds the same parameters afterwards (``post_localSGD_hook`` before
   ``start_localSGD_iter``: "allreduce using ``global_group_to_use``").
2. From ``start_iter``: the inner optimizer steps on this device's own gradient; no communication
   (``post_localSGD_hook`` afterwards, with ``post_local_gradient_allreduce=False``; its default
   intra-node gradient all-reduce is the hierarchical form below). A device whose new parameters are
   not finite keeps its parameters and inner state (``local_steps``).
3. After the steps t ≥ ``start_iter`` with (t − ``start_iter``) % ``sync_every`` == 0, the
   parameters are averaged — ÷W, then an all-reduce SUM of every leaf, sent as one as torch's
   ``average_parameters`` sends its flat buffer — and every device is set to the average. These are
   the steps at which ``PeriodicModelAverager(period=sync_every, warmup_steps=start_iter)``, called
   after every optimizer
   step, averages: its counter's values start_iter, start_iter + sync_every, …
4. The inner optimizer's state is never averaged (torch's averager averages parameters only): it
   stays per device.

The step counter advances on every step, whatever any device's gradient held, so every device agrees
on when to communicate.

Hierarchical averaging (``HierarchicalModelAverager``; torch's default post-local SGD, which keeps
all-reducing gradients inside each machine): on a mesh ``("slow", "fast")``, put the per-step mean
over the fast axis into the inner optimizer and average over the slow axis every ``sync_every``
steps::

  tx = jaxcomp.local_sgd(optax.chain(jaxcomp.allreduce(axis_name="fast"), optax.sgd(0.1)),
                         sync_every=8, axis_name="slow")

Devices along ``fast`` then hold the same parameters after every step, and all devices after every
averaging; only the small all-reduces cross the slow links, once per period. Parameter averaging at
several periods nests: ``local_sgd(local_sgd(inner, sync_every=2, axis_name="fast"), sync_every=8,
axis_name="slow")``.

References:
  Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020
  (https://arxiv.org/abs/1808.07217): post-local SGD, cited by torch's ``PeriodicModelAverager``.
  Hierarchical SGD: https://arxiv.org/abs/2010.12998, cited by ``HierarchicalModelAverager``.
  PyTorch 2.13: ``ddp_comm_hooks/post_localSGD_hook.py``, ``model_averaging/averagers.py``
  (``PeriodicModelAverager``), ``model_averaging/hierarchical_model_averager.py``,
  ``model_averaging/utils.py`` (``average_parameters``).
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


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LocalSGDConfig(local_steps.LocalStepsConfig):
  """Local SGD's settings, validated; a static node of the state.

  Attributes:
    inner: the optimizer each device runs on its own gradient (e.g. ``optax.sgd(lr,
      momentum=0.9)``); it may itself average over a faster axis (hierarchical averaging).
    sync_every: the averaging period H in steps (torch's ``period``). Each period sends one
      all-reduce of the parameters instead of H of the gradients; the replicas drift apart for H − 1
      steps, the more the larger the learning rate and the more different the devices' data. 1 is
      plain data-parallel training (for a linear inner optimizer such as SGD with momentum).
    start_iter: the steps of gradient averaging before local steps begin (torch's
      ``start_localSGD_iter`` and ``warmup_steps``): early training changes the parameters fastest
      and suffers most from drift; Lin et al. switch after the first learning-rate decay.
  """
  name = "local_sgd"

  inner: optax.GradientTransformation = validate.setting(check=functools.partial(
      validate.transformation, example="optax.sgd(0.1, momentum=0.9)"))
  sync_every: int = validate.setting(check=functools.partial(
      validate.integer, minimum=1, static="fixes when the parameters are averaged"))
  start_iter: int = validate.setting(0, check=validate.integer)

  def averages_after(self, step):
    """Whether the parameters are averaged after step ``step`` (0-based; an int or an array)."""
    return (step >= self.start_iter) & ((step - self.start_iter) % self.sync_every == 0)

  def syncs_after(self, step):
    """Whether the devices hold the same parameters after step ``step``: averaging steps, and every
    step of gradient averaging before ``start_iter``."""
    return (step < self.start_iter) | self.averages_after(step)


class LocalSGDState(NamedTuple):
  """State of ``local_sgd``.

  Attributes:
    count: steps taken (int32), every step counted; the same on every device.
    inner_state: the inner optimizer's state, with a leading axis of length 1 on every leaf. PER
      DEVICE: each device's optimizer steps on its own gradients.
    config: the static settings.
    signature: the gradient pytree's signature.
  """
  count: jax.Array
  inner_state: Any
  config: LocalSGDConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner_state",)  # see jaxcomp.sharding
  PARAMS_PER_DEVICE = True  # the parameters differ between synchronizations


def init(config: LocalSGDConfig, signature: tree_lib.TreeSignature, params) -> LocalSGDState:
  """The inner optimizer's state for ``params``, kept per device."""
  return LocalSGDState(jnp.zeros([], jnp.int32), local_steps.to_device(config.inner.init(params)),
                       config, signature)


def _averaged(axis_name: axis.AxisName) -> callable:
  """The mean over the devices of a tree's reduced leaves, typed as the tree (steps 1 and 3)."""
  return lambda tree: local_steps.varying_like(local_steps.mean_reduced(tree, axis_name), tree)


def step(config: LocalSGDConfig, state: LocalSGDState, grads, params,
         axis_name: axis.AxisName) -> tuple:
  """Steps 1–4 (the module docstring): ``(new params, new state)``."""
  if config.start_iter > 0:  # 1: the mean gradient before start_iter
    grads = phases.when(state.count < config.start_iter,
                        phases.Phase(f"{config.name}.warmup", 0.0), _averaged(axis_name), grads)
  # 2: the inner step on this device; 4: its state stays here.
  new_params, inner_state = local_steps.local_update(
      config, grads, local_steps.from_device(state.inner_state), params, axis_name)
  # 3: the periodic average.
  new_params = phases.when(config.averages_after(state.count),
                           phases.Phase(f"{config.name}.sync", 1 / config.sync_every),
                           _averaged(axis_name), new_params)
  return new_params, state._replace(inner_state=local_steps.to_device(inner_state))


def local_sgd(inner: optax.GradientTransformation, *, sync_every: int, start_iter: int = 0,
              axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """Post-local SGD: ``inner`` steps locally on each device, the parameters averaged periodically.

  Torch's ``post_localSGD_hook`` with ``PeriodicModelAverager`` (the module docstring numbers the
  steps): the mean gradient for the first ``start_iter`` steps; from then on ``inner`` steps on each
  device's own gradient, and after steps ``start_iter``, ``start_iter + sync_every``, … every device
  is set to the average of the devices' parameters.

  It is the whole optimizer: its update needs ``params`` and returns ``jaxcomp.Assign`` updates,
  which ``optax.apply_updates`` and ``nnx.Optimizer`` apply exactly — so the replicas are bitwise
  identical after every averaging. Integer, boolean and zero-size parameters are left as they are.
  Chain nothing after it; put gradient processing (clipping, weight decay) into ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
    >>> tx = jaxcomp.local_sgd(optax.sgd(0.1), sync_every=2, start_iter=0)
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> opt_state, params = dp.make_state(jnp.ones((4, 1))), dp.make_params(jnp.ones((4, 1)))
    >>> x = dp.shard(jnp.linspace(0, 1, 64).reshape(16, 4))  # 2 examples per device
    >>> for _ in range(3):  # a copy per device: averaged after steps 0 and 2, apart after 1
    ...   params, opt_state, loss = dp.step(params, opt_state, x)
    ...   print(params.shape, bool((np.asarray(params) == np.asarray(params)[0]).all()))
    (8, 4, 1) True
    (8, 4, 1) False
    (8, 4, 1) True

  Under ``pmap`` give the parameters and the state a leading device axis, as usual; under
  ``shard_map`` the parameters differ between averagings, so they are per device too
  (``PartitionSpec(axis_name)`` on a leading device axis), and ``jaxcomp.state_partition_specs``
  gives the state's specs. ``jaxcomp.data_parallel`` does this itself (its state declares
  ``PARAMS_PER_DEVICE``): it keeps the parameters stacked per device (``make_params``).

  Args:
    inner: the optimizer each device runs, e.g. ``optax.sgd(lr, momentum=0.9)``; it may itself
      average over a faster axis (hierarchical averaging, see the module docstring).
    sync_every: average the parameters every this many steps (``LocalSGDConfig``).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    start_iter: steps of gradient averaging before local steps begin.

  Returns:
    A ``GradientTransformation`` with a ``LocalSGDState``, whose update requires ``params``.

  References:
    Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020. PyTorch 2.13
    ``post_localSGD_hook``, ``PeriodicModelAverager``.
  """
  config = LocalSGDConfig(inner=inner, sync_every=sync_every, start_iter=start_iter)
  return local_steps.transformation(config, init, step, axis_name)
