"""``jaxcomp.sharded_optimizer`` (sharded optimizer state, ZeRO-1/2) under
``jaxcomp.data_parallel``: with exact exchanges it trains as ``optax.chain(exchange, optimizer)``
does at W = 1, 2, 4, 8 with leaf sizes no W divides, while each device keeps 1/W of the optimizer
state; it sends a reduce-scatter and an all-gather (in 16 bits where asked); a lossy gather keeps an
exact master the parameters follow; it works on a (data, model) mesh and through an orbax
checkpoint; and it refuses every optimizer that would compute something else on a shard than on
the whole leaf."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp._src import compressor, dense, shards
from helpers import rounding_tol

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

STEPS = 3


def init_params(hidden=7):
  """Leaf sizes 35, 7, 21 and 1 (hidden = 7): none is a multiple of 2, 4 or 8."""
  rng = np.random.default_rng(0)
  return {"w1": rng.normal(size=(5, hidden)).astype(np.float32),
          "b1": np.zeros(hidden, np.float32),
          "w2": rng.normal(size=(hidden, 3)).astype(np.float32),
          "scale": np.float32(1.5)}


def loss_fn(params, x, y):
  hidden = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] * params["scale"] - y) ** 2)


def batches(n=STEPS, rows=16, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(rows, 5)).astype(np.float32),
           rng.normal(size=(rows, 3)).astype(np.float32)) for _ in range(n)]


def mesh_1d(n, kind=AxisType.Auto):
  return jax.make_mesh((n,), ("batch",), axis_types=(kind,), devices=jax.devices()[:n])


def train(tx, mesh, data, params=None, axis_name="batch"):
  """``data`` steps of ``data_parallel``; returns (params, opt_state, the DataParallel)."""
  dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name=axis_name, tx=tx)
  params = init_params() if params is None else params
  opt_state = dp.make_state(params)
  for batch in data:
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard(batch))
    jax.block_until_ready(loss)  # XLA:CPU needs a value every step with 4-8 devices
  return params, opt_state, dp


def sgd_momentum_and_adamw():
  """SGD with momentum on two leaves, AdamW on the other two: both optimizers in one program."""
  labels = {"w1": "adamw", "b1": "sgd", "w2": "sgd", "scale": "adamw"}
  return optax.multi_transform({"sgd": optax.sgd(0.1, momentum=0.9),
                                "adamw": optax.adamw(0.05, weight_decay=0.1)}, labels)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_exact_exchanges_train_as_the_unsharded_chain_with_1_over_w_of_the_state(world):
  mesh, data = mesh_1d(world), batches()
  ref, ref_state, _ = train(optax.chain(jaxcomp.allreduce(), sgd_momentum_and_adamw()), mesh, data)
  got, state, _ = train(jaxcomp.sharded_optimizer(jaxcomp.allreduce(), sgd_momentum_and_adamw()),
                        mesh, data)
  # The mean is summed in another order (reduce-scatter against all-reduce): W terms a step.
  tol = rounding_tol(8 * world * STEPS)
  chex.assert_trees_all_close(got, ref, **tol)
  assert not np.allclose(got["w1"], init_params()["w1"])  # it trained
  # Every leaf of both optimizers' states (momentum; AdamW's mu and nu): W shards of ⌈n/W⌉
  # values, one per device, stacked along the data axis; its global array is the leaf, padded.
  moments = jax.tree.leaves(state.inner)
  full = jax.tree.leaves(ref_state)
  assert len(moments) == len(full) == 1 + 2 + 2 * 2  # AdamW's count, 2 traces, 2·2 moments
  for got_leaf, ref_leaf in zip(moments, full):
    if ref_leaf.ndim == 0 and ref_leaf.dtype == np.int32:  # a step count
      continue
    per_device = got_leaf.addressable_shards[0].data
    assert got_leaf.shape[0] == world and (world == 1 or got_leaf.sharding.spec[0] == "batch")
    assert per_device.size == -(-ref_leaf.size // world), (got_leaf.shape, ref_leaf.shape)
    assert per_device.ndim == ref_leaf.ndim + 1  # a shard keeps the leaf's rank
    np.testing.assert_allclose(shards.Layout(world).join(np.asarray(got_leaf), ref_leaf.shape),
                               ref_leaf, **tol)


@pytest.mark.parametrize("optimizer", [lambda: optax.adam(0.05), lambda: optax.adamw(0.05),
                                       lambda: optax.sgd(0.1, momentum=0.9),
                                       lambda: optax.lion(0.01)])
def test_a_0d_parameter_trains_as_the_unsharded_chain_with_adaptive_optimizers(optimizer):
  # Device 0 owns the 0-d leaf's value; every other device's shard of it is padding.
  params = {"w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8), "s": np.float32(0.5)}
  loss = lambda p, x, y: jnp.mean(((x[:, :3] @ p["w"])[:, :3] * p["s"] - y) ** 2)  # noqa: E731
  data = batches()
  mesh = mesh_1d(8)
  runs = []
  for tx in (optax.chain(jaxcomp.allreduce(), optimizer()),
             jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optimizer())):
    dp = jaxcomp.data_parallel(loss, mesh, tx=tx)
    p, state = params, dp.make_state(params)
    for batch in data:
      p, state, value = dp.step(p, state, *dp.shard(batch))
      jax.block_until_ready(value)
    runs.append(p)
  assert not np.allclose(runs[1]["s"], params["s"])  # it trained
  chex.assert_trees_all_close(runs[1], runs[0], **rounding_tol(16, 1.0))


def test_comm_report_shows_a_reduce_scatter_and_an_all_gather_in_the_wire_dtypes():
  mesh, (batch,) = mesh_1d(8), batches(1)
  params = init_params()
  padded = sum(8 * -(-np.size(x) // 8) for x in jax.tree.leaves(params))  # 40 + 8 + 24 + 8

  def report(tx, stage="compiled"):
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    return jaxcomp.comm_report(dp.step, params, dp.make_state(params), *dp.shard(batch),
                               stage=stage)

  f32 = report(jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adamw(0.1)))
  assert [c.op for c in f32.collectives] == ["reduce-scatter", "all-gather"]
  assert f32.bytes_by_dtype() == {"f32": 2 * 4 * padded}
  # float16 both ways: half the bytes, narrow in the compiled program too.
  f16 = report(jaxcomp.sharded_optimizer(jaxcomp.fp16_compress(), optax.adamw(0.1),
                                         gather_dtype="float16"))
  assert [c.op for c in f16.collectives] == ["reduce-scatter", "all-gather"]
  assert f16.bytes_by_dtype() == {"f16": 2 * 2 * padded}
  # bfloat16: XLA:CPU widens it when compiling; the requested program sends bf16 both ways.
  bf16 = report(jaxcomp.sharded_optimizer(jaxcomp.bf16_compress(), optax.adamw(0.1),
                                          gather_dtype="bfloat16"), stage="lowered")
  assert bf16.bytes_by_dtype() == {"bf16": 2 * 2 * padded}
  # 8 bits (ZeRO++'s qgZ and qwZ): an all-to-all and an all-gather of int8 codes and their scales
  # (one per 256 values), and the 4-byte finiteness flag of the quantized exchange.
  int8 = report(jaxcomp.sharded_optimizer(jaxcomp.quantized(8), optax.adamw(0.1),
                                          gather_dtype="int8"), stage="lowered")
  assert sorted(c.op for c in int8.collectives) == (["all-gather"] * 2 + ["all-reduce"]
                                                     + ["all-to-all"] * 2)
  assert int8.bytes_by_dtype() == {"s8": 2 * padded, "f32": 2 * 8 * 4, "s32": 4}
  # Against the float32 all-reduce of the unsharded chain: the same ring bytes up to the padding.
  chain = report(optax.chain(jaxcomp.allreduce(), optax.adamw(0.1)), stage="lowered")
  n = sum(np.size(x) for x in jax.tree.leaves(params))
  assert {c.op for c in chain.collectives} == {"all-reduce"}  # one per leaf before optimisation
  assert f32.ring_bytes == pytest.approx(chain.ring_bytes * padded / n)
  assert bf16.ring_bytes == pytest.approx(chain.ring_bytes * padded / n / 2)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_quantized_reduce_scatter_loses_nothing_but_the_last_errors_of_the_senders(bits):
  # qgZ with error feedback: each device quantizes every shard it sends and keeps the error; the
  # owner averages the W copies (int8, 4- or 2-bit codes) in float32. Summed over steps, the shards
  # received are the shards of the summed mean gradient less the mean of the devices' final errors.
  world, steps = 4, 3
  rng = np.random.default_rng(3)
  params = init_params()
  grads = [jax.tree.map(lambda x: rng.normal(size=(world,) + np.shape(x)).astype(np.float32),
                        params) for _ in range(steps)]
  tx = jaxcomp.quantized(bits)
  scatter = jax.pmap(tx.scatter, axis_name="batch", devices=jax.devices()[:world])
  state = jax.tree.map(lambda x: np.stack([x] * world), tx.scatter_init(params))
  received = jax.tree.map(np.zeros_like, jax.tree.map(
      lambda x: np.asarray(shards.Layout(world).split(x)), params))
  for g in grads:
    owned, state = jax.block_until_ready(scatter(g, state))
    received = jax.tree.map(lambda r, o: r + np.asarray(o), received, owned)
  cut = shards.Layout(world)
  for key in params:
    sent = sum(g[key].mean(0) for g in grads) - np.asarray(state.worker_error[key]).mean(0)
    np.testing.assert_allclose(received[key], np.asarray(cut.split(sent)),
                               **rounding_tol(8 * world * steps, scale=4.0), err_msg=key)
    exact = np.asarray(cut.split(sum(g[key].mean(0) for g in grads)))
    assert np.abs(exact - received[key]).max() > 1e-4  # it was quantized
  # nothing is re-quantized: the state made for the scatter holds no server error
  assert jax.tree.leaves(state.server_error) == []
  assert jax.tree.leaves(tx.init(params).server_error)


def test_without_a_native_scatter_the_whole_mean_is_taken_and_the_shard_kept():
  # The adapter's fallback, for algorithms without a scatter step (DGC, PowerSGD, ...) and for
  # bucketed transformations: allreduce without its native reduce-scatter, whole and in buckets.
  mesh, data = mesh_1d(8), batches(2)
  native, _, _ = train(jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adamw(0.05)), mesh,
                       data)
  params = init_params()
  config = dense.DenseConfig(None)
  for exchange in (compressor.transformation(config, dense.init, dense.step, "batch"),
                   compressor.transformation(config, dense.init, dense.step, "batch",
                                             scatter=dense.scatter, bucket_cap_mb=1e-4)):
    tx = jaxcomp.sharded_optimizer(exchange, optax.adamw(0.05))
    got, state, dp = train(tx, mesh, data)
    chex.assert_trees_all_close(got, native, **rounding_tol(8 * 8 * 2))
    report = jaxcomp.comm_report(dp.step, params, state, *dp.shard(data[0]), stage="lowered")
    assert {c.op for c in report.collectives} == {"all-reduce", "all-gather"}


def test_dgc_through_the_fallback_trains_as_its_unsharded_chain():
  mesh, data = mesh_1d(4), batches(2)
  dgc = lambda: jaxcomp.dgc(0.25, selection="exact")  # its momenta stay per device, whole
  ref, _, _ = train(optax.chain(dgc(), optax.sgd(0.1)), mesh, data)
  got, state, _ = train(jaxcomp.sharded_optimizer(dgc(), optax.sgd(0.1)), mesh, data)
  chex.assert_trees_all_close(got, ref, **rounding_tol(8 * 4 * 2))
  assert state.exchange.u["w1"].shape == (4, 5, 7)


# A bound on one rounding of d to the gather dtype, given d and the largest |d| of all leaves:
# relative for floats; for int8 codes, half a step of 1/127 of the largest |d| of a block of 256
# values (a device's row of all leaves' shards), at most that of the largest of all.
ROUNDING = {"bfloat16": lambda d, top: np.abs(d) * 2.0**-8,
            "float16": lambda d, top: np.abs(d) * 2.0**-11,
            "int8": lambda d, top: np.full(d.shape, top / 254)}


@pytest.mark.parametrize("gather_dtype", sorted(ROUNDING))
def test_a_lossy_gather_keeps_an_exact_master_that_the_parameters_follow(gather_dtype):
  mesh, data = mesh_1d(8, AxisType.Explicit), batches(6)
  tx = jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.sgd(0.1, momentum=0.9),
                                 gather_dtype=gather_dtype)
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  params = init_params()
  state = dp.make_state(params)
  master = lambda s: {k: shards.Layout(8).join(np.asarray(v), np.shape(params[k]))
                      for k, v in s.master.items()}
  chex.assert_trees_all_equal(master(state), params)  # it starts from the parameters
  for batch in data:
    before = jax.tree.map(np.asarray, params)
    params, state, loss = dp.step(params, state, *dp.shard(batch))
    jax.block_until_ready(loss)
    moved = {key: m - before[key] for key, m in master(state).items()}
    top = max(np.abs(d).max() for d in moved.values())
    for key, m in master(state).items():
      # The parameters miss the master by one rounding of the distance they moved, at most: the
      # rounding of the change, not of the parameters, and not accumulated over steps.
      np.testing.assert_array_less(np.abs(np.asarray(params[key]) - m),
                                   ROUNDING[gather_dtype](moved[key], top) + 1e-7
                                   + 4 * np.abs(m) * 2.0**-24, key)
  assert state.master["w1"].sharding.spec[0] == "batch"  # each device keeps its own shard


def test_2d_mesh_shards_the_state_over_data_and_leaves_model_to_the_partitioner():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  spec = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "scale": P()}
  params = {k: jax.device_put(v, NamedSharding(mesh, spec[k]))
            for k, v in init_params(hidden=8).items()}
  data = batches()
  exchange = lambda: jaxcomp.allreduce(axis_name="data")
  ref, _, _ = train(optax.chain(exchange(), optax.adamw(0.05)), mesh, data, params, "data")
  got, state, dp = train(jaxcomp.sharded_optimizer(exchange(), optax.adamw(0.05),
                                                   axis_name="data"), mesh, data, params, "data")
  chex.assert_trees_all_close(got, ref, **rounding_tol(8 * 4 * STEPS))
  assert got["w1"].sharding.spec == P(None, "model")  # the parameters keep their sharding
  assert state.inner[0].mu["w1"].sharding.spec[0] == "data"
  report = jaxcomp.comm_report(dp.step, got, state, *dp.shard(data[0])).by_axes(mesh)
  over_data = sorted(c.op for c in report[("data",)].collectives)
  assert over_data == ["all-gather"] * 4 + ["reduce-scatter"] * 4  # one each per leaf, by leaf


def test_orbax_restores_the_sharded_state_to_its_shardings_and_training_resumes(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh, data = mesh_1d(4), batches(4)
  tx = jaxcomp.sharded_optimizer(jaxcomp.bf16_compress(), optax.adamw(0.05),
                                 gather_dtype="bfloat16")
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  params = init_params()
  state = dp.make_state(params)
  for batch in data[:2]:
    params, state, loss = dp.step(params, state, *dp.shard(batch))
    jax.block_until_ready(loss)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  with ocp.StandardCheckpointer() as checkpointer:
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          {"params": params, "opt_state": state},
                          {"params": jax.tree.map(lambda x: x.sharding, params),
                           "opt_state": dp.shardings(state)})
    restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert restored["opt_state"].inner[0].mu["w1"].sharding.spec[0] == "batch"
  chex.assert_trees_all_equal(restored["opt_state"], state)
  resumed_params, resumed_state = restored["params"], restored["opt_state"]
  for batch in data[2:]:
    params, state, _ = dp.step(params, state, *dp.shard(batch))
    resumed_params, resumed_state, loss = dp.step(resumed_params, resumed_state,
                                                  *dp.shard(batch))
    jax.block_until_ready(loss)
  chex.assert_trees_all_equal(resumed_params, params)
  chex.assert_trees_all_equal(resumed_state, state)


def test_sharded_clip_by_global_norm_clips_as_optax_does_on_the_whole_gradient():
  mesh, data = mesh_1d(8), batches()
  ref, _, _ = train(optax.chain(jaxcomp.allreduce(), optax.clip_by_global_norm(0.05),
                                optax.adamw(0.05)), mesh, data)
  got, _, _ = train(jaxcomp.sharded_optimizer(
      jaxcomp.allreduce(), optax.chain(jaxcomp.sharded_clip_by_global_norm(0.05),
                                       optax.adamw(0.05))), mesh, data)
  chex.assert_trees_all_close(got, ref, **rounding_tol(8 * 8 * STEPS))
  # On a gradient that is the same on every device it would count each square W times.
  with pytest.raises(ValueError, match="the same on every device.*optax.clip_by_global_norm"):
    train(optax.chain(jaxcomp.allreduce(), jaxcomp.sharded_clip_by_global_norm(1.0),
                      optax.sgd(0.1)), mesh, data[:1])


def test_skip_if_nonfinite_around_it_skips_on_every_device_together():
  mesh, ((x, y),) = mesh_1d(4), batches(1)
  tx = jaxcomp.skip_if_nonfinite(
      jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adamw(0.05)), 3)
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  params = init_params()
  state = dp.make_state(params)
  params, state, _ = dp.step(params, state, *dp.shard((x, y)))
  bad = x.copy()
  bad[5, 0] = np.nan  # one device's part of the batch
  skipped, skipped_state, loss = dp.step(params, state, *dp.shard((bad, y)))
  jax.block_until_ready(loss)
  chex.assert_trees_all_equal(skipped, params)
  assert int(skipped_state.notfinite_count) == 1
  chex.assert_trees_all_equal(skipped_state.inner_state, state.inner_state)


def trace(tx, world=8):
  """Traces and lowers the step of ``tx`` (where the optimizer is checked); compiles nothing."""
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d(world), tx=tx)
  params = init_params()
  dp.step.lower(params, dp.make_state(params), *dp.shard(batches(1)[0]))


def refusal(tx, world=8):
  """The error tracing the step of ``tx`` raises."""
  with pytest.raises((TypeError, ValueError)) as error:
    trace(tx, world)
  return str(error.value)


def test_optimizers_that_would_compute_otherwise_on_a_shard_are_refused_naming_the_cause():
  sharded = lambda opt: jaxcomp.sharded_optimizer(jaxcomp.allreduce(), opt)
  # A reduction over a shard's elements: optax's global norm sees one shard only.
  message = refusal(sharded(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1))))
  assert "reduces over the elements of a leaf" in message and "reduce_sum at" in message
  assert "jaxcomp.sharded_clip_by_global_norm" in message
  assert "reduce_and" in refusal(sharded(optax.apply_if_finite(optax.sgd(0.1), 3)))
  assert "reduce_sum" in refusal(sharded(optax.lamb(0.1)))  # per-leaf trust ratios
  # Factored moments: row and column means of a matrix.
  assert "reduce_sum" in refusal(sharded(optax.adafactor(0.1, min_dim_size_to_factor=2)))
  # Decided by a shape, which a shard does not keep: a mask on a dimension's size.
  assert "decides by the leaves' shapes" in refusal(sharded(optax.adamw(
      0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 0 and x.shape[0] > 4, p))))
  # At W = 1 nothing is summed, but a shard's shape still differs from its leaf's.
  assert "decides by the leaves' shapes" in refusal(sharded(optax.adafactor(
      0.1, min_dim_size_to_factor=2, clipping_threshold=None)), world=1)
  # Noise drawn with one key: the same on every shard, not independent over the leaf.
  assert "draws random numbers (random_bits" in refusal(sharded(optax.chain(
      optax.add_noise(0.1, 0.55, 0), optax.sgd(0.1))))
  # A compressor inside the optimizer would average shards of different coordinates.
  assert "communicates over 'batch' on the shards" in refusal(
      sharded(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))))


def test_elementwise_optimizers_and_rank_masks_are_accepted():
  for optimizer in (optax.lion(0.01), optax.rmsprop(0.01), optax.sgd(0.1, nesterov=True),
                    optax.adamw(0.05, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                    optax.inject_hyperparams(optax.adam)(learning_rate=0.01)):
    trace(jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optimizer))  # no error


def test_bad_arguments_and_states_are_named():
  with pytest.raises(TypeError, match="exchange must be a jaxcomp compressor.*got an optax "
                                      "transformation that is not a jaxcomp compressor"):
    jaxcomp.sharded_optimizer(optax.identity(), optax.sgd(0.1))
  with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
    jaxcomp.sharded_optimizer(jaxcomp.allreduce(), "adam")
  with pytest.raises(ValueError, match="gather_dtype must be None, 'bfloat16', 'float16' or "
                                       "'int8'"):
    jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.sgd(0.1), gather_dtype="int4")
  tx = jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.sgd(0.1))
  params = init_params()
  with pytest.raises(ValueError, match="update needs the parameters"):
    tx.update(params, tx.init(params))
  with pytest.raises(TypeError, match="update needs the state its init made; got EmptyState"):
    tx.update(params, optax.EmptyState(), params)
  # The per-device-step form copies one device's state to every device: not a sharded one.
  dp = jaxcomp.data_parallel(lambda state, x, y: (state, None), mesh_1d(4))
  with pytest.raises(ValueError, match="made on each device.*loss-function form"):
    dp.make_state((params, tx.init(params)))


def test_an_nnx_model_is_refused_with_the_array_form_as_the_fix():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
  tx = jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(lambda m, x, y: jnp.mean((m(x) - y) ** 2), mesh_1d(4), tx=tx)
  with pytest.warns(UserWarning, match="not bound"), \
      pytest.raises(ValueError, match="made on each device.*nnx.split it"):
    dp.make_state(model)


def test_a_weakly_typed_scalar_parameter_is_sharded_like_any_other():
  # jnp.asarray(1.0) is weakly typed: its shard and its leaf trace the same program.
  mesh, data = mesh_1d(8), batches(2)
  params = dict(init_params(), scale=jnp.asarray(1.0))
  assert params["scale"].weak_type

  def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] * p["scale"] - y) ** 2)

  got = {}
  for name, tx in [("sharded", jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adam(1e-2))),
                   ("chain", optax.chain(jaxcomp.allreduce(), optax.adam(1e-2)))]:
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    p, state = params, dp.make_state(params)
    for x, y in data:
      p, state, loss = dp.step(p, state, *dp.shard((x, y)))
      float(loss.mean())
    got[name] = p
  chex.assert_trees_all_close(got["sharded"], got["chain"], **rounding_tol(8 * 8 * 2))
  assert float(got["sharded"]["scale"]) != 1.0  # trained
