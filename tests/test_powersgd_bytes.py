"""What a PowerSGD step sends (``comm_report``), in its warm-up and compressed phases, and torch's
statistics of it (``compression_stats``), down to the README's first loop."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import pmapped_update, replicate
from powersgd_reference import grads_for

pytestmark = pytest.mark.numeric


def test_stats_match_torch_example():
  """torch 2.13's compression_stats() for Linear(8,16)–ReLU–Linear(16,4), rank 1: (3.3125, 212, 64)
  after one compressed step (torch's count: Σ n·m before, Σ (n+m)·r or n·m after)."""
  params = {"Dense_0": {"kernel": np.zeros((8, 16), np.float32), "bias": np.zeros(16, np.float32)},
            "Dense_1": {"kernel": np.zeros((16, 4), np.float32), "bias": np.zeros(4, np.float32)}}
  tx = jaxcomp.powersgd(1, start_iter=1, axis_name=None)
  state = tx.init(params)
  step = jax.jit(tx.update)
  grads = jax.tree.map(jnp.ones_like, params)
  assert state.compression_stats() == (0, 0, 0)
  _, state = step(grads, state)
  assert state.compression_stats() == (0, 0, 0)  # plain steps are not counted
  _, state = step(grads, state)
  assert state.compression_stats() == (3.3125, 212, 64)
  _, state = step(grads, state)
  assert jaxcomp.powersgd_stats((state, optax.EmptyState())) == (3.3125, 424, 128)
  torch_view = jaxcomp.powersgd(1, start_iter=0, matrix_view="torch", axis_name=None)
  torch_params = jax.tree.map(lambda x: x.T, params)
  _, torch_state = torch_view.update(torch_params, torch_view.init(torch_params))
  assert torch_state.compression_stats() == (3.3125, 212, 64)


def test_two_all_reduces_send_r_n_plus_m_values_per_leaf_and_the_warmup_the_mean():
  """One all-reduce each for the dense leaves, the Ps and the Qs: 4·r·(n+m) B per compressed
  leaf."""
  params = {"conv": np.zeros((3, 3, 4, 16), np.float32), "dense": np.zeros((64, 32), np.float32),
            "bias": np.zeros(32, np.float32), "small": np.zeros((3, 3), np.float32)}
  rank, n_dev = 2, 8
  tx = jaxcomp.powersgd(rank, start_iter=0)
  state = replicate(tx.init(params), n_dev)
  grads = grads_for(params, np.random.default_rng(0), n_dev)
  report = jaxcomp.comm_report(pmapped_update(tx, n_dev), grads, state)
  compressed = 4 * rank * ((36 + 16) + (64 + 32))
  dense = 4 * (32 + 9)
  assert all(c.op == "all-reduce" and c.group_size == n_dev for c in report.collectives)
  assert report.payload_bytes == compressed + dense  # no finiteness flag: it reads P and Q's sums
  # The uncompressed leaves packed with the Ps (one collective), then the Qs.
  p_bytes, q_bytes = 4 * rank * (36 + 64), 4 * rank * (16 + 32)
  assert sorted(c.payload_bytes for c in report.collectives) == sorted([dense + p_bytes, q_bytes])
  full = 4 * sum(x.size for x in params.values())
  ar_report = jaxcomp.comm_report(pmapped_update(jaxcomp.allreduce(), n_dev), grads,
                                  replicate(jaxcomp.allreduce().init(params), n_dev))
  assert ar_report.payload_bytes == full
  assert full / report.payload_bytes > 7.8  # 10,660 B dense against 1,352 B
  # With a warm-up, the report's totals are still the steady (compressed) step's; the warm-up
  # phase sends the dense mean.
  tx = jaxcomp.powersgd(rank, start_iter=10)
  warm = jaxcomp.comm_report(pmapped_update(tx, n_dev), grads, replicate(tx.init(params), n_dev))
  assert warm.phase_names == ("powersgd.warmup", "powersgd.compressed")
  assert warm.payload_bytes == report.payload_bytes
  assert warm.phase("powersgd.warmup").payload_bytes == full
  assert warm.phase("powersgd.compressed").payload_bytes == report.payload_bytes


def test_readme_loop_reports_its_compression():
  """The README's first loop keeps torch's start_iter=1000. Its report is the steady (compressed)
  step, fewer bytes than allreduce; the warm-up phase sends what allreduce sends, and the flag;
  torch's statistics count the compressed steps once the warm-up is over."""
  rng = np.random.default_rng(0)
  params = {"Dense_0": {"kernel": jnp.asarray(rng.standard_normal((16, 32)) / 4, jnp.float32),
                        "bias": jnp.zeros(32)},
            "Dense_1": {"kernel": jnp.asarray(rng.standard_normal((32, 8)) / 6, jnp.float32),
                        "bias": jnp.zeros(8)}}

  def loss_fn(params, x, y):
    hidden = jax.nn.relu(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    return jnp.mean((hidden @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"] - y) ** 2)

  mesh = jax.make_mesh((jax.device_count(),), ("batch",))
  batch = (rng.standard_normal((64, 16)).astype(np.float32),
           rng.standard_normal((64, 8)).astype(np.float32))
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=optax.chain(jaxcomp.powersgd(rank=2),
                                                           optax.adamw(1e-3)))
  opt_state, (x, y) = dp.make_state(params), dp.shard(batch)
  report = jaxcomp.comm_report(dp.step, params, opt_state, x, y)
  baseline_tx = optax.chain(jaxcomp.allreduce(), optax.adamw(1e-3))
  baseline = jaxcomp.data_parallel(loss_fn, mesh, tx=baseline_tx)
  dense = jaxcomp.comm_report(baseline.step, params, baseline.make_state(params), x, y)
  assert dense.payload_bytes == 4 * 808  # the float32 gradient
  assert report.phase("powersgd.warmup").payload_bytes == dense.payload_bytes
  # Rank 2: P and Q of both kernels, the biases dense.
  assert report.payload_bytes == 4 * 2 * ((16 + 32) + (32 + 8)) + 4 * (32 + 8)
  assert report.payload_bytes < dense.payload_bytes / 3.7
  for t in range(1002):
    params, opt_state, loss = dp.step(params, opt_state, x, y)
    jax.block_until_ready(loss)  # unblocked multi-device loops deadlock XLA:CPU on 2 cores
    if t == 999:
      assert opt_state[0].compression_stats() == (0, 0, 0)  # the warm-up is not counted
  before, after = 2 * 808, 2 * (2 * (16 + 32) + 2 * (32 + 8) + 32 + 8)
  assert opt_state[0].compression_stats() == (before / after, before, after)
  assert np.isfinite(np.asarray(loss)).all()
