"""The main job's training step, shared by the job, the slow-link workers and the benchmarks:
``jaxcomp.data_parallel``'s loss-function form over a one-axis mesh, as users are told to build it."""

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
    run: the jitted step, ``run(params, opt_state, inputs, targets) -> (params, opt_state,
      losses)``, one loss per device; it donates the parameters and the optimizer state except on
      CPU devices (``make_step``).
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


def make_step(task, entry, tx, mesh) -> Step:
  """The training step of ``task`` (its ``loss``) with ``tx``, registry ``entry``'s optimizer,
  over ``mesh``'s ``AXIS``.

  ``jaxcomp.data_parallel`` builds it: per-device loss and gradient (of a per-device copy of the
  parameters, so that autodiff adds no all-reduce of its own), then ``tx``, whose compressor is the
  cross-device mean. Its jitted step does not donate; ``run`` jits the same global step again with
  the parameters and the optimizer state donated, as a training loop wants — except on CPU
  devices, where XLA's in-process all-reduce crashes on a donated step (below).
  """
  import jax

  import jaxcomp
  dp = jaxcomp.data_parallel(task.loss, mesh, axis_name=AXIS, tx=tx)
  # XLA:CPU (jaxlib 0.10.2) segfaults in its in-process all-reduce (InProcessCommunicator's
  # ReduceScatter<F32> reads a null buffer) when the step donates its inputs: powersgd_r1 on the
  # chars task, 8 devices, crashed within 5 steps in every run, and the job with it; the same steps
  # without donation run. On CPU the donation saves little (host memory), so it is left out there.
  donate = () if mesh.devices.flat[0].platform == "cpu" else (0, 1)
  # dp.step calls its jitted function under the mesh; on an Auto mesh the jitted function alone
  # is the same step, and jitting it again adds the donation data_parallel does not offer.
  return Step(dp, jax.jit(dp.step.__wrapped__, donate_argnums=donate),
              functools.partial(_start, dp))


def first_copy(params, like):
  """Device 0's copy of the step's parameters, on the host, shaped as ``like`` (one device's
  parameters): replicated leaves are the parameters, stacked ones (local SGD, DiLoCo) hold one
  copy per device. Read from the device's shard: no indexing program to compile."""
  import jax
  first = lambda x, ref: np.asarray(x.addressable_shards[0].data).reshape(np.shape(ref))
  return jax.tree.map(first, params, like)
