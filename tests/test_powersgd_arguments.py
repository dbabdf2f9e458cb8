"""PowerSGD's arguments (jaxcomp.powersgd, jaxcomp.batched_powersgd and their hooks' states): bad
values and types named, a changed gradient pytree refused, the alternating variant's needs, and
the static settings refused under ``optax.inject_hyperparams`` while epsilon is scheduled."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import rounding_tol

pytestmark = pytest.mark.numeric


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


def test_alternating_needs_warm_start_and_layerwise():
  with pytest.raises(ValueError, match="alternating=True needs warm_start=True"):
    jaxcomp.powersgd(alternating=True, warm_start=False)
  with pytest.raises(ValueError, match="batched PowerSGD takes no alternating"):
    jaxcomp.PowerSGDConfig(batched=True, alternating=True)


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
