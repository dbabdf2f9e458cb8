"""``bitpack``: fixed-width fields and Elias–Fano index sets survive the trip through bytes, at the
lengths the module docstring gives, and Elias–Fano stays within ~2 bits a position of the bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._src import bitpack


@pytest.mark.parametrize("n, k", [(1, 1), (10, 1), (10, 10), (7, 3), (128, 1), (1280, 5),
                                  (4096, 16), (4096, 64), (4099, 64)])
def test_elias_fano_round_trips_through_bytes_at_its_fixed_length(n, k):
  rng = np.random.default_rng(n + k)
  sets = [rng.choice(n, k, replace=False) for _ in range(40)]
  sets += [np.arange(k), np.arange(n - k, n)]  # the densest ends: every high part equal, or last
  positions = np.sort(np.stack(sets), axis=-1).astype(np.int32)
  code = bitpack.EliasFano.of(n, k)
  low = int(np.floor(np.log2(n / k)))
  assert code == (low, k + ((n - 1) >> low))
  bits = jax.jit(code.encode)(positions)
  assert bits.shape == (len(sets), code.bits(k)) == (len(sets), k * low + k + ((n - 1) >> low))
  packed = jax.jit(bitpack.pack)(bits)
  assert packed.dtype == jnp.uint8 and packed.shape[-1] == -(-code.bits(k) // 8)
  decode = jax.jit(lambda b: code.decode(bitpack.unpack(b, code.bits(k)), k))
  np.testing.assert_array_equal(decode(packed), positions)


def test_elias_fano_is_within_two_bits_a_position_of_the_information_bound():
  for n, k in [(4096, 16), (4096, 32), (4096, 64), (4096, 128), (65536, 64)]:
    bound = bitpack.information_bound(n, k)
    assert bound <= bitpack.EliasFano.of(n, k).bits(k) < bound + 2 * k
  # The figures of the module docstring: 64 of 4,096 in 511 bits; the bound 471.3; 12-bit
  # indices 768.
  assert bitpack.EliasFano.of(4096, 64).bits(64) == 511
  assert round(bitpack.information_bound(4096, 64), 1) == 471.3


def test_fields_round_trip_least_significant_bit_first():
  x = jnp.asarray([[0, 1, 2, 7], [5, 3, 6, 4]], jnp.int32)
  bits = bitpack.to_bits(x, 3)
  np.testing.assert_array_equal(bits[0, :6], [0, 0, 0, 1, 0, 0])  # 0 then 1, LSB first
  np.testing.assert_array_equal(bitpack.from_bits(bits, 3), x)
  np.testing.assert_array_equal(bitpack.pack(bits)[0], [0b10001000, 0b00001110])
