"""PowerSGD (jaxcomp.powersgd, jaxcomp.batched_powersgd and their hooks) on simulated devices.

The numbers are checked against a NumPy reference written here in torch's step order, from torch
2.13's ``powerSGD_hook`` and the paper's Algorithms 1–2 (Vogels et al., NeurIPS 2019); parity with torch's own hook is in test_powersgd_torch.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from helpers import assert_identical_across_devices, replicate, rounding_tol
from jaxcomp._src.buckets import bucket_assignment
from jaxcomp._src.powersgd import orthogonalize

pytestmark = pytest.mark.numeric
W = 4


# ---------------------------------------------------------------------------------------------------
# NumPy reference, float64, from torch's powerSGD_hook (torch 2.13) and the paper's Algorithm 1.


def np_orthogonalize(x, eps=0.0):
  """torch's orthogonalization: MGS for r ≤ 2 (col /= norm + eps, then remove it from later ones)."""
  x = np.array(x, np.float64)
  if x.shape[1] > 2:
    return np.linalg.qr(x)[0]
  for i in range(x.shape[1]):
    denom = np.linalg.norm(x[:, i]) + eps
    x[:, i] /= denom if denom else 1.0
    for j in range(i + 1, x.shape[1]):
      x[:, j] -= np.sum(x[:, i] * x[:, j]) * x[:, i]
  return x


def matrix_shape(shape, view):
  if not shape:
    return 1, 1
  if view == "torch":
    return shape[0], int(np.prod(shape[1:]))
  return int(np.prod(shape[:-1])), shape[-1]


def np_step(grads, errors, qs, *, rank, rate=2.0, eps=0.0, view="flax", ef=True):
  """One compressed step. grads/errors: per device, name -> array; qs: name -> Q (compressed only)."""
  n_dev = len(grads)
  ms = [{k: g[k].astype(np.float64) + (errors[d][k] if ef else 0) for k in g}
        for d, g in enumerate(grads)]
  out, new_q = {}, {}
  for k in grads[0]:
    n, m = matrix_shape(grads[0][k].shape, view)
    r = min(n, m, rank)
    if not (n + m) * r * rate < n * m:
      out[k] = sum(mm[k] for mm in ms) / n_dev
      continue
    mats = [mm[k].reshape(n, m) for mm in ms]
    q = np_orthogonalize(qs[k], eps)
    p = np_orthogonalize(sum(mat @ q for mat in mats), eps)  # P summed, not divided
    q = sum(mat.T @ p for mat in mats) / n_dev
    out[k] = (p @ q.T).reshape(grads[0][k].shape)
    new_q[k] = q
  new_errors = [{k: mm[k] - out[k] for k in mm} for mm in ms]
  return out, new_errors, new_q


def np_batched_step(grads, errors, q, *, rank, ef=True):
  """One compressed batched step on flat per-device vectors (length L)."""
  n_dev, length = len(grads), grads[0].size
  side = int(np.ceil(np.sqrt(length)))
  ms = [np.pad(g.astype(np.float64), (0, side * side - length)) + (errors[d] if ef else 0)
        for d, g in enumerate(grads)]
  mats = [mm.reshape(side, side) for mm in ms]
  p = np_orthogonalize(sum(mat @ np_orthogonalize(q) for mat in mats))
  q = sum(mat.T @ p for mat in mats) / n_dev
  out = (p @ q.T).reshape(-1)
  return out[:length], [mm - out for mm in ms], q


def np_alternating_step(grads, errors, ps, qs, t, *, rank, rate=2.0, view="flax"):
  """epfml's BasicPowerSGD, one iteration per step: compressed step t (from 0) sends Qs if t is even
  (P̂ = orth(P), Q = Mᵀ·P̂), Ps if odd (Q̂ = orth(Q), P = M·Q̂); the error is M minus this device's
  own low-rank product; the uncompressed leaves are averaged (error: local minus mean)."""
  n_dev = len(grads)
  ms = [{k: g[k].astype(np.float64) + errors[d][k] for k in g} for d, g in enumerate(grads)]
  out, new_ps, new_qs = {}, dict(ps), dict(qs)
  new_errors = [{} for _ in range(n_dev)]
  for k in grads[0]:
    shape = grads[0][k].shape
    n, m = matrix_shape(shape, view)
    r = min(n, m, rank)
    if not (n + m) * r * rate < n * m:
      out[k] = sum(mm[k] for mm in ms) / n_dev
      for d in range(n_dev):
        new_errors[d][k] = ms[d][k] - out[k]
      continue
    mats = [mm[k].reshape(n, m) for mm in ms]
    if t % 2 == 0:
      p_hat = np_orthogonalize(ps[k])
      local = [mat.T @ p_hat for mat in mats]
      new_qs[k] = sum(local) / n_dev
      out[k] = (p_hat @ new_qs[k].T).reshape(shape)
      products = [p_hat @ q.T for q in local]
    else:
      q_hat = np_orthogonalize(qs[k])
      local = [mat @ q_hat for mat in mats]
      new_ps[k] = sum(local) / n_dev
      out[k] = (new_ps[k] @ q_hat.T).reshape(shape)
      products = [p @ q_hat.T for p in local]
    for d in range(n_dev):
      new_errors[d][k] = ms[d][k] - products[d].reshape(shape)
  return out, new_errors, new_ps, new_qs


# ---------------------------------------------------------------------------------------------------
# Helpers.


def params_mixed():
  """Flax-layout leaves: conv kernel, dense kernels, biases, a 0-d scale and an int counter."""
  return {"conv": {"kernel": np.zeros((3, 3, 2, 8), np.float32), "bias": np.zeros(8, np.float32)},
          "dense": {"kernel": np.zeros((20, 12), np.float32), "bias": np.zeros(12, np.float32)},
          "head": {"kernel": np.zeros((12, 5), np.float32)},
          "scale": np.zeros((), np.float32), "steps": np.zeros(3, np.int32)}


def grads_for(params, rng, n_dev=W):
  def leaf(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return np.stack([rng.standard_normal(x.shape) for _ in range(n_dev)]).astype(x.dtype)
    return np.stack([np.asarray(x) + 7] * n_dev)
  return jax.tree.map(leaf, params)


def device(tree, d):
  return jax.tree.map(lambda x: np.asarray(x)[d], tree)


def named(tree):
  """Flattens a pytree to {path: leaf}, leaving out MaskedNode and non-array leaves."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def per_leaf(state):
  """``{field: {path: leaf}}`` of a layer-wise state, whole or a ``comm_hook`` state of one per
  bucket (each bucket's state names its parameters by their paths in the whole pytree)."""
  states = state.hook_states if isinstance(state, jaxcomp.CommHookState) else (state,)
  out = {"error": {}, "q": {}, "p": {}}
  for s in states:
    for field in out:
      for path, leaf in zip(s.signature.paths, s.signature.treedef.flatten_up_to(getattr(s, field))):
        if not isinstance(leaf, optax.MaskedNode):
          out[field][path] = np.asarray(leaf)
  return out


def pmapped(tx, n_dev=W):
  return jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:n_dev])


def run(step, grads, state):
  out, state = step(grads, state)
  return jax.block_until_ready(out), state


# ---------------------------------------------------------------------------------------------------
# Arguments.


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank must be a positive int; got 0"),
    (dict(start_iter=-1), "start_iter must be a non-negative int; got -1"),
    (dict(min_compression_rate=-1.0), "min_compression_rate must be a finite number >= 0"),
    (dict(epsilon=float("nan")), "epsilon must be a finite number >= 0; got nan"),
    (dict(seed=-3), "seed must be a non-negative int; got -3"),
    (dict(matrix_view="numpy"), "matrix_view must be 'torch' or 'flax'; got 'numpy'"),
])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxcomp.powersgd(**kwargs)


def test_bad_types_are_named():
  with pytest.raises(TypeError, match=r"rank must be a positive int; got 1.5 \(float\)"):
    jaxcomp.powersgd(rank=1.5)
  with pytest.raises(TypeError, match=r"rank must be a positive int; got True \(bool\)"):
    jaxcomp.powersgd(rank=True)
  with pytest.raises(TypeError, match="error_feedback must be a bool; got 'yes'"):
    jaxcomp.powersgd(error_feedback="yes")
  with pytest.raises(TypeError, match="axis_name must be"):
    jaxcomp.batched_powersgd(axis_name=3)
  with pytest.raises(ValueError, match="rank must be a positive int"):
    jaxcomp.hooks.powersgd_state(rank=-1)
  with pytest.raises(ValueError, match=r"batched PowerSGD takes no epsilon, matrix_view \(got "
                     r"epsilon=1e-08, matrix_view='torch'\): they are layer-wise PowerSGD's"):
    jaxcomp.hooks.batched_powersgd_state(epsilon=1e-8, matrix_view="torch")
  with pytest.raises(TypeError, match=r"powersgd_hook needs the per-bucket state made by "
                     r"jaxcomp.hooks.powersgd_state"):
    jaxcomp.comm_hook(jaxcomp.hooks.powersgd_hook, axis_name=None).update(
        {"w": jnp.ones((4, 4))}, jaxcomp.comm_hook(jaxcomp.hooks.powersgd_hook).init(
            {"w": jnp.ones((4, 4))}))


def test_changed_gradient_pytree_is_refused():
  tx = jaxcomp.powersgd(axis_name=None)
  state = tx.init({"w": jnp.zeros((4, 4))})
  with pytest.raises(ValueError, match=r"leaf \['w'\] changed between init and update"):
    tx.update({"w": jnp.zeros((4, 5))}, state)


# ---------------------------------------------------------------------------------------------------
# The algorithm against the NumPy reference.


def test_state_layout():
  state = jaxcomp.powersgd(rank=2).init(params_mixed())
  q, error = named(state.q), named(state.error)
  # conv kernel (3,3,2,8) is (18, 8) in the flax view, dense (20, 12): compressed at rank 2. Head
  # (12, 5) is not worth it ((12 + 5)·2·2 ≥ 60), nor are vectors.
  assert {k: v.shape for k, v in q.items()} == {
      "['conv']['kernel']": (8, 2), "['dense']['kernel']": (12, 2)}
  assert isinstance(state.q["conv"]["bias"], optax.MaskedNode)
  assert isinstance(state.error["steps"], optax.MaskedNode)  # int leaf: no error, passes through
  assert error["['scale']"].shape == () and not error["['scale']"].any()
  torch_view = jaxcomp.powersgd(rank=1, matrix_view="torch").init(params_mixed())
  assert torch_view.q["conv"]["kernel"].shape == (48, 1)  # torch's (3, 48) view of the same array
  no_ef = jaxcomp.powersgd(error_feedback=False).init(params_mixed())
  assert not jax.tree.leaves(no_ef.error)
  # Q comes from the seed: the same for the same seed, different for another.
  chex.assert_trees_all_equal(jaxcomp.powersgd(rank=2).init(params_mixed()).q, state.q)
  assert not np.array_equal(jaxcomp.powersgd(rank=2, seed=1).init(params_mixed()).q["dense"]["kernel"],
                            q["['dense']['kernel']"])


@pytest.mark.parametrize("rank, warm_start", [(1, True), (2, False), (3, True)])
def test_matches_numpy_reference(rank, warm_start):
  """Mixed leaves on 4 devices across the start iteration; rank 3 takes the QR path."""
  params = params_mixed()
  tx = jaxcomp.powersgd(rank, start_iter=2, warm_start=warm_start, epsilon=1e-8)
  state = replicate(tx.init(params), W)
  step = pmapped(tx)
  rng = np.random.default_rng(rank)
  float_keys = [k for k, v in named(params).items() if v.dtype == np.float32]
  errors = [{k: 0.0 for k in float_keys} for _ in range(W)]
  # float32 against the float64 reference: per step, roundings along the n + m ≤ 32 sums of P and
  # Q and the W devices, carried by the error feedback through 5 steps; unit-scale gradients.
  tol = rounding_tol(5 * (20 + 12 + W))
  for t in range(5):
    grads = grads_for(params, rng)
    qs = {k: v[0] for k, v in named(state.q).items()}  # the Q this step starts from
    out, state = run(step, grads, state)
    assert_identical_across_devices(out)
    assert_identical_across_devices((state.q, state.count))
    per_device = [{k: v for k, v in named(device(grads, d)).items() if k in float_keys}
                  for d in range(W)]
    if t < 2:  # plain mean, error untouched
      expected = {k: np.mean([g[k] for g in per_device], axis=0) for k in float_keys}
    else:
      expected, errors, new_q = np_step(per_device, errors, qs, rank=rank, eps=1e-8)
      for k, q in named(state.q).items():
        if warm_start:
          np.testing.assert_allclose(q[0], new_q[k], **tol, err_msg=k)
        else:  # a fresh draw each step
          assert not np.allclose(q[0], qs[k])
    got = named(out)
    for k in float_keys:
      np.testing.assert_allclose(got[k][0], expected[k], **tol, err_msg=(t, k))
    np.testing.assert_array_equal(got["['steps']"], np.asarray(grads["steps"]))  # passed through
    for d in range(W):
      for k, e in named(device(state.error, d)).items():
        np.testing.assert_allclose(e, errors[d][k], **tol, err_msg=(t, d, k))
  assert int(state.count[0]) == 5


def test_no_error_feedback_and_uncompressed_error_is_local_minus_mean():
  params = {"w": np.zeros((16, 16), np.float32), "b": np.zeros(16, np.float32)}
  rng = np.random.default_rng(0)
  grads = grads_for(params, rng)
  tx = jaxcomp.powersgd(1, start_iter=0)
  out, state = run(pmapped(tx), grads, replicate(tx.init(params), W))
  scale = max(np.abs(g).max() for g in grads.values())
  # Against NumPy: the mean's W roundings, and one each for error = m - out and error + out.
  tol = rounding_tol(W + 2, scale=scale)
  np.testing.assert_allclose(state.error["b"], grads["b"] - grads["b"].mean(0), **tol)
  np.testing.assert_allclose(state.error["w"] + out["w"], grads["w"], **tol)
  tx = jaxcomp.powersgd(1, start_iter=0, error_feedback=False)
  out2, state2 = run(pmapped(tx), grads, replicate(tx.init(params), W))
  # First step, no error to add yet; another program: the 16 + 16 sums of P and Q and W devices.
  chex.assert_trees_all_close(out2, out, **rounding_tol(16 + 16 + W, scale=scale))
  assert not jax.tree.leaves(state2.error)


def test_rank_is_clamped_and_full_rank_gives_the_mean():
  params = {"w": np.zeros((4, 6), np.float32), "s": np.zeros((), np.float32),
            "v": np.zeros(5, np.float32)}
  tx = jaxcomp.powersgd(50, start_iter=0, min_compression_rate=0.0)  # compress everything
  state = tx.init(params)
  assert state.q["w"].shape == (6, 4) and state.q["s"].shape == (1, 1)
  assert state.q["v"].shape == (5, 1)  # a vector is (1, 5) in the flax view
  grads = grads_for(params, np.random.default_rng(1))
  out, _ = run(pmapped(tx), grads, replicate(state, W))
  # r = n: P̂ is a full orthonormal basis, so P̂·Qᵀ is the mean (QR path, r = 4): to rounding along
  # the 4 + 6 sums of P and Q and the W devices.
  tol = rounding_tol(4 + 6 + W)
  np.testing.assert_allclose(out["w"][0], grads["w"].mean(0), **tol)
  np.testing.assert_allclose(out["s"][0], grads["s"].mean(0), **tol)


def test_orthogonalize():
  rng = np.random.default_rng(0)
  for shape in [(7, 1), (7, 2), (7, 4)]:
    x = rng.standard_normal(shape).astype(np.float32)
    # float32 against float64: roundings along the 7-long norms and projections of each column.
    np.testing.assert_allclose(orthogonalize(jnp.asarray(x)), np_orthogonalize(x),
                               **rounding_tol(7 * shape[1]))
  zero = orthogonalize(jnp.zeros((5, 2)))
  np.testing.assert_array_equal(zero, 0)  # torch gives NaN here
  for dtype, tol in [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)]:  # rank-deficient: still orthonormal
    for _ in range(20):
      p = rng.standard_normal((20, 1)) @ rng.standard_normal((1, 2))
      p_hat = np.asarray(orthogonalize(jnp.asarray(p, dtype)), np.float32)
      np.testing.assert_allclose(p_hat.T @ p_hat, np.eye(2), atol=tol)
  half = orthogonalize(jnp.asarray(rng.standard_normal((6, 3)) * 300, jnp.float16))
  assert half.dtype == jnp.float16 and jnp.isfinite(half).all()  # 300² overflows float16 norms
  np.testing.assert_allclose(np.asarray(half, np.float32).T @ np.asarray(half, np.float32),
                             np.eye(3), atol=1e-2)


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


def test_collectives_and_bytes():
  """One all-reduce each for the dense leaves, the Ps and the Qs: 4·r·(n+m) B per compressed leaf."""
  params = {"conv": np.zeros((3, 3, 4, 16), np.float32), "dense": np.zeros((64, 32), np.float32),
            "bias": np.zeros(32, np.float32), "small": np.zeros((3, 3), np.float32)}
  rank, n_dev = 2, 8
  tx = jaxcomp.powersgd(rank, start_iter=0)
  state = replicate(tx.init(params), n_dev)
  grads = grads_for(params, np.random.default_rng(0), n_dev)
  report = jaxcomp.comm_report(pmapped(tx, n_dev), grads, state)
  compressed = 4 * rank * ((36 + 16) + (64 + 32))
  dense = 4 * (32 + 9)
  assert all(c.op == "all-reduce" and c.group_size == n_dev for c in report.collectives)
  assert report.payload_bytes == compressed + dense  # no finiteness flag: it reads P and Q's sums
  # The uncompressed leaves packed with the Ps (one collective), then the Qs.
  p_bytes, q_bytes = 4 * rank * (36 + 64), 4 * rank * (16 + 32)
  assert sorted(c.payload_bytes for c in report.collectives) == sorted([dense + p_bytes, q_bytes])
  full = 4 * sum(x.size for x in params.values())
  ar_report = jaxcomp.comm_report(pmapped(jaxcomp.allreduce(), n_dev), grads,
                                  replicate(jaxcomp.allreduce().init(params), n_dev))
  assert ar_report.payload_bytes == full
  assert full / report.payload_bytes > 7.8  # 10,660 B dense against 1,352 B
  # With a warm-up, the report's totals are still the steady (compressed) step's; the warm-up
  # phase sends the dense mean.
  tx = jaxcomp.powersgd(rank, start_iter=10)
  warm = jaxcomp.comm_report(pmapped(tx, n_dev), grads, replicate(tx.init(params), n_dev))
  assert warm.phase_names == ("powersgd.warmup", "powersgd.compressed")
  assert warm.payload_bytes == report.payload_bytes
  assert warm.phase("powersgd.warmup").payload_bytes == full
  assert warm.phase("powersgd.compressed").payload_bytes == report.payload_bytes


def test_shard_map_with_state_partition_specs_matches_pmap():
  """check_vma=True: the error is varying (sharded), count and Q invariant (replicated)."""
  params = {"w": np.zeros((12, 10), np.float32), "b": np.zeros(10, np.float32)}
  tx = jaxcomp.powersgd(2, start_iter=1)
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])
  specs = jaxcomp.state_partition_specs(tx, params)
  assert specs.error == {"w": P("batch"), "b": P("batch")} and specs.q["w"] == P()
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("batch"), specs),
                     out_specs=(P(), specs), check_vma=True)
  def step(grads, state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), state)

  ref_step, ref_state = pmapped(tx), replicate(tx.init(params), W)
  rng = np.random.default_rng(0)
  tol = rounding_tol(3 * (12 + 10 + W))  # two programs: the sums of P, Q and W devices, 3 steps
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = run(step, grads, state)
    ref_out, ref_state = run(ref_step, grads, ref_state)
    chex.assert_trees_all_close(out, device(ref_out, 0), **tol)
  np.testing.assert_allclose(state.error["w"], np.concatenate(list(ref_state.error["w"])), **tol)
  chex.assert_trees_all_close(state.q, device(ref_state.q, 0), **tol)


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


# ---------------------------------------------------------------------------------------------------
# Robustness torch lacks.


@pytest.mark.parametrize("make", [
    functools.partial(jaxcomp.powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.batched_powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.powersgd, 2, start_iter=1, alternating=True),
    functools.partial(jaxcomp.powersgd, 2, start_iter=1, bucket_cap_mb=1e-4),
], ids=["layerwise", "batched", "alternating", "bucketed"])
def test_non_finite_gradient_keeps_the_state(make):
  params = {"w": np.zeros((12, 10), np.float32), "b": np.zeros(10, np.float32)}
  tx = make()
  step = pmapped(tx)
  rng = np.random.default_rng(0)
  state = replicate(tx.init(params), W)
  for _ in range(2):
    _, state = run(step, grads_for(params, rng), state)
  bad = grads_for(params, rng)
  bad["w"][2, 3, 4] = np.nan
  out, kept = run(step, bad, state)
  assert np.isnan(out["w"]).all() and np.isnan(out["b"]).all()  # every output NaN ...
  chex.assert_trees_all_equal(kept, state)  # ... and the state is kept bit for bit, count included
  out, state = run(step, grads_for(params, rng), kept)
  assert np.isfinite(out["w"]).all() and np.isfinite(jax.tree.leaves(state)[1]).all()
  chex.assert_tree_all_finite(state)


@pytest.mark.parametrize("rank", [1, 3])
def test_zero_gradient_gives_zeros_and_does_not_stall(rank):
  params = {"w": np.zeros((12, 10), np.float32)}
  tx = jaxcomp.powersgd(rank, start_iter=0)
  step = pmapped(tx)
  state = replicate(tx.init(params), W)
  out, after_zero = run(step, {"w": np.zeros((W, 12, 10), np.float32)}, state)
  np.testing.assert_array_equal(out["w"], 0)
  chex.assert_trees_all_equal(after_zero.q, state.q)  # an all-zero Q would stall warm start
  grads = grads_for(params, np.random.default_rng(0))
  chex.assert_trees_all_close(run(step, grads, after_zero)[0], run(step, grads, state)[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_params(dtype):
  params = {"w": np.zeros((24, 16), dtype), "b": np.zeros(16, dtype)}
  tx = jaxcomp.powersgd(4, start_iter=0)  # rank 4 in half precision: Gram–Schmidt, as torch
  ref = jaxcomp.powersgd(4, start_iter=0)
  state = replicate(tx.init(params), W)
  ref_state = jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == dtype else x, state)
  ref_state = ref_state._replace(signature=jaxcomp.TreeSignature.of(
      jax.tree.map(lambda x: x.astype(np.float32), params)))
  step, ref_step = pmapped(tx), pmapped(ref)
  rng = np.random.default_rng(0)
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = run(step, grads, state)
    ref_out, ref_state = run(ref_step, jax.tree.map(lambda x: x.astype(np.float32), grads),
                             ref_state)
    assert out["w"].dtype == dtype and state.error["w"].dtype == dtype
    assert state.q["w"].dtype == dtype
    chex.assert_tree_all_finite(out)
    # Half precision against float32: a few roundings of the half dtype on values up to ~4.
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), ref_out["w"],
                               **rounding_tol(4, scale=4, dtype=dtype))


def test_unbound_axis_is_world_size_one():
  params = {"w": np.zeros((10, 8), np.float32)}
  tx = jaxcomp.powersgd(8, start_iter=0, min_compression_rate=0.0, axis_name="nope")
  grads = {"w": np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)}
  with pytest.warns(UserWarning, match="not bound"):
    out, state = jax.jit(tx.update)(grads, tx.init(params))
  # Full rank on one device: exact up to rounding along the 10 + 8 sums of P and Q.
  tol = rounding_tol(10 + 8, scale=np.abs(grads["w"]).max())
  np.testing.assert_allclose(out["w"], grads["w"], **tol)
  np.testing.assert_allclose(state.error["w"], 0, **tol)


# ---------------------------------------------------------------------------------------------------
# The alternating variant, compress=, per-bucket collectives, schedules.


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_alternating_matches_numpy_reference(rank):
  """epfml's variant across the start iteration: Qs sent on even compressed steps, Ps on odd ones."""
  params = params_mixed()
  tx = jaxcomp.powersgd(rank, start_iter=2, alternating=True)
  state = replicate(tx.init(params), W)
  step = pmapped(tx)
  rng = np.random.default_rng(10 + rank)
  float_keys = [k for k, v in named(params).items() if v.dtype == np.float32]
  errors = [{k: 0.0 for k in float_keys} for _ in range(W)]
  for t in range(6):
    grads = grads_for(params, rng)
    ps, qs = ({k: v[0] for k, v in named(f).items()} for f in (state.p, state.q))
    out, state = run(step, grads, state)
    assert_identical_across_devices((out, state.p, state.q, state.count))
    per_device = [{k: v for k, v in named(device(grads, d)).items() if k in float_keys}
                  for d in range(W)]
    if t < 2:  # plain mean, factors untouched
      expected = {k: np.mean([g[k] for g in per_device], axis=0) for k in float_keys}
      chex.assert_trees_all_equal(ps, {k: v[0] for k, v in named(state.p).items()})
    else:
      expected, errors, new_ps, new_qs = np_alternating_step(per_device, errors, ps, qs, t - 2,
                                                             rank=rank)
      for got, want in ((state.p, new_ps), (state.q, new_qs)):
        for k, factor in named(got).items():
          np.testing.assert_allclose(factor[0], want[k], rtol=1e-4, atol=1e-5, err_msg=(t, k))
    got = named(out)
    for k in float_keys:
      np.testing.assert_allclose(got[k][0], expected[k], rtol=1e-4, atol=1e-5, err_msg=(t, k))
    for d in range(W):
      for k, e in named(device(state.error, d)).items():
        np.testing.assert_allclose(e, errors[d][k], rtol=1e-4, atol=1e-5, err_msg=(t, d, k))
  assert powersgd_ratio(state) > 1


def powersgd_ratio(state):
  return jaxcomp.powersgd_stats(device(state, 0))[0]


def test_alternating_sends_one_all_reduce_per_step():
  """comm_report: one all-reduce per step: the uncompressed leaves with the
  Qs (phase "even" of the compressed steps) or with the Ps ("odd"); the steady state averages the
  two."""
  params = {"conv": np.zeros((3, 3, 4, 16), np.float32), "dense": np.zeros((64, 32), np.float32),
            "bias": np.zeros(32, np.float32)}
  rank, n_dev = 2, 8
  tx = jaxcomp.powersgd(rank, start_iter=0, alternating=True)
  grads = grads_for(params, np.random.default_rng(0), n_dev)
  report = jaxcomp.comm_report(pmapped(tx, n_dev), grads, replicate(tx.init(params), n_dev))
  dense, qs, ps = 4 * 32, 4 * rank * (16 + 32), 4 * rank * (36 + 64)
  assert all(c.op == "all-reduce" for c in report.collectives)
  assert report.phase_names == ("powersgd.compressed", "powersgd.compressed/powersgd.even",
                                "powersgd.compressed/powersgd.odd")
  # No finiteness flag: the step reads it from the sums it sends.
  assert [c.payload_bytes for c in report.collectives if c.phase == ""] == []
  even, odd = report.phase("powersgd.even"), report.phase("powersgd.odd")
  assert sorted(c.payload_bytes for c in even.collectives) == [dense + qs]
  assert sorted(c.payload_bytes for c in odd.collectives) == [dense + ps]
  assert report.payload_bytes == dense + (qs + ps) / 2
  # torch's variant sends the same factors in one step, in two sequential all-reduces.
  torch_tx = jaxcomp.powersgd(rank, start_iter=0)
  torch_report = jaxcomp.comm_report(pmapped(torch_tx, n_dev), grads,
                                     replicate(torch_tx.init(params), n_dev))
  assert torch_report.payload_bytes == dense + qs + ps
  assert len(torch_report.collectives) == 2


def test_alternating_needs_warm_start_and_layerwise():
  with pytest.raises(ValueError, match="alternating=True needs warm_start=True"):
    jaxcomp.powersgd(alternating=True, warm_start=False)
  with pytest.raises(ValueError, match="batched PowerSGD takes no alternating"):
    jaxcomp.PowerSGDConfig(batched=True, alternating=True)


def test_compress_predicate_averages_the_other_leaves_densely():
  """compress= replaces optax.masked: the rejected kernel is averaged (error: local minus mean)."""
  params = {"conv": {"kernel": np.zeros((3, 3, 4, 16), np.float32)},
            "dense": {"kernel": np.zeros((64, 32), np.float32), "bias": np.zeros(32, np.float32)}}
  only_conv = jaxcomp.powersgd(1, start_iter=0, compress=lambda path, leaf: "conv" in path)
  everything = jaxcomp.powersgd(1, start_iter=0)
  state = only_conv.init(params)
  assert isinstance(state.q["dense"]["kernel"], optax.MaskedNode)
  assert state.q["conv"]["kernel"].shape == (16, 1)
  grads = grads_for(params, np.random.default_rng(3))
  out, new_state = run(pmapped(only_conv), grads, replicate(state, W))
  ref_out, _ = run(pmapped(everything), grads, replicate(everything.init(params), W))
  mean = grads["dense"]["kernel"].mean(0)
  np.testing.assert_allclose(out["dense"]["kernel"][0], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_state.error["dense"]["kernel"], grads["dense"]["kernel"] - mean,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["conv"]["kernel"], ref_out["conv"]["kernel"], rtol=1e-5,
                             atol=1e-6)
  assert_identical_across_devices(out)
  report = jaxcomp.comm_report(pmapped(only_conv), grads, replicate(state, W))
  assert report.payload_bytes == 4 * (64 * 32 + 32) + 4 * (36 + 16)
  with pytest.raises(TypeError, match=r"compress must be callable as compress\(path, leaf\)"):
    jaxcomp.powersgd(compress="kernel")


@pytest.mark.parametrize("alternating", [False, True])
def test_bucketed_collectives_give_the_same_step(alternating):
  """bucket_cap_mb: one set of collectives per DDP bucket, the same numbers as one set for all."""
  params = {f"l{i}": {"kernel": np.zeros((24, 16), np.float32), "bias": np.zeros(16, np.float32)}
            for i in range(3)}
  kwargs = dict(start_iter=1, alternating=alternating)
  whole, bucketed = jaxcomp.powersgd(2, **kwargs), jaxcomp.powersgd(2, bucket_cap_mb=1e-3, **kwargs)
  states = [replicate(tx.init(params), W) for tx in (whole, bucketed)]
  steps = [pmapped(tx) for tx in (whole, bucketed)]
  reports = [jaxcomp.comm_report(f, grads_for(params, np.random.default_rng(0)), s)
             for f, s in zip(steps, states)]
  # Four buckets (DDP's rule cuts [l2.kernel], [l2.bias, l1.kernel], ...): the same bytes, in
  # more collectives. tests/test_overlap.py checks what each of them depends on.
  assert len(reports[1].collectives) > 2 * len(reports[0].collectives)
  # And comm_hook's 4-byte flag: a NaN in one bucket keeps every bucket's state.
  assert reports[1].payload_bytes == reports[0].payload_bytes + 4
  # Each leaf draws its factors from its path: the same whole and in its bucket.
  assert len(states[1].hook_states) == 4
  chex.assert_trees_all_equal(per_leaf(states[1]), per_leaf(states[0]))
  rng = np.random.default_rng(4)
  tol = rounding_tol(4 * (24 + 16 + W))  # two programs: the sums of P, Q and W devices, 4 steps
  for _ in range(4):
    grads = grads_for(params, rng)
    (a, states[0]), (b, states[1]) = [run(f, grads, s) for f, s in zip(steps, states)]
    chex.assert_trees_all_close(b, a, **tol)
    chex.assert_trees_all_close(per_leaf(states[1]), per_leaf(states[0]), **tol)
  assert [int(s.count[0]) for s in states[1].hook_states] == [int(states[0].count[0])] * 4 == [4] * 4


def test_static_hyperparameters_are_refused_together_and_epsilon_is_scheduled():
  """optax.inject_hyperparams passes every number as an array: one error names all the static
  ones; with them in static_args it runs, and epsilon, the one traceable setting, is scheduled."""
  params = {"w": jnp.zeros((8, 8))}
  static = ("rank", "start_iter", "min_compression_rate", "seed")
  with pytest.raises(TypeError) as refused:
    optax.inject_hyperparams(jaxcomp.powersgd)(rank=1).init(params)
  assert f"static_args=({', '.join(map(repr, static))}); only epsilon may be scheduled" in str(
      refused.value)
  with pytest.raises(TypeError, match=r"static_args=\('rank', 'start_iter', 'seed'\)$"):
    optax.inject_hyperparams(jaxcomp.batched_powersgd)(rank=1).init(params)
  # With some of them static already, the fix still names them all: copied, it runs.
  with pytest.raises(TypeError, match=r"static_args=\('rank', 'start_iter', "
                                      r"'min_compression_rate', 'seed'\)"):
    optax.inject_hyperparams(jaxcomp.powersgd, static_args=("rank",))(rank=1).init(params)
  with pytest.raises(TypeError, match=r"bucket_cap_mb is static"):
    jaxcomp.powersgd(bucket_cap_mb=jnp.asarray(1.0))
  grads = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)}

  def first_step(tx):
    return jax.jit(tx.update)(grads, tx.init(params))[0]["w"]

  scheduled = optax.inject_hyperparams(jaxcomp.powersgd, static_args=static)(
      rank=1, start_iter=0, epsilon=lambda count: 2.0, axis_name=None)
  # Two programs: roundings along the 8-long products and norms of P and Q.
  np.testing.assert_allclose(first_step(scheduled),
                             first_step(jaxcomp.powersgd(1, start_iter=0, epsilon=2.0,
                                                         axis_name=None)), **rounding_tol(16))
  assert not np.allclose(first_step(scheduled),
                         first_step(jaxcomp.powersgd(1, start_iter=0, axis_name=None)))


# ---------------------------------------------------------------------------------------------------
# Batched PowerSGD.


@pytest.mark.parametrize("rank, warm_start", [(1, True), (3, False)])
def test_batched_matches_numpy_reference(rank, warm_start):
  params = {"a": np.zeros((7, 5), np.float32), "b": np.zeros(9, np.float32),
            "c": np.zeros((), np.float32), "i": np.zeros(2, np.int32)}
  tx = jaxcomp.batched_powersgd(rank, start_iter=1, warm_start=warm_start)
  state = replicate(tx.init(params), W)
  assert state.error[0].shape == (W, 7, 7) and state.q[0].shape == (W, 7, rank)  # L = 45, side 7
  step = pmapped(tx)
  rng = np.random.default_rng(0)
  errors = [0.0] * W
  tol = rounding_tol(4 * (7 + 7 + W))  # float32 against float64: as test_matches_numpy_reference
  for t in range(4):
    grads = grads_for(params, rng)
    q = np.asarray(state.q[0][0])
    out, state = run(step, grads, state)
    flat = [np.concatenate([np.ravel(grads[k][d]) for k in "abc"]) for d in range(W)]
    if t == 0:
      expected = np.mean(flat, axis=0)
    else:
      expected, errors, new_q = np_batched_step(flat, errors, q, rank=rank)
      if warm_start:
        np.testing.assert_allclose(state.q[0][0], new_q, **tol)
      for d in range(W):
        np.testing.assert_allclose(np.ravel(state.error[0][d]), errors[d], **tol)
    got = np.concatenate([np.ravel(out[k][0]) for k in "abc"])
    np.testing.assert_allclose(got, expected, **tol, err_msg=t)
    np.testing.assert_array_equal(out["i"], grads["i"])
  assert state.compression_stats()[1:] == (3 * 45, 3 * 2 * 7 * rank)


def test_batched_one_square_per_dtype():
  params = {"a": np.zeros((6, 6), np.float32), "h": np.zeros((5, 5), jnp.bfloat16)}
  state = jaxcomp.batched_powersgd(2).init(params)
  assert [e.shape for e in state.error] == [(6, 6), (5, 5)]
  assert [q.dtype for q in state.q] == [np.float32, jnp.bfloat16]


def test_batched_update_writes_the_error_in_place():
  """The square of the leaves is the update's only scratch of its size: M = g + e is never written
  (the products and the error take g and e as two terms), the new error is written over the old,
  and the output's P̂·Qᵀ reuses the square's memory (before: 2.0× the gradient)."""
  tx = jaxcomp.batched_powersgd(1, start_iter=0)
  # 12 leaves (XLA:CPU fuses a concatenation of at most 8), most starting and ending mid-row.
  one = {f"w{i}": jax.ShapeDtypeStruct((40 + i, 96 + 3 * i), jnp.float32) for i in range(12)}
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype),
                       jax.eval_shape(tx.init, one))
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype), one)
  step = jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:8], donate_argnums=(0, 1))
  grad_bytes = sum(4 * np.prod(x.shape) for x in jax.tree.leaves(one))
  temp = step.lower(grads, state).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.1 * grad_bytes


# ---------------------------------------------------------------------------------------------------
# Hooks: the same code on comm_hook buckets.


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005])
def test_powersgd_hook_equals_the_transformation(bucket_cap_mb):
  """The hook on DDP's buckets: the same factors at init (drawn from each leaf's path), the same
  outputs and per-leaf state at every step, torch's statistics."""
  params = params_mixed()
  kwargs = dict(start_iter=1, epsilon=1e-8)
  tx = jaxcomp.powersgd(2, **kwargs)
  hook_tx = jaxcomp.comm_hook(jaxcomp.hooks.powersgd_hook, jaxcomp.hooks.powersgd_state(2, **kwargs),
                              bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb)
  state, hook_state = tx.init(params), hook_tx.init(params)
  assert (len(hook_state.hook_states) > 1) == (bucket_cap_mb < 1)
  chex.assert_trees_all_equal(per_leaf(hook_state), per_leaf(state))
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped(tx), pmapped(hook_tx)
  rng = np.random.default_rng(0)
  # Two programs (buckets, or leaf by leaf): the sums of P, Q and W devices, 3 steps.
  tol = rounding_tol(3 * (20 + 12 + W))
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = run(step, grads, state)
    hook_out, hook_state = run(hook_step, grads, hook_state)
    chex.assert_trees_all_close(hook_out, out, **tol)
    chex.assert_trees_all_close(per_leaf(hook_state), per_leaf(state), **tol)
  assert jaxcomp.powersgd_stats(hook_state) == state.compression_stats()


def test_fp16_wrapped_powersgd_hook_runs_in_float16_as_torch():
  """fp16_compress_wrapper(powersgd_hook) = PowerSGD on the float16 gradient; float16 state values."""
  params = {"w": np.zeros((16, 12), np.float32), "b": np.zeros(12, np.float32)}
  hook_tx = jaxcomp.comm_hook(jaxcomp.fp16_compress_wrapper(jaxcomp.hooks.powersgd_hook),
                              jaxcomp.hooks.powersgd_state(1, start_iter=1))
  half = jax.tree.map(lambda x: x.astype(np.float16), params)
  tx = jaxcomp.powersgd(1, start_iter=1)
  hook_state = hook_tx.init(params)
  (bucket,) = hook_state.hook_states
  w = [isinstance(q, optax.MaskedNode) for q in bucket.q].index(False)  # w's place in the bucket
  state = tx.init(half)
  state = state._replace(q={"w": bucket.q[w].astype(np.float16), "b": optax.MaskedNode()})
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped(tx), pmapped(hook_tx)
  rng = np.random.default_rng(0)
  # Two programs computing in float16: a few float16 roundings of values up to ~4.
  tol = rounding_tol(4, scale=4, dtype=np.float16)
  for _ in range(4):
    grads = grads_for(params, rng)
    hook_out, hook_state = run(hook_step, grads, hook_state)
    out, state = run(step, jax.tree.map(lambda x: x.astype(np.float16), grads), state)
    chex.assert_trees_all_close(hook_out, jax.tree.map(lambda x: x.astype(np.float32), out), **tol)
  (bucket,) = hook_state.hook_states
  assert bucket.error[w].dtype == np.float32  # kept in the bucket's dtype, holding float16 values
  assert np.array_equal(bucket.error[w].astype(np.float16).astype(np.float32), bucket.error[w])
  np.testing.assert_allclose(bucket.error[w], state.error["w"].astype(np.float32), **tol)
  np.testing.assert_allclose(bucket.q[w], state.q["w"].astype(np.float32), **tol)


def test_batched_hook_equals_the_transformation():
  params = {"a": np.zeros((9, 7), np.float32), "b": np.zeros(7, np.float32)}
  hook_tx = jaxcomp.comm_hook(jaxcomp.hooks.batched_powersgd_hook,
                              jaxcomp.hooks.batched_powersgd_state(1, start_iter=1))
  hook_state = hook_tx.init(params)
  assert bucket_assignment(hook_state.signature, 25 * 2**20, 25 * 2**20) == ((1, 0),)
  # The bucket holds b, then a (DDP's reverse order): give the transformation that order too.
  as_bucket = lambda tree: {"0": tree["b"], "1": tree["a"]}
  tx = jaxcomp.batched_powersgd(1, start_iter=1)
  state = tx.init(as_bucket(params))
  chex.assert_trees_all_equal(hook_state.hook_states[0].q, state.q)  # same seed, same square
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped(tx), pmapped(hook_tx)
  rng = np.random.default_rng(0)
  tol = rounding_tol(3 * (9 + 9 + W))  # two programs: the sums of P, Q (side 9) and W, 3 steps
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = run(step, as_bucket(grads), state)
    hook_out, hook_state = run(hook_step, grads, hook_state)
    chex.assert_trees_all_close(as_bucket(hook_out), out, **tol)
  chex.assert_trees_all_close(hook_state.hook_states[0].error, state.error, **tol)
  assert jaxcomp.powersgd_stats(hook_state) == state.compression_stats()


# ---------------------------------------------------------------------------------------------------
# Checkpointing.


@pytest.mark.parametrize("make", [
    functools.partial(jaxcomp.powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.powersgd, 3, start_iter=1, warm_start=False),
    functools.partial(jaxcomp.batched_powersgd, 2, start_iter=1),
], ids=["layerwise", "fresh-q", "batched"])
def test_checkpoint_resume_is_bit_identical(make, tmp_path):
  params = params_mixed()
  tx = make()
  step = pmapped(tx)
  rng = np.random.default_rng(0)
  grads = [grads_for(params, rng) for _ in range(6)]
  state = replicate(tx.init(params), W)
  for g in grads[:3]:
    _, state = run(step, g, state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  chex.assert_trees_all_equal(restored, state)
  assert restored.config == state.config and restored.signature == state.signature
  for g in grads[3:]:
    out, state = run(step, g, state)
    resumed_out, restored = run(step, g, restored)
    chex.assert_trees_all_equal(resumed_out, out)
  chex.assert_trees_all_equal(restored, state)
