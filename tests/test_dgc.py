"""Deep Gradient Compression against a NumPy reference written from the paper (Lin et al., ICLR 2018,
§3) and its reference code (synxlin/deep-gradient-compression), on real devices."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import hooks
from jaxcomp._src import dgc as dgc_module
from jaxcomp._src import dgc_config
from jaxcomp._src import topk
from jaxcomp._src import validate

from helpers import assert_identical_across_devices, replicate, rounding_tol

pytestmark = pytest.mark.numeric
W = 4


# ------------------------------------------------------------------------------ NumPy reference

def ref_sparsify(x, density, start, sample_ratio=0.01, upper=1.3, lower=0.8, iters=10):
  """The reference's _sparsify: strided sample threshold, adaptation, first k / top k among many."""
  n = x.size
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density, sample_ratio)
  importance = np.abs(x)
  samples = importance if plan.num_samples == n else importance[start::plan.stride]
  threshold = np.sort(samples)[::-1][plan.top_k_samples - 1]
  indices = np.nonzero(importance >= threshold)[0]
  if n > plan.num_samples:
    for _ in range(iters):
      if len(indices) > k:
        if len(indices) > k * upper:
          indices = indices[np.argsort(-importance[indices], kind="stable")[:k]]
        break
      if len(indices) < lower * k:
        threshold = np.float32(threshold * np.float32(lower))
      else:
        break
      indices = np.nonzero(importance >= threshold)[0]
  return indices[:k], threshold


class RefDGC:
  """DGCCompressor + DGCSGDMemory for W workers, exact top-k, with the dense-stage rule of jaxcomp."""

  def __init__(self, params, world, ratio, momentum=0.9, nesterov=False, masking=True,
               clip_norm=None, warmup=()):
    self.world, self.ratio, self.m, self.nesterov = world, ratio, momentum, nesterov
    self.masking, self.clip_norm, self.warmup, self.count = masking, clip_norm, warmup, 0
    params = {k: p for k, p in params.items() if p.dtype == np.float32}
    self.sparse = {k: np.ndim(p) > 1 for k, p in params.items()}
    self.u = [{k: np.zeros_like(p) for k, p in params.items() if self.sparse[k]} for _ in range(world)]
    self.v = [{k: np.zeros_like(p) for k, p in params.items() if self.sparse[k]} for _ in range(world)]
    self.dense_u = {k: np.zeros_like(p) for k, p in params.items() if not self.sparse[k]}

  def momentum(self, u, g):
    if self.nesterov:
      u = np.float32(self.m) * (u + g)
      return u, u + g
    u = np.float32(self.m) * u + g
    return u, u

  def step(self, grads):  # grads: list over workers of dicts
    density = self.ratio
    for end, d in reversed(self.warmup):
      if self.count < end:
        density = d
    if self.clip_norm is not None:
      limit = self.clip_norm * self.world ** -0.5
      clipped = []
      for g in grads:
        norm = np.sqrt(sum(np.sum(np.square(x)) for x in g.values()))
        clipped.append({k: x * np.float32(min(1.0, limit / (norm + 1e-6))) for k, x in g.items()})
      grads = clipped
    out = {}
    for key in grads[0]:
      if not self.sparse[key]:
        mean = sum(g[key] / np.float32(self.world) for g in grads)
        self.dense_u[key], out[key] = self.momentum(self.dense_u[key], mean)
        continue
      n = grads[0][key].size
      k = math.ceil(n * density)
      dense = self.world * k * 8 >= n * 4
      total = np.zeros(n, np.float32)
      for w in range(self.world):
        self.u[w][key], step = self.momentum(self.u[w][key], grads[w][key])
        self.v[w][key] = self.v[w][key] + step
        flat = self.v[w][key].reshape(-1)
        if dense:
          total += flat / np.float32(self.world)
          self.v[w][key] = np.zeros_like(self.v[w][key])
          continue
        sent = np.argsort(-np.abs(flat), kind="stable")[:k]
        np.add.at(total, sent, flat[sent])
        self.v[w][key] = _zero_at(self.v[w][key], sent)
        if self.masking:
          self.u[w][key] = _zero_at(self.u[w][key], sent)
      out[key] = (total if dense else total * np.float32(1 / self.world)).reshape(grads[0][key].shape)
    self.count += 1
    return out


def _zero_at(x, indices):
  flat = x.reshape(-1).copy()
  flat[indices] = 0
  return flat.reshape(x.shape)


# ------------------------------------------------------------------------------ helpers

def make_params():
  return {"w1": np.zeros((16, 32), np.float32), "b1": np.zeros((32,), np.float32),
          "w2": np.zeros((32, 8), np.float32), "t": np.zeros((), np.float32),
          "steps": np.zeros((3,), np.int32)}


def device_grads(rng, params, world):
  return {k: (rng.standard_normal((world,) + p.shape).astype(np.float32)
              if p.dtype == np.float32 else np.stack([p] * world)) for k, p in params.items()}


def pmapped_update(tx, world):
  return jax.pmap(lambda g, s: tx.update(g, s), axis_name="batch",
                  devices=jax.devices()[:world])


def run_against_reference(tx, ref, steps, world=W, seed=0):
  # NumPy's float32 order against XLA's: per step the momentum, v and the sum over the devices each
  # round; unit-scale gradients (v, which keeps what was not sent, grows to ~20: rtol covers that).
  tol = rounding_tol(steps * (world + 3))
  params = make_params()
  rng = np.random.default_rng(seed)
  state = replicate(tx.init(params), world)
  update = pmapped_update(tx, world)
  for _ in range(steps):
    grads = device_grads(rng, params, world)
    out, state = jax.block_until_ready(update(grads, state))
    expected = ref.step([{k: grads[k][w] for k in grads if k != "steps"} for w in range(world)])
    assert_identical_across_devices(out)
    np.testing.assert_array_equal(out["steps"], grads["steps"])
    for key, value in expected.items():
      np.testing.assert_allclose(out[key][0], value, **tol, err_msg=key)
    for w in range(world):
      for key in ref.u[w]:
        np.testing.assert_allclose(state.u[key][w], ref.u[w][key], **tol)
        np.testing.assert_allclose(state.v[key][w], ref.v[w][key], **tol)
    for key in ref.dense_u:
      np.testing.assert_allclose(state.dense_u[key][0], ref.dense_u[key], **tol)
  return state


# ------------------------------------------------------------------------------ the algorithm

@pytest.mark.parametrize("nesterov,masking,clip_norm", [(False, True, None), (True, False, 20.0)])
def test_exact_mode_matches_numpy_reference_step_for_step(nesterov, masking, clip_norm):
  tx = jaxcomp.dgc(0.05, selection="exact", nesterov=nesterov, momentum_masking=masking,
                   clip_norm=clip_norm)
  ref = RefDGC(make_params(), W, 0.05, nesterov=nesterov, masking=masking, clip_norm=clip_norm)
  state = run_against_reference(tx, ref, steps=25)
  assert int(state.count[0]) == 25


def test_warmup_with_a_dense_stage_matches_reference():
  # W = 4: density 0.25 sends more than a dense all-reduce (4·0.25·2 = 2 >= 1), 0.1 does not.
  warmup = ((4, 0.25), (8, 0.1))
  tx = jaxcomp.dgc(0.05, selection="exact", warmup=warmup)
  ref = RefDGC(make_params(), W, 0.05, warmup=warmup)
  run_against_reference(tx, ref, steps=12, seed=1)


def test_coarse_dgc_matches_numpy_reference():
  world, chunk, ratio, m = W, 16, 0.25, 0.9
  tx = jaxcomp.coarse_dgc(ratio, chunk_size=chunk)
  params = make_params()
  rng = np.random.default_rng(2)
  state = replicate(tx.init(params), world)
  update = pmapped_update(tx, world)
  u = [{k: np.zeros_like(params[k]) for k in ("w1", "w2")} for _ in range(world)]
  v = [{k: np.zeros_like(params[k]) for k in ("w1", "w2")} for _ in range(world)]
  steps = 10
  tol = rounding_tol(steps * (world + 3))  # as in run_against_reference
  for _ in range(steps):
    grads = device_grads(rng, params, world)
    out, state = jax.block_until_ready(update(grads, state))
    assert_identical_across_devices(out)
    for key in ("w1", "w2"):
      n = params[key].size
      chunks = []
      for w in range(world):
        u[w][key] = np.float32(m) * u[w][key] + grads[key][w]
        v[w][key] = v[w][key] + u[w][key]
        chunks.append(v[w][key].reshape(-1, chunk))
      norms = sum(np.abs(c).sum(1) for c in chunks)
      chosen = np.argsort(-norms, kind="stable")[:math.ceil(n // chunk * ratio)]
      expected = np.zeros((n // chunk, chunk), np.float32)
      expected[chosen] = sum(c[chosen] / np.float32(world) for c in chunks)
      for w in range(world):
        v[w][key] = _zero_at(v[w][key], (chosen[:, None] * chunk + np.arange(chunk)).ravel())
        u[w][key] = _zero_at(u[w][key], (chosen[:, None] * chunk + np.arange(chunk)).ravel())
        np.testing.assert_allclose(state.u[key][w], u[w][key], **tol)
        np.testing.assert_allclose(state.v[key][w], v[w][key], **tol)
      np.testing.assert_allclose(out[key][0], expected.reshape(params[key].shape), **tol)


@pytest.mark.parametrize("dist", ["gaussian", "heavy_tailed"])
def test_sampled_selection_matches_reference_and_stays_in_band(dist):
  n, density = 200_003, 0.001
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density)
  assert plan.num_samples < n  # the sampled path, not the exact one
  select = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key))
  rng = np.random.default_rng(3)
  for trial in range(12):
    x = (rng.standard_normal(n) if dist == "gaussian" else rng.standard_t(1.5, n)).astype(np.float32)
    key = jax.random.PRNGKey(trial)
    indices, threshold, finite = select(x, key)
    assert bool(finite)
    indices = np.asarray(indices)
    sent = indices[indices < n]
    start = int(jax.random.randint(key, (), 0, plan.stride))
    ref_indices, ref_threshold = ref_sparsify(x, density, start)
    assert float(threshold) == float(ref_threshold)
    np.testing.assert_array_equal(np.sort(sent), np.sort(ref_indices))
    assert len(sent) <= k and len(set(sent.tolist())) == len(sent)
    assert np.all(np.abs(x[sent]) >= threshold)
    assert 0.8 * k <= len(sent) <= k
    assert np.all(indices[len(sent):] == n)  # empty slots hold the out-of-range sentinel


def test_sampled_selection_resamples_and_handles_ties():
  n, density = 100_000, 0.001
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density)
  select = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key))
  rng = np.random.default_rng(4)
  # Half the entries tie at the top: far more than the candidate buffer, exact top-k fallback.
  x = np.where(rng.random(n) < 0.5, 1.0, rng.random(n) * 0.1).astype(np.float32)
  indices, threshold, _ = select(x, jax.random.PRNGKey(0))
  assert float(threshold) == 1.0 and np.all(np.asarray(indices) < n)
  assert np.all(x[np.asarray(indices)] == 1.0) and len(set(np.asarray(indices).tolist())) == k
  # A zero gradient: threshold 0, every entry a candidate, k distinct zeros sent.
  indices, threshold, _ = select(np.zeros(n, np.float32), jax.random.PRNGKey(0))
  assert float(threshold) == 0.0 and len(set(np.asarray(indices).tolist())) == k


def test_sampled_mode_never_sends_more_than_k_under_pmap():
  params = {"w": np.zeros((300, 200), np.float32), "b": np.zeros((200,), np.float32)}
  tx = jaxcomp.dgc(0.001)
  k = 60  # ceil(300 * 200 * 0.001)
  state = replicate(tx.init(params), W)
  update = pmapped_update(tx, W)
  rng = np.random.default_rng(5)
  for _ in range(5):
    grads = {key: rng.standard_normal((W,) + p.shape).astype(np.float32) for key, p in params.items()}
    before = np.asarray(state.v["w"]) + 0  # v after this step's accumulation is v + u
    out, new_state = jax.block_until_ready(update(grads, state))
    assert_identical_across_devices(out)
    accumulated = before + 0.9 * np.asarray(state.u["w"]) + grads["w"]
    for w in range(W):
      sent = np.flatnonzero((np.asarray(new_state.v["w"][w]) == 0) & (accumulated[w] != 0))
      assert 0.8 * k <= len(sent) <= k
    assert np.count_nonzero(out["w"][0]) <= W * k
    state = new_state


# ------------------------------------------------------------------------------ bytes on the wire

def _step_report(tx, params, world):
  state = replicate(tx.init(params), world)
  grads = jax.tree.map(lambda p: np.zeros((world,) + p.shape, p.dtype), params)
  return jaxcomp.comm_report(pmapped_update(tx, world), grads, state)


def _bytes(report, op, dtype):
  total = 0
  for c in report.collectives:
    if c.op == op:
      scale = c.payload_bytes / max(sum(math.prod(s) * np.dtype(_np(d)).itemsize
                                        for d, s in zip(c.dtypes, c.shapes)), 1)
      total += sum(math.prod(s) * np.dtype(_np(d)).itemsize * scale
                   for d, s in zip(c.dtypes, c.shapes) if d == dtype)
  return int(total)


def _np(hlo_dtype):
  return {"f32": np.float32, "f16": np.float16, "s32": np.int32, "pred": np.bool_}[hlo_dtype]


BYTES_PARAMS = {"w": np.zeros((256, 64), np.float32), "v": np.zeros((40, 50), np.float32),
                "b": np.zeros((64,), np.float32)}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_comm_report_dgc_sends_k_values_and_indices_per_leaf(world):
  ratio = 0.01
  report = _step_report(jaxcomp.dgc(ratio), BYTES_PARAMS, world)
  ks = [math.ceil(16384 * ratio), math.ceil(2000 * ratio)]
  assert _bytes(report, "all-gather", "f32") == sum(world * k * 4 for k in ks)
  assert _bytes(report, "all-gather", "s32") == sum(world * k * 4 for k in ks)
  assert _bytes(report, "all-reduce", "f32") == 64 * 4  # the 1-D leaf only
  assert _bytes(report, "all-reduce", "s32") == 0  # no non-finite flag: the values carry it
  # Without warm-up the step has one phase, the final density; nothing runs outside it.
  assert report.phase_names == ("dgc.density=0.01",)
  assert report.every_step.collectives == ()


def test_comm_report_dgc_fp16_values():
  report = _step_report(jaxcomp.dgc(0.01, value_dtype=jnp.float16), BYTES_PARAMS, 4)
  ks = [164, 20]
  assert _bytes(report, "all-gather", "f16") == sum(4 * k * 2 for k in ks)
  assert _bytes(report, "all-gather", "s32") == sum(4 * k * 4 for k in ks)
  assert _bytes(report, "all-reduce", "f16") == 64 * 2


def test_comm_report_warmup_stages_are_phases_and_dense_ones_send_the_mean():
  # W = 8: 0.25 and 0.0625 send at least a dense all-reduce (8·0.0625·2 = 1), 0.015625 does not.
  tx = jaxcomp.dgc(0.001, warmup="paper", steps_per_epoch=10)
  report = _step_report(tx, {"w": np.zeros((256, 64), np.float32)}, 8)
  densities = jaxcomp.PAPER_WARMUP + (0.001,)
  assert report.phase_names == tuple(f"dgc.density={d:g}" for d in densities)
  for density in densities:
    phase = report.phase(f"dgc.density={density:g}")
    k = math.ceil(16384 * density)
    if density >= 0.0625:  # the dense mean of v
      assert _bytes(phase, "all-reduce", "f32") == 16384 * 4
      assert _bytes(phase, "all-gather", "f32") == 0
    else:
      assert _bytes(phase, "all-gather", "f32") == _bytes(phase, "all-gather", "s32") == 8 * k * 4
      assert _bytes(phase, "all-reduce", "f32") == 0
    assert _bytes(phase, "all-reduce", "s32") == 0  # no flag
  # Totals are per step of the steady state: the final density's exchange alone.
  assert report.payload_bytes == 2 * 8 * math.ceil(16384 * 0.001) * 4


@pytest.mark.parametrize("world", [2, 4, 8])
def test_comm_report_coarse_dgc_bytes_do_not_grow_with_world(world):
  report = _step_report(jaxcomp.coarse_dgc(0.05, chunk_size=256), BYTES_PARAMS, world)
  assert not any(c.op == "all-gather" for c in report.collectives)
  # w: 64 chunks -> 64 norms + 4 chunks; v: 8 chunks -> 8 norms + 1 chunk; b dense; no flag.
  expected = (64 + 4 * 256) * 4 + (8 + 256) * 4 + 64 * 4
  assert _bytes(report, "all-reduce", "f32") == expected
  assert report.payload_bytes == expected


# ------------------------------------------------------------------------------ state and plumbing

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


def test_world_size_one_under_plain_jit():
  tx = optax.chain(jaxcomp.dgc(0.05, axis_name=None, selection="exact"), optax.sgd(0.1))
  params = make_params()
  state = tx.init(params)
  grads = {k: (np.full(p.shape, 0.5, np.float32) if p.dtype == np.float32 else p)
           for k, p in params.items()}
  grads["w1"][3, 4] = 9.0
  # The state donated, as in a training step: u and v must not share a buffer.
  out, _ = jax.jit(tx.update, donate_argnums=1)(grads, state)
  assert float(out["w1"][3, 4]) == pytest.approx(-0.9)
  assert np.count_nonzero(out["w1"]) == math.ceil(512 * 0.05)
  np.testing.assert_allclose(out["b1"], -0.05)


def test_shard_map_matches_pmap():
  params = {"w": np.zeros((32, 16), np.float32), "b": np.zeros((16,), np.float32)}
  tx = jaxcomp.dgc(0.05)
  rng = np.random.default_rng(8)
  grads = {k: rng.standard_normal((W,) + p.shape).astype(np.float32) for k, p in params.items()}
  state = replicate(tx.init(params), W)
  expected, expected_state = jax.block_until_ready(pmapped_update(tx, W)(grads, state))
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:W])
  specs = jaxcomp.state_partition_specs(tx, params)
  flat_state = tx.init(params)
  flat_state = flat_state._replace(
      u=jax.tree.map(lambda x: np.concatenate(list(state.u["w"])), flat_state.u),
      v=jax.tree.map(lambda x: np.concatenate(list(state.v["w"])), flat_state.v))
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=(P("batch"), specs), out_specs=(P(), specs),
                               check_vma=False))
  out, new_state = jax.block_until_ready(step(grads, flat_state))
  tol = rounding_tol(W + 3)  # two programs, one step: the momentum, v and the sum over W round
  chex.assert_trees_all_close(out, jax.tree.map(lambda x: x[0], expected), **tol)
  np.testing.assert_allclose(new_state.v["w"], np.concatenate(list(expected_state.v["w"])), **tol)


def regression_loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# Two warm-up steps at density 0.25 (for dgc a dense stage: W·0.25·2 >= 1), then sparse ones.
DATA_PARALLEL_CASES = {
    "dgc": lambda: jaxcomp.dgc(0.05, warmup=((2, 0.25),)),
    "dgc_exact": lambda: jaxcomp.dgc(0.05, selection="exact", warmup=((2, 0.25),)),
    "coarse_dgc": lambda: jaxcomp.coarse_dgc(0.125, chunk_size=8, warmup=((2, 0.25),)),
    "dgc_hook": lambda: jaxcomp.comm_hook(hooks.dgc_hook, hooks.dgc_state(0.05, warmup=((2, 0.25),)),
                                          bucket_cap_mb=1e-4),
}


@pytest.mark.parametrize("name", list(DATA_PARALLEL_CASES))
def test_data_parallel_keeps_replicas_identical_and_matches_pmap(name):
  """The mean of every DGC variant is typed invariant under shard_map(check_vma=True), so
  data_parallel accepts the parameters it updates as replicated; they equal pmap's."""
  make = lambda: optax.chain(optax.add_decayed_weights(1e-4), DATA_PARALLEL_CASES[name](),
                             optax.sgd(0.1))
  params = {"w": np.zeros((16, 8), np.float32), "b": np.zeros((8,), np.float32)}
  rng = np.random.default_rng(13)
  xs = rng.standard_normal((3, W, 2, 16)).astype(np.float32)
  ys = rng.standard_normal((3, W, 2, 8)).astype(np.float32)
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(regression_loss, mesh, tx=make())
  p, s = dp.make_params(params), dp.make_state(params)
  for x, y in zip(xs, ys):
    p, s, _ = jax.block_until_ready(dp.step(p, s, *dp.shard((x.reshape(2 * W, 16),
                                                              y.reshape(2 * W, 8)))))
  for leaf in jax.tree.leaves(p):
    assert_identical_across_devices(np.stack([np.asarray(x.data) for x in leaf.addressable_shards]))

  tx = make()

  def pmap_step(params, state, x, y):
    updates, state = tx.update(jax.grad(regression_loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(pmap_step, axis_name="batch", devices=jax.devices()[:W])
  ref, ref_state = replicate(params, W), replicate(tx.init(params), W)
  for x, y in zip(xs, ys):
    ref, ref_state = jax.block_until_ready(step(ref, ref_state, x, y))
  # Two programs: per step the 16-term products, the 2-sample mean, momentum, v, the sum over W.
  chex.assert_trees_all_close(p, jax.tree.map(lambda a: a[0], ref),
                              **rounding_tol(3 * (16 + 2 + 3 + W)))


@pytest.mark.slow  # 20 s on the loaded 2-core machine (compiling DGC under vmap and pmap)
def test_vmap_with_an_axis_name_matches_pmap():
  tx = jaxcomp.dgc(0.05)
  params = make_params()
  grads = device_grads(np.random.default_rng(14), params, W)
  state = replicate(tx.init(params), W)
  out, new_state = jax.block_until_ready(jax.vmap(tx.update, axis_name="batch")(grads, state))
  expected, expected_state = jax.block_until_ready(pmapped_update(tx, W)(grads, state))
  assert_identical_across_devices(out)
  tol = rounding_tol(W + 3)  # two programs, one step: the momentum, v and the sum over W round
  chex.assert_trees_all_close((out, new_state.v), (expected, expected_state.v), **tol)


def test_phases_are_the_densities_warm_up_first():
  # A density repeated, or equal to ratio, is one phase: the report counts each once.
  config = dgc_config.config(dgc_config.TopKExchange, 0.01,
                            warmup=((2, 0.25), (4, 0.01), (6, 0.25)))
  assert [(p.name, p.share, p.value) for p in config.phases()] == [
      ("dgc.density=0.25", 0.0, 0.25), ("dgc.density=0.01", 1.0, 0.01)]
  assert [int(config.phase_of(jnp.int32(c))) for c in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_bad_arguments_name_the_argument():
  for kwargs, name in [(dict(ratio=0), "ratio"), (dict(ratio=1.5), "ratio"),
                       (dict(momentum=1.0), "momentum"), (dict(selection="approx"), "selection"),
                       (dict(warmup="fast"), "warmup"), (dict(warmup="paper"), "steps_per_epoch"),
                       (dict(warmup=((5, 0.1), (3, 0.01))), "warmup"),
                       (dict(warmup=((5, 2.0),)), "warmup density"),
                       (dict(sample_ratio=0), "sample_ratio"), (dict(clip_norm=-1.0), "clip_norm"),
                       (dict(value_dtype=jnp.int8), "value_dtype"),
                       (dict(nesterov=True, momentum=0.0), "nesterov")]:
    with pytest.raises(ValueError, match=name):
      jaxcomp.dgc(**kwargs)
  with pytest.raises(ValueError, match="chunk_size"):
    jaxcomp.coarse_dgc(chunk_size=0)
  with pytest.raises(TypeError, match="axis_name"):
    jaxcomp.dgc(axis_name=3)


def test_selection_benchmark_runs_quick(capsys):
  from benchmarks import dgc_selection as benchmark
  assert benchmark.main(["--quick"]) == 0
  assert "speed-up of sampled over exact" in capsys.readouterr().out


# ------------------------------------------------------------------------------ schedules, buckets

def test_static_hyperparameters_are_refused_when_traced():
  params = make_params()
  # Every static setting given as an array, in one error.
  with pytest.raises(TypeError, match=r"coarse_dgc: ratio, chunk_size are static .* "
                     r"static_args=\('ratio', 'chunk_size'\); only momentum, clip_norm, "
                     r"clip_exponent may be scheduled"):
    optax.inject_hyperparams(jaxcomp.coarse_dgc)(ratio=0.1, chunk_size=8).init(params)
  with pytest.raises(TypeError, match=r"dgc: ratio is static .*static_args=\('ratio',\)"):
    optax.inject_hyperparams(jaxcomp.dgc)(ratio=0.01).init(params)
  tx = optax.inject_hyperparams(jaxcomp.dgc, static_args=("ratio",))(ratio=0.01, momentum=0.9,
                                                                     axis_name=None)
  out, state = jax.jit(tx.update)({k: np.ones_like(p) for k, p in params.items()}, tx.init(params))
  assert set(state.hyperparams) == {"momentum", "clip_exponent"}  # the rest stays static
  chex.assert_tree_all_finite(out)
  with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\); got 1.5"):
    optax.inject_hyperparams(jaxcomp.dgc, static_args=("ratio",))(ratio=0.01,
                                                                   momentum=1.5).init(params)


@pytest.mark.parametrize("coarse", [False, True])
def test_traced_momentum_and_clip_norm_from_inject_hyperparams(coarse):
  """momentum and clip_norm are traced under optax.inject_hyperparams (ratio stays static); each step
  uses the value in the state's hyperparams, as optax's own transformations do."""
  factory = jaxcomp.coarse_dgc if coarse else functools.partial(jaxcomp.dgc, selection="exact")
  ratio = 0.25 if coarse else 0.05
  extra = dict(chunk_size=8) if coarse else {}
  injected = optax.inject_hyperparams(factory, static_args=("ratio",) + tuple(extra))(
      ratio=ratio, momentum=0.9, clip_norm=20.0, **extra)
  params = make_params()
  state = replicate(injected.init(params), W)
  assert state.inner_state.config.momentum is validate.TRACED
  update = pmapped_update(injected, W)
  rng = np.random.default_rng(11)
  for momentum in (0.9, 0.9, 0.5):
    reference = factory(ratio, momentum=momentum, clip_norm=20.0, **extra)
    ref_state = state.inner_state._replace(config=reference.init(params).config)
    state = state._replace(hyperparams={**state.hyperparams,
                                        "momentum": np.full(W, momentum, np.float32)})
    grads = device_grads(rng, params, W)
    out, state = jax.block_until_ready(update(grads, state))
    ref_out, ref_state = jax.block_until_ready(pmapped_update(reference, W)(grads, ref_state))
    chex.assert_trees_all_close(out, ref_out, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close((state.inner_state.u, state.inner_state.v),
                                (ref_state.u, ref_state.v), rtol=1e-6, atol=1e-6)


def momenta(state):
  """``{path: (u, v, dense_u)}`` of a ``DGCState``, or of the per-bucket ones of a bucketed state."""
  states = getattr(state, "hook_states", (state,))
  return {s.signature.paths[i]: leaves for s in states
          for i, leaves in zip(s.signature.reduced,
                               zip(*(s.signature.pick(t) for t in (s.u, s.v, s.dense_u))))}


# Sampled selection too: a leaf's sampling key comes from its path, the same in a bucket.
@pytest.mark.parametrize("factory", [functools.partial(jaxcomp.dgc, 0.05, selection="exact"),
                                     functools.partial(jaxcomp.dgc, 0.05),
                                     functools.partial(jaxcomp.coarse_dgc, 0.25, chunk_size=8)],
                         ids=["exact", "sampled", "coarse"])
def test_bucketed_dgc_gives_the_same_step(factory):
  params = {f"l{i}": {"kernel": np.zeros((24, 16), np.float32), "bias": np.zeros(16, np.float32)}
            for i in range(3)}
  txs = [factory(), factory(bucket_cap_mb=1e-3)]
  states = [replicate(tx.init(params), W) for tx in txs]
  updates = [pmapped_update(tx, W) for tx in txs]
  rng = np.random.default_rng(12)
  for _ in range(3):
    grads = {k: {n: rng.standard_normal((W,) + p.shape).astype(np.float32) for n, p in v.items()}
             for k, v in params.items()}
    (a, states[0]), (b, states[1]) = [jax.block_until_ready(f(grads, s))
                                      for f, s in zip(updates, states)]
    chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(states[1].hook_states) > 1  # one DGCState per bucket, each with its own count
    assert all(int(s.count[0]) == int(states[0].count[0]) for s in states[1].hook_states)
    whole, bucketed = momenta(states[0]), momenta(states[1])
    assert set(whole) == set(bucketed) and len(whole) == 6
    chex.assert_trees_all_close(whole, bucketed, rtol=1e-6, atol=1e-6)
  bad = jax.tree.map(np.copy, grads)
  bad["l1"]["kernel"][1, 2, 3] = np.inf
  out, kept = jax.block_until_ready(updates[1](bad, states[1]))
  chex.assert_trees_all_equal(kept, states[1])
  assert all(np.isnan(x).all() for x in jax.tree.leaves(out))


def test_clip_norm_is_refused_bucket_by_bucket():
  for make in (lambda: jaxcomp.dgc(0.01, clip_norm=1.0, bucket_cap_mb=1.0),
               lambda: jaxcomp.coarse_dgc(0.01, clip_norm=1.0, bucket_cap_mb=1.0),
               lambda: hooks.dgc_state(0.01, clip_norm=1.0)):
    with pytest.raises(ValueError, match=r"local clipping \(clip_norm\) needs the whole "
                       r"gradient's norm, which a bucket does not see"):
      make()
