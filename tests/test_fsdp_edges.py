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
from jax.sharding import AxisType

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
