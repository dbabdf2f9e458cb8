"""``jaxcomp.sharded_optimizer`` across two processes joined by jax.distributed on 127.0.0.1 (gloo),
2 CPU devices each: each process holds the shards of its own devices, and the replicated parameters
are bit for bit the same on both, within rounding of the unsharded chain's."""

import numpy as np
import pytest

from helpers import rounding_tol
from test_distributed_multihost import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.numeric]


def test_sharded_optimizer_trains_across_two_processes(tmp_path):
  (first, second), _ = run_worker(tmp_path, "sharded_optimizer")
  for key in ("w", "b"):
    sharded = first[f"sharded/params/{key}"]
    # The same on both local devices of both processes, bit for bit.
    for got in (first[f"sharded/params/{key}"], second[f"sharded/params/{key}"]):
      np.testing.assert_array_equal(got, np.broadcast_to(sharded[0], got.shape), err_msg=key)
    np.testing.assert_allclose(sharded[0], first[f"unsharded/params/{key}"][0],
                               **rounding_tol(8 * 4 * 3), err_msg=key)
  # Each device holds its own shard of the 35-value moment: 4 shards of 9, the last one padded.
  indices = np.concatenate([first["device_index"], second["device_index"]])
  assert sorted(indices.tolist()) == [0, 1, 2, 3]
  rows = np.concatenate([first["sharded/mu/w"], second["sharded/mu/w"]])[np.argsort(indices)]
  assert rows.shape == (4, 1, 1, 9)
  np.testing.assert_array_equal(rows.reshape(-1)[35:], 0.0)
  assert len({rows[d].tobytes() for d in range(4)}) == 4  # four different shards
