"""``jaxcomp.fully_sharded`` across two processes joined by jax.distributed on 127.0.0.1 (gloo), 2
CPU devices each: each process holds its own devices' shards of the parameters, and the whole
parameters gathered from them are bit for bit the same on both processes; exactly, within rounding
of the unsharded chain's."""

import numpy as np
import pytest

from helpers import rounding_tol
from test_distributed_multihost import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.numeric]

KEYS = ("dense0/w", "dense0/b", "dense1/w", "scale")


def test_fully_sharded_trains_across_two_processes(tmp_path):
  (first, second), _ = run_worker(tmp_path, "fully_sharded")
  for key in KEYS:
    for run in ("exact", "int8"):  # the gathered parameters: the same on both processes
      np.testing.assert_array_equal(first[f"{run}/params/{key}"], second[f"{run}/params/{key}"],
                                    err_msg=f"{run} {key}")
    np.testing.assert_allclose(first[f"exact/params/{key}"], first[f"unsharded/params/{key}"],
                               **rounding_tol(8 * 4 * 3), err_msg=key)
    moved = np.abs(first[f"int8/params/{key}"] - first[f"unsharded/params/{key}"]).max()
    assert moved < 0.05, key  # int8 both ways: near the exact run after 3 steps of AdamW(0.05)
  # Each device holds its own shard of the 35-value kernel: 4 shards of 9, the last one padded.
  indices = np.concatenate([first["device_index"], second["device_index"]])
  assert sorted(indices.tolist()) == [0, 1, 2, 3]
  rows = np.concatenate([first["exact/shards/dense0/w"],
                         second["exact/shards/dense0/w"]])[np.argsort(indices)]
  assert rows.shape == (4, 1, 1, 9)  # per device: its (1, 1, 9) slice of the stacked shards
  np.testing.assert_array_equal(rows.reshape(-1)[35:], 0.0)
  np.testing.assert_allclose(rows.reshape(-1)[:35], first["exact/params/dense0/w"].reshape(-1),
                             rtol=0, atol=0)
