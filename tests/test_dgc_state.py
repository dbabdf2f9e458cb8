"""DGC's state: kept bit for bit through a non-finite step (whose output is NaN everywhere), and
saved and restored by orbax."""


import chex
import jax
import numpy as np
import pytest

import jaxcomp

from dgc_reference import device_grads, make_params
from helpers import pmapped_update, replicate

pytestmark = pytest.mark.numeric
W = 4


@pytest.mark.parametrize("tx, bad", [
    (jaxcomp.dgc(0.05, selection="exact"), np.inf),
    # A NaN is never among the sampled selection's values (|NaN| >= threshold is false): the
    # device's values are sent as NaN instead.
    (jaxcomp.dgc(0.05), np.nan),
    (jaxcomp.coarse_dgc(0.25, chunk_size=32), np.nan),  # in the all-reduced chunk norms
], ids=["exact_inf", "sampled_nan", "coarse_nan"])
def test_nonfinite_step_keeps_state_and_outputs_nan(tx, bad):
  params = make_params()
  rng = np.random.default_rng(6)
  state = replicate(tx.init(params), W)
  update = pmapped_update(tx, W)
  _, state = jax.block_until_ready(update(device_grads(rng, params, W), state))
  grads = device_grads(rng, params, W)
  grads["w1"][2, 0, 0] = bad
  out, new_state = jax.block_until_ready(update(grads, state))
  chex.assert_trees_all_equal(new_state, state)
  for leaf in jax.tree.leaves(out):
    assert leaf.dtype != np.float32 or np.isnan(leaf).all()
  # The next finite step runs as if the bad one had not happened.
  grads = device_grads(rng, params, W)
  out, after = jax.block_until_ready(update(grads, new_state))
  expected, again = jax.block_until_ready(update(grads, state))
  chex.assert_trees_all_equal((out, after), (expected, again))
  assert int(after.count[0]) == 2


def test_state_checkpoints_with_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = jaxcomp.dgc(0.05, axis_name=None)
  params = make_params()
  state = tx.init(params)
  grads = {k: np.ones_like(p) for k, p in params.items()}
  _, state = jax.jit(tx.update)(grads, state)  # jitted: eagerly it is 265 op-by-op compiles
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "dgc", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "dgc", jax.tree.map(np.zeros_like, state))
  chex.assert_trees_all_equal(restored, state)
