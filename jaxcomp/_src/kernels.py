"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# ------------------------------------------------------------------------------------------ PowerSGD


def transposed_product(mat: jax.Array, p: jax.Array) -> jax.Array:
  """``Mᵀ·P`` (m, r), as one vector–matrix product ``P[:, j]ᵀ·M`` per column.

  XLA:CPU runs ``M.T @ P`` (and its ``einsum`` / ``dot_general`` forms) by walking M's columns with
  a stride of m elements: about 15× the time of reading M row by row, which is what each
  vector–matrix product does (measured on (1024, 1024) f32 matrices, r = 1 to 8).
  """
  return jnp.stack([p[:, j] @ mat for j in range(p.shape[1])], axis=1)


def low_rank_product(p: jax.Array, q: jax.Array) -> jax.Array:
  """``P·Qᵀ`` (n, m). Up to rank 8 as a sum of r outer products: elementwise, so XLA computes it
  inside whatever consumes it (the error update, the output) instead of writing an (n, m) matrix
  first, which it does for a matrix product."""
  if p.shape[1] > 8:
    return p @ q.T
  return sum(p[:, j, None] * q[None, :, j] for j in range(p.shape[1]))


def computed_once(x: jax.Array) -> jax.Array:
  """``x``, computed into a buffer of its own before anything reads it.

  PowerSGD's ``M = g + e`` is read by the products with Q and P̂ and by the error update
  ``e ← M − P̂·Qᵀ``. Left free, XLA fuses ``g + e`` into that update too, which then reads the old
  error after the new one is written to its buffer, and XLA copies the error first (one more
  gradient-sized buffer when the state is donated; ``benchmarks/memory.py``). The barrier keeps M one
  buffer, computed once.
  """
  return lax.optimization_barrier(x)

# ---------------------------------------------------------------------------------------------- DGC

# ----------------------------------------------------------------------- quantized, sign, 1-bit Adam
