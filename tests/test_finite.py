"""The non-finite check sees one NaN or infinity anywhere in a leaf of any size (XLA:CPU's max
reduction drops NaN from 4,096 elements on, which once hid a NaN in every large gradient), and a
stateful compressor keeps its state exactly when one device's large gradient holds one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import finite
from helpers import pmap_update

W = 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_one_bad_value_anywhere_in_a_leaf_of_any_size_is_seen(dtype):
  check = jax.jit(lambda x: finite.all_finite({"x": x}, None))
  for size in (1, 4095, 4096, 100_003):
    assert bool(check(jnp.full((size,), 3e4, dtype)))
    for bad in (np.nan, np.inf, -np.inf):
      for position in sorted({0, size // 2, size - 1}):
        assert not bool(check(jnp.ones((size,), dtype).at[position].set(bad))), (size, bad,
                                                                                 position)


def test_a_nan_in_one_devices_large_gradient_keeps_the_state_and_gives_nan():
  rng = np.random.default_rng(0)
  grads = {"w": rng.standard_normal((W, 256, 64)).astype(np.float32)}  # 16,384 elements
  tx = jaxcomp.quantized(8)
  state = jax.tree.map(lambda x: np.stack([x] * W), tx.init({"w": grads["w"][0]}))
  _, state = pmap_update(tx, grads, W, state=state)  # a state with a non-zero error
  grads["w"][2, 100, 7] = np.nan
  out, new_state = pmap_update(tx, grads, W, state=state)
  assert np.isnan(np.asarray(out["w"])).all()
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
