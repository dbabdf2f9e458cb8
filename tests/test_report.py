"""comm_report on real Flax training steps under pmap, shard_map and a partitioned jit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxcomp
import jaxcomp._src.phases
from jaxcomp._src.report import parse_hlo
from helpers import replicate

W = 8


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(10)(x)


MODEL = MLP()
PARAMS = MODEL.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
N_PARAMS = sum(x.size for x in jax.tree.leaves(PARAMS))
BATCH = (jnp.zeros((W, 4, 64)), jnp.zeros((W, 4), jnp.int32))


def loss_fn(params, x, y):
  logits = MODEL.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def pmap_train_step(tx):

  def step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.pmap(step, axis_name="batch")


def pmap_report(tx, **kwargs):
  tx = optax.chain(tx, optax.sgd(0.1))
  params, opt_state = replicate(PARAMS), replicate(tx.init(PARAMS))
  return jaxcomp.comm_report(pmap_train_step(tx), params, opt_state, *BATCH, **kwargs)


def test_allreduce_sends_four_bytes_per_parameter_and_fp16_exactly_half():
  dense = pmap_report(jaxcomp.allreduce())
  fp16 = pmap_report(jaxcomp.fp16_compress())
  assert dense.payload_bytes == 4 * N_PARAMS
  assert dense.bytes_by_dtype() == {"f32": 4 * N_PARAMS}
  assert fp16.payload_bytes * 2 == dense.payload_bytes
  assert fp16.bytes_by_dtype() == {"f16": 2 * N_PARAMS}
  assert all(c.op == "all-reduce" and c.group_size == W for c in dense.collectives)
  assert dense.ring_bytes == pytest.approx(2 * (W - 1) / W * 4 * N_PARAMS)
  assert "total" in str(dense) and "all-reduce" in str(dense)


def test_fp16_on_cpu_runs_as_all_to_all_and_all_gather_and_is_counted_as_the_all_reduce():
  """XLA:CPU gets the float16 sums as one all-to-all and one all-gather of all leaves
  (``axis.mean_leaves``); the report counts the pair as the all-reduce it stands for: the bytes per
  dtype, payload and ring bytes of the step lowered for a GPU, where an all-reduce per leaf runs
  (XLA combines them when it compiles)."""
  tx = optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1))
  step = shard_map_step(tx, pcast=True)
  args = (PARAMS, tx.init(PARAMS), *BATCH)
  compiled = step.lower(*args).compile().as_text()
  assert "all-to-all(" in compiled and "all-gather(" in compiled and "all-reduce(" not in compiled
  report = jaxcomp.comm_report(step, *args)
  gpu = parse_hlo(step.trace(*args).lower(lowering_platforms=("cuda",)).as_text(
      dialect="hlo", debug_info=True), W)
  assert "all-to-all" not in str(gpu) and not any(c.runs_as for c in gpu.collectives)
  assert {c.op for c in gpu.collectives} == {"all-reduce"} and len(gpu.collectives) > 1
  assert [(c.op, c.dtypes, c.shapes, c.runs_as) for c in report.collectives] == [
      ("all-reduce", ("f16",), ((N_PARAMS,),), ("all-to-all", "all-gather"))]
  assert report.bytes_by_dtype() == gpu.bytes_by_dtype() == {"f16": 2 * N_PARAMS}
  assert report.payload_bytes == gpu.payload_bytes
  assert report.ring_bytes == pytest.approx(gpu.ring_bytes)
  assert "run as all-to-all + all-gather" in str(report)


def test_bf16_is_checked_before_optimisation():
  lowered = pmap_report(jaxcomp.bf16_compress(), stage="lowered")
  assert lowered.bytes_by_dtype() == {"bf16": 2 * N_PARAMS}
  compiled = pmap_report(jaxcomp.bf16_compress())  # XLA:CPU widens bf16 collectives
  assert compiled.payload_bytes in (2 * N_PARAMS, 4 * N_PARAMS)


def shard_map_step(tx, pcast):
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))

  def step(params, opt_state, x, y):
    if pcast:  # the recipe: differentiate w.r.t. a varying copy, so autodiff inserts no psum
      grads = jax.grad(loss_fn)(lax.pcast(params, "batch", to="varying"), x[0], y[0])
    else:
      grads = jax.grad(loss_fn)(params, x[0], y[0])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")),
                               out_specs=(P(), P()), check_vma=True))


def test_shard_map_check_vma_the_pcast_recipe_sends_only_the_compressed_gradient():
  tx = optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1))
  report = jaxcomp.comm_report(shard_map_step(tx, pcast=True), PARAMS, tx.init(PARAMS), *BATCH)
  assert report.bytes_by_dtype() == {"f16": 2 * N_PARAMS}


def test_shard_map_check_vma_without_pcast_the_summed_gradient_is_refused():
  """Without the pcast, autodiff's transpose of the implicit pvary sums the gradient over the
  devices in float32 before the compressor: averaged again, the update would be W times too
  large."""
  tx = optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"fp16_compress: .*already the same on every device.*pcast"):
    jaxcomp.comm_report(shard_map_step(tx, pcast=False), PARAMS, tx.init(PARAMS), *BATCH)


def test_phases_are_reported_apart_and_the_totals_are_the_steady_state():
  """A warm-up branch and the steady branch never run on the same step: the totals are the steady
  state's, each phase reported on its own; a periodic phase counts with its share."""
  def step(x, count):
    warm = jaxcomp._src.phases.Phase("demo.warmup", 0.0)
    steady = jaxcomp._src.phases.Phase("demo.steady", 1.0)
    y = jaxcomp._src.phases.switch((count > 3).astype(jnp.int32), [warm, steady],
                                   [lambda v: lax.psum(v, "d"),
                                    lambda v: lax.psum(v.astype(jnp.float16), "d").astype(v.dtype)],
                                   x)
    sync = jaxcomp._src.phases.Phase("demo.sync", 0.25)
    return jaxcomp._src.phases.cond(count % 4 == 0, sync, lambda v: lax.pmax(v, "d"),
                                    lambda v: v, y), lax.psum(count, "d")

  f = jax.pmap(step, axis_name="d", devices=jax.devices()[:4])
  report = jaxcomp.comm_report(f, jnp.ones((4, 64)), jnp.ones(4, jnp.int32))
  assert set(report.phase_names) == {"demo.warmup", "demo.steady", "demo.sync"}
  assert report.every_step.payload_bytes == 4  # the int32 count
  assert report.phase("demo.warmup").payload_bytes == 4 + 4 * 64
  assert report.phase("demo.steady").payload_bytes == 4 + 2 * 64
  assert report.phase("demo.sync").payload_bytes == 4 + 4 * 64
  assert report.payload_bytes == 4 + 2 * 64 + 0.25 * 4 * 64
  assert report.bytes_by_dtype() == {"s32": 4, "f16": 2 * 64, "f32": 64}
  assert "demo.warmup (0)" in str(report) and "a step in demo.sync" in str(report)
  with pytest.raises(KeyError, match="demo.warmup, demo.steady"):
    report.phase("demo.cooldown")


def test_loops_conditionals_and_group_sizes_are_reported():
  mesh = jax.make_mesh((2, 4), ("model", "data"), axis_types=(AxisType.Auto,) * 2)

  def body(x, n):
    x = lax.cond(n[0] > 0, lambda: lax.psum(x, "data"), lambda: x)
    return lax.fori_loop(0, n[0], lambda i, v: v + lax.all_gather(v, "data")[0], x)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("model", "data"), P()),
                            out_specs=P("model", "data"), check_vma=False))
  report = jaxcomp.comm_report(f, jnp.zeros((2, 16)), jnp.ones((1,), jnp.int32))
  ops = {c.op: c for c in report.collectives}
  assert ops["all-reduce"].in_conditional and not ops["all-reduce"].in_loop
  assert ops["all-gather"].in_loop and not ops["all-gather"].in_conditional
  assert ops["all-reduce"].group_size == 4 and ops["all-gather"].group_size == 4
  assert ops["all-reduce"].payload_bytes == 4 * 4  # the local (1, 4) block
  assert ops["all-gather"].payload_bytes == 4 * 4 * 4  # four gathered (1, 4) blocks
  assert ops["all-gather"].ring_bytes == pytest.approx(3 / 4 * 64)


def test_partitioner_collectives_are_seen():
  mesh = jax.make_mesh((W,), ("d",), axis_types=(AxisType.Auto,))
  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "d")))
  w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("d", None)))
  report = jaxcomp.comm_report(jax.jit(lambda x, w: x @ w), x, w)
  assert any(c.op in ("all-reduce", "reduce-scatter") for c in report.collectives)
  assert report.payload_bytes >= 16 * 32 * 4


def test_bad_stage_is_named():
  with pytest.raises(ValueError, match="stage"):
    jaxcomp.comm_report(jax.jit(lambda x: x), jnp.ones(2), stage="optimised")


def test_parses_async_and_combined_collectives():
  text = """HloModule m
ENTRY %main (p: f32[8]) -> f32[64] {
  %ars = (f32[8]{0}, f16[4]{0}) all-reduce-start(%p, %q), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = (f32[8]{0}, f16[4]{0}) all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}
"""
  report = parse_hlo(text, default_group=8)
  assert [c.op for c in report.collectives] == ["all-reduce", "all-gather", "collective-permute"]
  assert report.collectives[0].payload_bytes == 32 + 8
  assert report.collectives[1].payload_bytes == 256
  assert report.collectives[2].group_size == 2 and report.collectives[2].ring_bytes == 32


def test_replica_groups_are_read_and_filed_under_the_mesh_axes_they_span():
  mesh = jax.make_mesh((2, 4), ("slow", "fast"), axis_types=(AxisType.Auto,) * 2)
  text = """HloModule m
ENTRY %main (p: f32[8]) -> f32[8] {
  %a = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
  %b = f32[2]{0} all-reduce(%p), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %c = f32[1]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %d = f32[4]{0} all-reduce(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}
"""
  report = parse_hlo(text, default_group=8)
  a, b, c, d = report.collectives
  assert a.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and a.group_size == 4
  assert b.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and b.group_size == 2
  assert c.group_size == 8
  by_axes = report.by_axes(mesh)
  assert {k: v.payload_bytes for k, v in by_axes.items()} == {
      ("fast",): 32, ("slow",): 8 + 16, ("slow", "fast"): 4}


def test_conditionals_and_phases_are_found_before_optimisation_too():
  sync = jaxcomp._src.phases.Phase("demo.sync", 0.5)
  f = jax.pmap(lambda x, n: jaxcomp._src.phases.cond(n > 0, sync, lambda v: lax.psum(v, "d"),
                                                     lambda v: v, x),
               axis_name="d", devices=jax.devices()[:2])
  report = jaxcomp.comm_report(f, jnp.ones((2, 3)), jnp.ones(2, jnp.int32), stage="lowered")
  assert [(c.in_conditional, c.phase, c.share) for c in report.collectives] == [
      (True, "demo.sync", 0.5)]


