"""The main job's training step, shared by the job, the slow-link workers and the benchmarks:
``jaxcomp.data_parallel``'s loss-function form over a one-axis mesh, as users are told to build
it."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # jax is imported where it is used: the job configures its devices first
  import jax

  import jaxcomp

AXIS = "batch"


def make_mesh(devices) -> "jax.sharding.Mesh":
  """The data-parallel mesh: one ``AXIS`` over ``devices`` (an Auto axis, left to the partitioner
  outside the step, as ``jaxcomp.data_parallel`` expects of pmap-style code)."""
  from jax.sharding import AxisType, Mesh
  return Mesh(np.asarray(devices), (AXIS,), axis_types=(AxisType.Auto,))


@dataclasses.dataclass(frozen=True)
class Step:
  """A task's data-parallel training step under one optimizer, built by ``jaxcomp.data_parallel``.

  Attributes:
    dp: the ``jaxcomp.DataParallel`` (its loss-function form, with the optimizer); ``dp.shard``
      places a batch.
    run: the jitted step, ``dp.step``: ``run(params, opt_state, inputs, targets) -> (params,
      opt_state, losses)``, one loss per device; it donates the parameters and the optimizer state
      except on CPU devices (``make_step``).
    start: ``start(params) -> (params, opt_state)`` placed on the mesh for ``run``, from one
      device's parameters.
  """
  dp: "jaxcomp.DataParallel"
  run: Callable
  start: Callable

  def lower(self, params, opt_state, inputs, targets):
    """The lowered step (``as_text()``, ``compile()``) for a global batch of host arrays."""
    return self.run.lower(params, opt_state, *self.dp.shard((inputs, targets)))


def _start(dp, params) -> tuple:
  """``(params, opt_state)`` as ``dp.step`` takes them: the optimizer state from ``dp.make_state``,
  the parameters from ``dp.make_params`` (stacked, one copy per device, for local SGD and DiLoCo,
  which move each device's copy on its own between synchronizations)."""
  opt_state = dp.make_state(params)
  return dp.make_params(params), opt_state


def make_step(task, tx, mesh) -> Step:
  """The training step of ``task`` (its ``loss``) with the optimizer ``tx`` over ``mesh``'s
  ``AXIS``.

  ``jaxcomp.data_parallel`` builds it: per-device loss and gradient (of a per-device copy of the
  parameters, so that autodiff adds no all-reduce of its own), then ``tx``, whose compressor is the
  cross-device mean; the parameters and the optimizer state are donated, as a training loop wants
  (``data_parallel`` leaves that out on CPU devices, where XLA:CPU's all-reduce crashes on a donated
  step).
  """
  import jaxcomp
  dp = jaxcomp.data_parallel(task.loss, mesh, axis_name=AXIS, tx=tx, donate=True)
  return Step(dp, dp.step, functools.partial(_start, dp))


def first_copy(params, like):
  """Device 0's copy of the step's parameters, on the host, shaped as ``like`` (one device's
  parameters): replicated leaves are the parameters, stacked ones (local SGD, DiLoCo) hold one
  copy per device. Read from the device's shard: no indexing program to compile."""
  import jax
  first = lambda x, ref: np.asarray(x.addressable_shards[0].data).reshape(np.shape(ref))
  return jax.tree.map(first, params, like)
