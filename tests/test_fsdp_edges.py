"""``jaxcomp.fully_sharded`` at its edges: a layer gathered twice in one step (tied weights), the
non-finite guard, kernels split over a model axis that W·M does not divide, RNG keys and NNX
Variables among the parameters; and jaxcomp's sources free of deprecation warnings."""

import pathlib
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from helpers import rounding_tol

LIBRARY = pathlib.Path(jaxcomp.__file__).parent  # what ``import jaxcomp`` compiles


def test_the_library_compiles_without_deprecation_warnings():
  """An invalid escape sequence in a docstring warns when the module is compiled (the cached
  bytecode hides it): the sources ``import jaxcomp`` reads, compiled afresh, warnings as errors."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    warnings.simplefilter("error", SyntaxWarning)
    for path in [LIBRARY / "__init__.py", *sorted((LIBRARY / "_src").glob("*.py"))]:
      compile(path.read_text(), str(path), "exec")


def test_nnx_variables_are_read_without_deprecated_value():
  """Flax 0.12 deprecates ``Variable.value``; jaxcomp reads a Variable's array without it."""
  from flax import nnx
  from jaxcomp._src import tree as tree_lib
  state = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    signature = tree_lib.TreeSignature.of(state)
  assert sorted(signature.shapes) == [(2,), (3, 2)]


def mesh_1d(n):
  return jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def run(fs, state, data):
  """``fs.step`` over ``data``, reading the loss every step (XLA:CPU needs it)."""
  losses = []
  for batch in data:
    state, loss = fs.step(state, *fs.shard(batch))
    losses.append(float(loss.mean()))
  return state, losses


# ------------------------------------------------------------ a layer gathered twice: tied weights


def tied_params():
  rng = np.random.default_rng(0)
  return {"emb": {"w": rng.normal(0, 0.5, (8, 6)).astype(np.float32)},
          "head": {"b": np.zeros(8, np.float32)}}


def tied_data(steps=3):
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(8, 8)).astype(np.float32),) for _ in range(steps)]


def readout(y, head):
  return jnp.mean((y + head["b"]) ** 2)


def once(p, x):
  emb = jaxcomp.gather_layer(p["emb"])["w"]
  return readout(jnp.tanh(x @ emb) @ emb.T, jaxcomp.gather_layer(p["head"]))


def twice(p, x):  # an embedding tied to the output layer, gathered where each is used
  h = jnp.tanh(x @ jaxcomp.gather_layer(p["emb"])["w"])
  return readout(h @ jaxcomp.gather_layer(p["emb"])["w"].T, jaxcomp.gather_layer(p["head"]))


def dense(layer, h):  # (n, 8) -> (n, 8) through a layer's (8, 6) kernel
  return jnp.tanh(h @ layer["w"]) @ jnp.ones((6, 8))


@pytest.mark.numeric
def test_a_layer_gathered_twice_is_gathered_once_and_trains_as_such():
  """Tied weights: the second ``gather_layer`` of the embedding reuses the first, so its gradient
  (both uses summed) is scattered once and the int8 exchange's error feedback is counted once."""
  mesh = mesh_1d(4)
  states, sent = {}, {}
  for name, loss in [("once", once), ("twice", twice)]:
    fs = jaxcomp.fully_sharded(loss, mesh, jaxcomp.quantized(8), optax.sgd(0.05))
    states[name], _ = run(fs, fs.make_state(tied_params()), tied_data())
    report = jaxcomp.comm_report(fs.step, states[name], *fs.shard(tied_data()[0]))
    sent[name] = sorted((c.op, c.phase, c.payload_bytes) for c in report.collectives)
  assert sent["twice"] == sent["once"]  # one gather and one scatter of the embedding
  np.testing.assert_array_equal(np.asarray(states["twice"].exchange[0].count), [3] * 4)
  chex.assert_trees_all_close(fs.gather_params(states["twice"]),
                              fs.gather_params(states["once"]), **rounding_tol(16))
  chex.assert_trees_all_close(states["twice"].exchange, states["once"].exchange,
                              **rounding_tol(16))


def checkpointed_twice(p, x):
  layer = jax.checkpoint(lambda layer, h: dense(jaxcomp.gather_layer(layer), h))
  return readout(layer(p["emb"], layer(p["emb"], x)), jaxcomp.gather_layer(p["head"]))


def scanned(p, x):
  body = lambda h, _: (dense(jaxcomp.gather_layer(p["emb"]), h), None)  # noqa: E731
  return readout(jax.lax.scan(body, x, None, length=2)[0], jaxcomp.gather_layer(p["head"]))


def called_twice(p, x):
  h = jaxcomp.call_layer(dense, p["emb"], jaxcomp.call_layer(dense, p["emb"], x))
  return readout(h, jaxcomp.gather_layer(p["head"]))


def in_one_branch(p, x):
  h = jax.lax.cond(x.sum() > 0, lambda: dense(jaxcomp.gather_layer(p["emb"]), x), lambda: x)
  return readout(h, jaxcomp.gather_layer(p["head"]))


@pytest.mark.parametrize("loss, how", [
    (checkpointed_twice, "2 times"), (scanned, "2 times"), (called_twice, "2 times"),
    (in_one_branch, "in some branches of a conditional and not in others")],
    ids=["checkpoint", "scan", "call_layer", "cond"])
def test_a_layer_gathered_where_it_cannot_be_reused_is_refused_naming_it(loss, how):
  """A second gather JAX traces apart (inside ``jax.checkpoint``, a loop's body, ``call_layer``)
  would scatter and advance the exchange's state once per gather; a gather in one branch only
  would leave the state unmoved or not: refused, before any step runs."""
  fs = jaxcomp.fully_sharded(loss, mesh_1d(2), jaxcomp.quantized(8), optax.sgd(0.05))
  state = fs.make_state(tied_params())
  with pytest.raises(ValueError, match=rf"params\['emb'\] is gathered {how} in one step.*"
                     r"Gather it once"):
    fs.step(state, *fs.shard(tied_data(1)[0]))


@pytest.mark.numeric
def test_the_fix_gather_once_and_pass_it_in_trains():
  """The message's fix: gather once, pass the whole parameters into ``jax.checkpoint``."""
  def fixed(p, x):
    emb, layer = jaxcomp.gather_layer(p["emb"]), jax.checkpoint(dense)
    return readout(layer(emb, layer(emb, x)), jaxcomp.gather_layer(p["head"]))

  fs = jaxcomp.fully_sharded(fixed, mesh_1d(2), jaxcomp.quantized(8), optax.sgd(0.05))
  state, losses = run(fs, fs.make_state(tied_params()), tied_data())
  np.testing.assert_array_equal(np.asarray(state.exchange[0].count), [3] * 2)
  assert np.isfinite(losses).all()


def test_a_layer_the_loss_does_not_use_keeps_its_exchange_state():
  """Unused in a step, a layer's exchange state is kept (its cotangent, zero, would reset the
  int8 exchange's count and error feedback)."""
  mesh = mesh_1d(2)
  both = jaxcomp.fully_sharded(once, mesh, jaxcomp.quantized(8), optax.sgd(0.05))
  head_only = jaxcomp.fully_sharded(lambda p, x: readout(x, jaxcomp.gather_layer(p["head"])),
                                    mesh, jaxcomp.quantized(8), optax.sgd(0.05))
  state, _ = run(both, both.make_state(tied_params()), tied_data(1))
  kept, _ = run(head_only, state, tied_data(1))
  chex.assert_trees_all_equal(kept.exchange[0], state.exchange[0])
  np.testing.assert_array_equal(np.asarray(kept.exchange[1].count), [2] * 2)


# ------------------------------------------------------------------------ the non-finite guard


def mlp_params():
  rng = np.random.default_rng(2)
  return {"dense0": {"w": rng.normal(0, 0.5, (5, 7)).astype(np.float32),
                     "b": np.zeros(7, np.float32)},
          "dense1": {"w": rng.normal(0, 0.5, (7, 3)).astype(np.float32)}}


def mlp_loss(p, x, y):
  dense0, dense1 = jaxcomp.gather_layer(p["dense0"]), jaxcomp.gather_layer(p["dense1"])
  return jnp.mean((jnp.tanh(x @ dense0["w"] + dense0["b"]) @ dense1["w"] - y) ** 2)


def mlp_data(steps, rows=8):
  rng = np.random.default_rng(3)
  return [(rng.normal(size=(rows, 5)).astype(np.float32),
           rng.normal(size=(rows, 3)).astype(np.float32)) for _ in range(steps)]


@pytest.mark.parametrize("exchange", [jaxcomp.allreduce, lambda: jaxcomp.quantized(8)],
                         ids=["allreduce", "int8"])
def test_skip_if_nonfinite_skips_the_step_on_every_device_with_the_state_kept(exchange):
  """An infinity in one device's batch: its gradient, or one owner's shard of the mean, is not
  finite; every device skips the step and keeps the parameters, the optimizer's state and the
  exchange's; the next step continues as if the bad one had not come."""
  fs = jaxcomp.fully_sharded(mlp_loss, mesh_1d(4), exchange(),
                             jaxcomp.skip_if_nonfinite(optax.adam(0.05), 3))
  data = mlp_data(4)
  state, _ = run(fs, fs.make_state(mlp_params()), data[:2])
  x, y = data[2]
  x = x.copy()
  x[5, 0] = np.inf  # on device 2 only (2 rows each)
  skipped, _ = fs.step(state, *fs.shard((x, y)))  # its loss is finite: tanh saturates
  np.testing.assert_array_equal(np.asarray(skipped.inner.total_notfinite), [1] * 4)
  chex.assert_trees_all_equal((skipped.params, skipped.inner.inner_state, skipped.exchange),
                              (state.params, state.inner.inner_state, state.exchange))
  resumed, _ = run(fs, skipped, data[3:])
  want, _ = run(fs, state, data[3:])
  chex.assert_trees_all_equal(resumed.params, want.params)


def test_apply_if_finite_is_refused_pointing_at_skip_if_nonfinite():
  fs = jaxcomp.fully_sharded(mlp_loss, mesh_1d(2), jaxcomp.allreduce(),
                             optax.apply_if_finite(optax.adam(0.05), 3))
  with pytest.raises(ValueError, match=r"optimizer: optax.apply_if_finite .* use "
                     r"jaxcomp.skip_if_nonfinite\(<its inner optimizer>, max_consecutive_errors\) "
                     "as fully_sharded's optimizer"):
    fs.make_state(mlp_params())


@pytest.mark.parametrize("optimizer", [lambda: jaxcomp.dion(0.02),
                                       lambda: jaxcomp.local_sgd(optax.sgd(0.1), sync_every=2),
                                       lambda: jaxcomp.quantized(8)],
                         ids=["dion", "local_sgd", "compressor"])
def test_a_jaxcomp_transformation_as_the_optimizer_is_refused_naming_it(optimizer):
  made = optimizer()
  with pytest.raises(TypeError, match=rf"optimizer: jaxcomp.{made.name} is .*fully_sharded's "
                     "optimizer runs on each device's shards"):
    jaxcomp.fully_sharded(mlp_loss, mesh_1d(2), jaxcomp.allreduce(), made)


def test_dion_trains_under_data_parallel_as_the_refusal_says():
  plain = lambda p, x, y: mlp_loss(p, x, y)  # noqa: E731  (gather_layer: as they are)
  dp = jaxcomp.data_parallel(plain, mesh_1d(2), tx=jaxcomp.dion(0.02))
  params = mlp_params()
  opt_state = dp.make_state(params)
  for batch in mlp_data(2):
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard(batch))
    assert np.isfinite(float(loss.mean()))
  assert not np.allclose(params["dense0"]["w"], mlp_params()["dense0"]["w"])


# ----------------------------------------- kernels split over a model axis that W·M does not divide


@pytest.mark.numeric
def test_model_split_leaves_that_w_m_does_not_divide_train_as_the_unsharded_chain():
  """On a (4, 2) mesh, leaves split over ``model`` whose last axis 8 does not divide (12, 10 and a
  vector of 10; ``sharded_optimizer`` trains them): their shards (3 columns) are replicated over
  ``model``; a kernel whose shards keep the split (8 columns: 2 each) keeps it."""
  mesh = jax.make_mesh((4, 2), ("batch", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(4)
  split = lambda x, spec: jax.device_put(x.astype(np.float32), NamedSharding(mesh, spec))  # noqa
  params = {"a": split(rng.normal(0, 0.5, (8, 12)), P(None, "model")),
            "b": split(rng.normal(0, 0.5, (12, 10)), P(None, "model")),
            "c": split(rng.normal(0, 0.5, (10,)), P("model")),
            "d": split(rng.normal(0, 0.5, (10, 8)), P(None, "model"))}

  def loss(p, x):
    p = jaxcomp.gather_layer(p)
    return jnp.mean((jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"] + p["c"]) @ p["d"]) ** 2)

  data = [(rng.normal(size=(8, 8)).astype(np.float32),) for _ in range(2)]
  optimizer = optax.adam(0.05)
  dp = jaxcomp.data_parallel(loss, mesh, tx=optax.chain(jaxcomp.allreduce(), optimizer))
  fs = jaxcomp.fully_sharded(loss, mesh, jaxcomp.allreduce(), optimizer)
  want, opt_state, state = params, dp.make_state(params), fs.make_state(params)
  for batch in data:
    want, opt_state, _ = dp.step(want, opt_state, *dp.shard(batch))
    state, loss_value = fs.step(state, *fs.shard(batch))
    assert np.isfinite(float(loss_value.mean()))
  chex.assert_trees_all_close(fs.gather_params(state), want, **rounding_tol(32))
  per_device = {"a": (1, 8, 3), "b": (1, 12, 3), "c": (1, 3), "d": (1, 10, 1)}
  for name, shape in per_device.items():
    assert state.params[name].addressable_shards[0].data.shape == shape
    assert state.inner[0].mu[name].addressable_shards[0].data.shape == shape


# ----------------------------------------------------------- RNG keys and NNX state in the params


def test_an_rng_key_among_the_parameters_is_refused_naming_it():
  fs = jaxcomp.fully_sharded(lambda p, x: (x @ jaxcomp.gather_layer(p)["w"]).sum(), mesh_1d(2),
                             jaxcomp.allreduce(), optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"params: leaf \['key'\] is key<fry>; fully_sharded shards "
                     "floating-point parameters only"):
    fs.make_state({"w": np.ones((4, 2), np.float32), "key": jax.random.key(0)})


class NNXNet:
  """An NNX model with BatchNorm and Dropout (built when Flax is imported)."""

  @staticmethod
  def make():
    from flax import nnx

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.dense = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

      def __call__(self, x):
        return self.drop(self.norm(self.dense(x)))

    return Net(nnx.Rngs(params=0, dropout=1))


def test_nnx_model_state_that_is_not_a_parameter_is_refused_naming_it():
  """The model itself, its whole state (BatchNorm's statistics, Dropout's RNG key and count) as
  Variables or as a pure dict: each refused, naming what it found."""
  from flax import nnx
  model = NNXNet.make()
  fs = jaxcomp.fully_sharded(lambda p, x: x.sum(), mesh_1d(2), jaxcomp.allreduce(),
                             optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"params: an nnx.Module; .*nnx.split\(model, nnx.Param"):
    fs.make_state(model)
  with pytest.raises(TypeError, match=r"params: .*leaf \['norm'\]\['mean'\] is an "
                     r"nnx.BatchStat, not a parameter: .*nnx.split\(model, nnx.Param"):
    fs.make_state(nnx.state(model))
  with pytest.raises(TypeError, match=r"params: leaf \['drop'\]\['rngs'\]\['count'\] is uint32; "
                     "fully_sharded shards floating-point parameters only"):
    fs.make_state(nnx.to_pure_dict(nnx.state(model)))


def nnx_step_of(copied: bool):
  """``fully_sharded`` of the NNX model split into its parameters and the rest, merged again in
  the loss (the rest as it is, or copied), each device's Dropout reseeded with its own key from
  the batch."""
  from flax import nnx
  graphdef, params, rest = nnx.split(NNXNet.make(), nnx.Param, ...)

  def loss(p, x, key):
    model = nnx.merge(graphdef, jaxcomp.gather_layer(p),
                      jax.tree.map(lambda v: v, rest) if copied else rest)
    nnx.reseed(model, dropout=jax.random.wrap_key_data(key[0]))
    return jnp.mean(model(x) ** 2)

  fs = jaxcomp.fully_sharded(loss, mesh_1d(4), jaxcomp.allreduce(), optax.adam(0.05))
  x = np.random.default_rng(5).normal(size=(8, 5)).astype(np.float32)
  batches = [(x, np.asarray(jax.random.key_data(jax.random.split(jax.random.key(k), 4))))
             for k in range(2)]
  return fs, params, batches


def test_a_loss_that_writes_variables_made_outside_the_step_is_refused_and_the_fix_trains():
  """BatchNorm (its statistics) and Dropout (its RNG count) write to the Variables of the
  ``rest`` that ``nnx.split`` made outside the step: refused, with the fix (merge a copy, keys
  through the batch), which trains."""
  fs, params, batches = nnx_step_of(copied=False)
  with pytest.raises(ValueError, match=r"loss_fn: it writes NNX Variables made outside the step.*"
                     r"jax.tree.map\(lambda v: v, rest\)"):
    fs.step(fs.make_state(params), *fs.shard(batches[0]))
  fs, params, batches = nnx_step_of(copied=True)
  state, losses = run(fs, fs.make_state(params), batches)
  assert np.isfinite(losses).all()
  moved = fs.gather_params(state)["dense"]["kernel"]
  assert not np.allclose(moved, params["dense"]["kernel"].get_value())
