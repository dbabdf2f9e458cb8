"""Dense gradient means: the baseline ``allreduce`` and the fp16 / bf16 wire casts.

Each sits first in ``optax.chain`` where data-parallel code would call ``lax.pmean``. The step, per
reduced leaf (torch's order): cast to the wire dtype → ÷W → all-reduce SUM → cast back. They keep no
state to protect: a NaN on one device makes that coordinate of the mean NaN on every device
(jaxcomp's non-finite policy, ``finite.py``), so no finiteness flag is sent.

For sharded optimizer state (``jaxcomp.sharded_optimizer``) the same order runs as a reduce-scatter:
cast → ÷W → reduce-scatter SUM → cast back, each device receiving its shard of the mean only (half
an all-reduce's bytes).

References:
  PyTorch, ``default_hooks.allreduce_hook`` / ``fp16_compress_hook`` / ``bf16_compress_hook``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import optax

from jaxcomp._src import axis, compressor, shards, validate
from jaxcomp._src import tree as tree_lib


_NAMES = {None: "allreduce", "float16": "fp16_compress", "bfloat16": "bf16_compress"}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DenseConfig(compressor.MeanConfig):
  """A dense mean's setting.

  Attributes:
    wire_dtype: the dtype the sum runs in (None: the gradient's own). float16 halves the bytes and
      keeps 11 bits of mantissa, bfloat16 keeps float32's range with 8.
  """
  STATEFUL = False  # a NaN on one device makes that coordinate of the mean NaN everywhere

  wire_dtype: Optional[str] = validate.setting(
      None, check=functools.partial(validate.choice, choices=tuple(_NAMES)))

  @property
  def name(self) -> str:
    return _NAMES[self.wire_dtype]


class DenseState(NamedTuple):
  """State of the dense means: the setting and the gradient signature, to catch a changed pytree."""
  config: DenseConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()  # no per-device leaves (see jaxcomp.sharding)


def init(config: DenseConfig, signature: tree_lib.TreeSignature) -> DenseState:
  return DenseState(config, signature)


def step(config: DenseConfig, state: DenseState, leaves: list, axis_name, phase) -> tuple:
  """Cast → ÷W → sum → cast back, one leaf at a time (XLA combines the all-reduces)."""
  del phase
  return axis.mean_leaves(leaves, axis_name, config.wire_dtype), state


def scatter(config: DenseConfig, state: DenseState, leaves: list, axis_name, phase) -> tuple:
  """Cast → ÷W → reduce-scatter SUM → cast back: this device's shard of each leaf's mean."""
  del phase
  return shards.mean_scatter(leaves, axis_name, config.wire_dtype), state


def allreduce(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The plain cross-device mean (÷W, then sum), the baseline every compressor is measured against.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))
    >>> grads = jnp.arange(8.0).reshape(8, 1)  # device i's gradient is [i]
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
    >>> print(step(grads)[:, 0])  # -0.1 × the mean 3.5, on every device
    [-0.35 -0.35 -0.35 -0.35 -0.35 -0.35 -0.35 -0.35]

  Args:
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A stateless ``GradientTransformation``.
  """
  return compressor.transformation(DenseConfig(None), init, step, axis_name, scatter=scatter)


def fp16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The mean sent as float16: cast → ÷W → sum in float16 → cast back (torch's order).

  Half the bytes of ``allreduce``. Dividing before the sum keeps the float16 sum from overflowing;
  values below float16's range (about 6e-8) are lost, which a loss scaler before it avoids.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1))
    >>> grads = jnp.ones((8, 256))  # 1 KiB of float32 per device
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
    >>> jaxcomp.comm_report(step, grads).bytes_by_dtype(), step(grads).dtype
    ({'f16': 512}, dtype('float32'))

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.

  References:
    PyTorch ``default_hooks.fp16_compress_hook``.
  """
  return compressor.transformation(DenseConfig("float16"), init, step, axis_name,
                                   scatter=scatter)


def bf16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """As ``fp16_compress`` with bfloat16 on the wire: float32's range, 8 bits of mantissa.

  torch allows its ``bf16_compress_hook`` only on NCCL; jaxcomp runs it everywhere. XLA:CPU widens
  bfloat16 collectives to float32 when it compiles (``comm_report(..., stage="lowered")`` shows the
  requested dtype); GPU and TPU backends send bfloat16.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.bf16_compress(), optax.sgd(0.1))
    >>> grads = jnp.ones((8, 256))  # 1 KiB of float32 per device
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
    >>> jaxcomp.comm_report(step, grads, stage="lowered").bytes_by_dtype(), step(grads).dtype
    ({'bf16': 512}, dtype('float32'))

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.
  """
  return compressor.transformation(DenseConfig("bfloat16"), init, step, axis_name,
                                   scatter=scatter)
