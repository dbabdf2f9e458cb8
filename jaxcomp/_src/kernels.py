"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcomp._src import finite

# ------------------------------------------------------------------------------------------ PowerSGD


def product(terms: tuple, q: jax.Array) -> jax.Array:
  """``M·Q`` for ``M = sum(terms)`` (PowerSGD's ``g + e``), as the sum of each term's product.

  M is then never written to memory (XLA:CPU does not fuse the sum into a dot):
  ``benchmarks/memory.py --quick``, layer-wise rank 1, 2.02 → 1.60 temporaries per gradient,
  alternating 1.90 → 1.68 (ResNet-18: 1.22 either way). The memory traffic stays the same (the
  products read g and e instead of writing M and reading it back); the products' flops double,
  which rank ≤ 8 products, bound by memory, do not notice.
  """
  return sum(t @ q for t in terms)


def transposed_product(terms: tuple, p: jax.Array) -> jax.Array:
  """``Mᵀ·P`` (m, r) for ``M = sum(terms)`` (see ``product``), as one vector–matrix product
  ``P[:, j]ᵀ·M`` per column.

  XLA:CPU runs ``M.T @ P`` (and its ``einsum`` / ``dot_general`` forms) by walking M's columns with
  a stride of m elements: about 15× the time of reading M row by row, which is what each
  vector–matrix product does (measured on (1024, 1024) f32 matrices, r = 1 to 8).
  """
  return sum(jnp.stack([p[:, j] @ t for j in range(p.shape[1])], axis=1) for t in terms)


def difference(terms: tuple, x: jax.Array, like: jax.Array) -> jax.Array:
  """``sum(terms) − x`` (PowerSGD's new error ``M − P̂·Qᵀ``) in ``like``'s shape and dtype.

  The terms are reshaped to ``like``'s shape before the subtraction, not the difference after it:
  XLA:CPU then writes the difference into the old error's buffer instead of a temporary it copies
  from (``benchmarks/memory.py --quick``, batched rank 1, its error flat: 2.12 → 1.10 temporaries
  per gradient).
  """
  return (sum(terms).reshape(like.shape) - x.reshape(like.shape)).astype(like.dtype)


def low_rank_product(p: jax.Array, q: jax.Array) -> jax.Array:
  """``P·Qᵀ`` (n, m). Up to rank 8 as a sum of r outer products: elementwise, so XLA computes it
  inside whatever consumes it (the error update, the output) instead of writing an (n, m) matrix
  first, which it does for a matrix product."""
  if p.shape[1] > 8:
    return p @ q.T
  return sum(p[:, j, None] * q[None, :, j] for j in range(p.shape[1]))


def gated_by_selects(algorithm):
  """``algorithm`` (a ``compressor.Algorithm``) with jaxcomp's non-finite policy applied by selects
  after its step, instead of by the adapter's ``lax.cond`` around it.

  XLA:CPU may copy donated buffers into and out of a conditional that has them among its operands.
  Under the adapter's cond, layer-wise PowerSGD's error feedback was copied in, rebuilt in a
  temporary and copied out on ResNet-18: ``benchmarks/memory.py`` (W = 8, gradient and state
  donated), rank 1, temporaries per gradient 2.92 under the cond and 1.22 with selects (GPT-2 small
  went the other way, 1.00 and 1.31; with selects every model has what it had before the protocol).
  The selects keep the state bit for bit and make the outputs NaN, as the cond does, but the step's
  collectives then run on a non-finite step too (on NaN), and the 4-byte flag sits in its phase.
  """
  def step(config, state, leaves, axis_name, phase):
    ok = finite.all_finite(leaves, axis_name)
    means, new_state = algorithm.step(config, state, leaves, axis_name, phase)
    return finite.gated(ok, means, new_state._replace(count=state.count + 1), state)

  return dataclasses.replace(algorithm, step=step, stateful=False)


# ---------------------------------------------------------------------------------------------- DGC

# ----------------------------------------------------------------------- quantized, sign, 1-bit Adam
