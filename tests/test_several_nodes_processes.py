"""Several nodes as two processes joined by jax.distributed on 127.0.0.1 (gloo), 2 CPU devices
each, on the ``("replica", "data")`` mesh: DiLoCo, SparseLoCo and Streaming DiLoCo over
``"replica"`` with exact data parallelism inside a process match one device per replica fed its
replica's rows, DiLoCo fully sharded inside a process matches it too, and the hierarchical int8
mean sends half the flat one's codes across replica."""

import jax
import numpy as np
import pytest

import nodes_harness as harness
from helpers import rounding_tol
from test_distributed_multihost import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.numeric]


def test_several_nodes_across_two_processes(tmp_path):
  outs, _ = run_worker(tmp_path, "several_nodes")
  for name in harness.ALGORITHMS:
    expected = harness.reference(name, 2, 7)
    for t, want in enumerate(expected):
      for path, leaf in jax.tree_util.tree_leaves_with_path(want):
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        for replica, out in enumerate(outs):  # process r holds replica r
          np.testing.assert_allclose(out[f"{name}/{t}/{key}"], leaf[replica],
                                     **rounding_tol(64 * (t + 1)), err_msg=f"{name} {t} {key}")
  for t, want in enumerate(harness.reference("diloco", 2, 7)):  # fully sharded inside
    for path, leaf in jax.tree_util.tree_leaves_with_path(want):
      key = jax.tree_util.keystr(path, simple=True, separator="/")
      for out in outs:
        np.testing.assert_allclose(out[f"fsdp/{t}/{key}"], leaf[0], **rounding_tol(64 * (t + 1)),
                                   err_msg=f"fsdp {t} {key}")
  for out in outs:
    flat, hierarchical = out["bytes/flat/replica+data"], out["bytes/hierarchical/replica"]
    assert 0 < hierarchical <= flat / 2  # 2 devices per process
