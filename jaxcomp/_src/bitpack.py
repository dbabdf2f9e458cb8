"""Bit-level wire formats: fixed-width fields and Elias–Fano index sets, packed into bytes.

A sparse exchange sends, for each chunk of a vector, which ``k`` of its ``n`` positions it keeps and
a short code for each kept value. Collectives move whole bytes of a fixed size, so every format here
has a length fixed by ``(n, k)`` alone, and everything travels as ``uint8`` (XLA keeps ``u8``
collectives narrow on every backend).

* **Fields**: non-negative integers of ``width`` bits, least significant bit first (``to_bits`` /
  ``from_bits``); rows of bits become bytes with ``pack`` / ``unpack`` (little bit order).
* **Elias–Fano** coding of a sorted set of ``k`` positions in ``[0, n)`` (Elias 1974, Fano 1971):
  with ``l = floor(log2(n / k))``, each position's ``l`` low bits are stored as they are (``k·l``
  bits), and its high part ``p >> l`` in unary: bit ``(p_i >> l) + i`` of an upper bit-vector of
  ``k + ((n − 1) >> l)`` bits is set, for the i-th smallest position. The length is
  ``k·l + k + ((n − 1) >> l)`` bits whatever the set, within about 2 bits per position of the
  information bound ``log2 C(n, k)`` (``information_bound``); for 64 of 4,096 positions: 511 bits,
  against a bound of 471.3 and 768 for plain 12-bit indices.

References:
  P. Elias, "Efficient Storage and Retrieval by Content and Address of Static Files", J. ACM 21(2),
  1974; R. M. Fano, "On the number of bits required to implement an associative memory", MIT
  Project MAC memorandum 61, 1971. S. Vigna, "Quasi-succinct indices", WSDM 2013 (the layout above).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


def to_bits(x: jax.Array, width: int) -> jax.Array:
  """The ``width`` low bits of each non-negative integer of ``x`` (shape ``(..., m)``), least
  significant first, as a ``uint8`` array of 0/1 of shape ``(..., m·width)``."""
  shifts = jnp.arange(width, dtype=x.dtype)
  bits = (x[..., None] >> shifts) & 1
  return bits.reshape(x.shape[:-1] + (x.shape[-1] * width,)).astype(jnp.uint8)


def from_bits(bits: jax.Array, width: int) -> jax.Array:
  """The inverse of ``to_bits``: ``(..., m·width)`` bits → ``(..., m)`` int32 fields."""
  fields = bits.reshape(bits.shape[:-1] + (-1, width)).astype(jnp.int32)
  return (fields << jnp.arange(width, dtype=jnp.int32)).sum(-1, dtype=jnp.int32)


def pack(bits: jax.Array) -> jax.Array:
  """Rows of 0/1 bits (last axis) as bytes, 8 per byte, the last byte zero-padded."""
  return jnp.packbits(bits, axis=-1, bitorder="little")


def unpack(packed: jax.Array, count: int) -> jax.Array:
  """The first ``count`` bits of each row of ``pack``'s bytes."""
  return jnp.unpackbits(packed, axis=-1, count=count, bitorder="little")


class EliasFano(NamedTuple):
  """The Elias–Fano layout of ``k`` sorted positions in ``[0, n)``.

  Attributes:
    low_width: ``l = floor(log2(n / k))``, the low bits stored per position.
    upper_length: the unary upper bit-vector's length, ``k + ((n − 1) >> l)``.
  """
  low_width: int
  upper_length: int

  @classmethod
  def of(cls, n: int, k: int) -> "EliasFano":
    if not 1 <= k <= n:
      raise ValueError(f"Elias–Fano coding needs 1 <= k <= n; got k={k}, n={n}")
    low = (n // k).bit_length() - 1
    return cls(low, k + ((n - 1) >> low))

  def bits(self, k: int) -> int:
    """The coded length of ``k`` positions, in bits."""
    return k * self.low_width + self.upper_length

  def encode(self, positions: jax.Array) -> jax.Array:
    """``positions``, int32 of shape ``(R, k)``, each row strictly increasing in ``[0, n)`` → the
    rows' codes, ``(R, bits(k))`` bits (low fields first, then the upper bit-vector)."""
    rows, k = positions.shape
    low = to_bits(positions & ((1 << self.low_width) - 1), self.low_width)
    ones = (positions >> self.low_width) + jnp.arange(k, dtype=positions.dtype)
    upper = jnp.zeros((rows, self.upper_length), jnp.uint8).at[
        jnp.arange(rows)[:, None], ones].set(1)
    return jnp.concatenate([low, upper], axis=-1)

  def decode(self, bits: jax.Array, k: int) -> jax.Array:
    """The inverse of ``encode``: ``(R, bits(k))`` bits → ``(R, k)`` int32 positions, increasing."""
    rows = bits.shape[0]
    low = (from_bits(bits[:, :k * self.low_width], self.low_width) if self.low_width
           else jnp.zeros((rows, k), jnp.int32))
    upper = bits[:, k * self.low_width:].astype(jnp.int32)
    # The i-th set bit of the upper vector sits at (p_i >> l) + i: find each one's rank i.
    rank = jnp.cumsum(upper, axis=-1) - 1
    where = jnp.where(upper == 1, rank, k)  # unset bits go to column k, which is dropped
    ones = jnp.zeros((rows, k), jnp.int32).at[jnp.arange(rows)[:, None], where].set(
        jnp.arange(self.upper_length, dtype=jnp.int32), mode="drop")
    high = ones - jnp.arange(k, dtype=jnp.int32)
    return (high << self.low_width) | low


def information_bound(n: int, k: int) -> float:
  """``log2 C(n, k)``: the fewest bits telling every set of ``k`` positions in ``[0, n)`` apart."""
  return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
