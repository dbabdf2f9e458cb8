"""Communicate every k micro-batches: DDP's ``no_sync`` for any optax chain that holds a compressor.

``optax.MultiSteps`` accumulates the *updates* of its inner transformation, so a jaxcomp compressor
inside it averages — and communicates — on every micro-step. ``accumulate`` instead sums this
device's raw gradients for k − 1 micro-steps without any collective, and on the k-th runs the inner
transformation, its collectives included, once, on the mean of the k local gradients. The inner
update sits in the branch that runs once per k steps, labelled as the phase
``accumulate.communicate`` with a share of 1/k: ``jaxcomp.comm_report`` counts its collectives once
per k micro-steps.

With micro-batches of equal size, k micro-steps give the update of one step on the k-times-larger
batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import local_steps, phases, validate
from jaxcomp._src import tree as tree_lib


class AccumulateState(NamedTuple):
  """State of ``accumulate``.

  Attributes:
    micro_step: how many micro-batches have been summed since the inner update last ran (0..k−1);
      the same on every device.
    acc: this device's running sum of gradients, one entry per gradient leaf (``optax.MaskedNode()``
      for leaves that are not accumulated: integer, boolean and zero-size ones). PER DEVICE: each
      device sums its own gradients, so under ``shard_map`` it is sharded, not replicated.
    inner_state: the inner transformation's state.
    signature: the gradient pytree's signature.
  """
  micro_step: jax.Array
  acc: tuple
  inner_state: Any
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("acc",)


def accumulate(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformation:
  """Runs ``inner`` (and so its collectives) once every ``every_k`` calls, on the mean local
  gradient.

  On micro-steps 1..k−1 the local gradient is added to a per-device sum and the update leaves the
  parameters as they are (zero; ``Assign`` of the parameters for an optimizer that sets them, such
  as ``jaxcomp.diloco``, whose local steps then run on k micro-batches each) — no communication. On
  the k-th the inner transformation receives the mean of the k local gradients and its update is
  returned. Leaves that are not accumulated (integers, booleans) reach ``inner`` as they were on the
  k-th micro-step.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = jaxcomp.accumulate(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), every_k=2)
    >>> grads = jnp.ones((8, 4))  # a micro-batch's gradient per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> for _ in range(2):  # zero, then the update of the mean: one exchange per 2 micro-batches
    ...   updates, state = step(grads, state)
    ...   print(updates[0])
    [0. 0. 0. 0.]
    [-0.1 -0.1 -0.1 -0.1]

  Args:
    inner: the transformation to run once per ``every_k`` micro-steps, normally a chain that starts
      with a jaxcomp compressor. Its updates must have the gradients' structure and dtypes.
    every_k: the number of micro-batches per communication; 1 runs ``inner`` on every call.

  Returns:
    A ``GradientTransformation`` whose state is an ``AccumulateState``.

  References:
    PyTorch ``DistributedDataParallel.no_sync``.
  """
  inner = validate.transformation(inner, "inner",
                                  "optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))")
  every_k = validate.integer(every_k, "every_k", 1, static="fixes when the collectives run")

  def init_fn(params):
    signature = tree_lib.TreeSignature.of(params)
    acc = tuple(jnp.zeros(s, d) if tree_lib.is_reduced(jax.ShapeDtypeStruct(s, d))
                else optax.MaskedNode() for s, d in zip(signature.shapes, signature.dtypes))
    return AccumulateState(jnp.zeros([], jnp.int32), acc, inner.init(params), signature)

  def update_fn(updates, state: AccumulateState, params=None):
    tree_lib.check_state(state, init_fn, "accumulate")
    leaves = state.signature.check(updates)
    acc = tuple(a if isinstance(a, optax.MaskedNode) else a + g for a, g in zip(state.acc, leaves))

    def run_inner():
      mean = [g if isinstance(a, optax.MaskedNode) else a / jnp.asarray(every_k, a.dtype)
              for a, g in zip(acc, leaves)]
      return inner.update(tree_lib.like(updates, mean), state.inner_state, params)

    def communicate():
      new_updates, inner_state = run_inner()
      return new_updates, inner_state, jax.tree.map(jnp.zeros_like, acc)

    def hold():
      shapes = jax.eval_shape(run_inner)[0]
      return local_steps.unchanged(shapes, params), state.inner_state, acc

    new_updates, inner_state, acc = phases.cond(
        state.micro_step == every_k - 1, phases.Phase("accumulate.communicate", 1 / every_k),
        communicate, hold)
    return new_updates, AccumulateState((state.micro_step + 1) % every_k, acc, inner_state,
                                        state.signature)

  return optax.GradientTransformation(init_fn, update_fn)
