"""A state that does not fit the update — stacked over devices but not mapped, or another
transformation's — is an error naming the leaf, the expected and the received shape, and the fix
(``tree.check_state``, which every update calls first)."""

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import hooks
from helpers import replicate

W = 4

TRANSFORMATIONS = {
    "accumulate": lambda: jaxcomp.accumulate(jaxcomp.allreduce(), every_k=2),
    "comm_hook(powersgd_hook)": lambda: jaxcomp.comm_hook(
        hooks.powersgd_hook, hooks.powersgd_state(1, start_iter=0)),
    "skip_if_nonfinite": lambda: jaxcomp.skip_if_nonfinite(
        jaxcomp.accumulate(jaxcomp.fp16_compress(), every_k=2), 1),
    "powersgd": lambda: jaxcomp.powersgd(1, start_iter=0),
    "dgc": lambda: jaxcomp.dgc(0.2),
}


def grads():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(W, 16, 32)).astype(np.float32),
          "b": rng.normal(size=(W, 32)).astype(np.float32)}


@pytest.mark.parametrize("make", TRANSFORMATIONS.values(), ids=TRANSFORMATIONS.keys())
def test_a_stacked_state_that_reaches_update_unmapped_is_named_with_the_fix(make):
  tx = make()
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads())), W)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="batch", in_axes=(0, None),
                  devices=jax.devices()[:W])
  with pytest.raises(ValueError, match=r"state leaf \S+ should be \w+\[.*\], as \w+'s init "
                                       r"makes it; got \w+\[4[,\]].*one more leading axis.*stack "
                                       r"tx.init\(params\) W times or use jax.pmap\(tx.init\)"
                                       r".*in_axes=0"):
    step(grads(), state)


@pytest.mark.parametrize("make", TRANSFORMATIONS.values(), ids=TRANSFORMATIONS.keys())
def test_another_transformations_state_is_named_with_both_kinds(make):
  tx = make()
  params = jax.tree.map(lambda g: g[0], grads())
  other = optax.chain(jaxcomp.dgc(0.2, axis_name=None)).init(params)[0]
  if isinstance(tx.init(params), jaxcomp.DGCState):
    other = jaxcomp.accumulate(jaxcomp.allreduce(), every_k=2).init(params)
  with pytest.raises(TypeError, match=r"update got a (DGCState|AccumulateState), the state of "
                                      r"another transformation; \S+ state is a \w+State"):
    tx.update(params, other)


def test_gradients_with_a_device_axis_too_many_or_too_few_are_named_with_the_fix():
  tx = jaxcomp.allreduce(axis_name=None)
  stacked = grads()
  one_device = jax.tree.map(lambda g: g[0], stacked)
  with pytest.raises(ValueError, match=r"leaf \['b'\] changed between init and update: init saw "
                                       r"float32\[32\], update got float32\[4, 32\] \(one more "
                                       r"leading axis: gradients stacked over devices reached "
                                       r"update unmapped"):
    tx.update(stacked, tx.init(one_device))
  with pytest.raises(ValueError, match=r"\(one leading axis too few: init was given parameters "
                                       r"with a leading device axis.*jax.pmap\(tx.init\)"):
    tx.update(one_device, tx.init(stacked))


def test_a_float0_gradient_of_an_integer_parameter_is_named_with_the_fix():
  params = {"w": np.ones(3, np.float32), "n": np.int32(2)}
  grads = jax.grad(lambda p: (p["w"] * p["n"]).sum(), allow_int=True)(params)
  tx = jaxcomp.allreduce(axis_name=None)
  with pytest.raises(TypeError, match=r"updates: leaf \['n'\] is float0, the gradient of the "
                                      r"int32\[\] parameter from jax.grad\(..., allow_int=True\).*"
                                      r"keep integer leaves out of the tree given to jax.grad"):
    tx.update(grads, tx.init(params))
