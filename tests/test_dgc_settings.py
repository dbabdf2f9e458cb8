"""DGC's settings: bad arguments named, static ones refused when traced, and momentum and
clip_norm traced under ``optax.inject_hyperparams``."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp._src import validate

from dgc_reference import device_grads, make_params
from helpers import pmapped_update, replicate

pytestmark = pytest.mark.numeric
W = 4


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
  """momentum and clip_norm are traced under optax.inject_hyperparams (ratio stays static); each
  step uses the value in the state's hyperparams, as optax's own transformations do."""
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
