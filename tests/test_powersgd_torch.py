"""Parity with torch's real ``powerSGD_hook`` (torch 2.13, two Gloo processes, world size 2).

``tests/golden/make_powersgd_golden.py`` runs torch and records its outputs, errors, random Qs and
compression statistics; jaxcomp's ``powersgd`` with ``matrix_view="torch"`` gets the same gradients
on two devices and torch's Qs put into its state, and must agree to float32 rounding. One test
checks the committed golden file (always); another reruns torch live when it is installed.
"""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import rounding_tol

pytestmark = pytest.mark.numeric

_SPEC = importlib.util.spec_from_file_location(
    "make_powersgd_golden", pathlib.Path(__file__).parent / "golden" / "make_powersgd_golden.py")
golden = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(golden)

# torch's float32 order against XLA's, on unit-scale gradients: per step, roundings along the sums
# of P and Q (n + m of the largest matrix) and the devices, carried through the steps by the error
# feedback.
TOL = rounding_tol(golden.STEPS * (max(s[0] + int(np.prod(s[1:])) for s in golden.SHAPES.values())
                                   + golden.WORLD))


def _stacked(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@functools.lru_cache(maxsize=None)
def _jaxcomp(config: int):
  """jaxcomp's transformation and pmapped step for ``config``, compiled once for both tests."""
  rank, error_feedback, warm_start = golden.CONFIGS[config]
  tx = jaxcomp.powersgd(rank, start_iter=golden.START_ITER, error_feedback=error_feedback,
                        warm_start=warm_start, matrix_view="torch")
  return tx, jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:golden.WORLD])


def check_parity(data, config: int):
  """Runs jaxcomp on configuration ``config`` and compares every step with torch's record."""
  error_feedback = golden.CONFIGS[config][1]
  tx, step = _jaxcomp(config)
  params = {name: jnp.zeros(shape, jnp.float32) for name, shape in golden.SHAPES.items()}
  state = _stacked([tx.init(params)] * golden.WORLD)
  compressed = {name for name, q in state.by_leaf("q").items()
                if not isinstance(q, optax.MaskedNode)}
  for t in range(golden.STEPS):
    torch_qs = {name: data[f"c{config}_q{t}_{name}"] for name in golden.SHAPES
                if f"c{config}_q{t}_{name}" in data}
    if torch_qs:  # the steps where torch drew a fresh Q: the same leaves, and its Q into the state
      assert set(torch_qs) == compressed, (t, set(torch_qs), compressed)
      state = state.with_leaves("q", {**state.by_leaf("q"), **{
          name: jnp.stack([jnp.asarray(q)] * golden.WORLD) for name, q in torch_qs.items()}})
    grads = _stacked([jax.tree.map(jnp.asarray, golden.gradients(config, t, r))
                      for r in range(golden.WORLD)])
    out, state = step(grads, state)
    out = jax.block_until_ready(out)
    for r in range(golden.WORLD):
      np.testing.assert_allclose(golden.flat(jax.tree.map(lambda x: x[r], out)),
                                 data[f"c{config}_out"][t], **TOL,
                                 err_msg=f"config {golden.CONFIGS[config]}, step {t}, output")
      if error_feedback:
        error = golden.flat(jax.tree.map(lambda x: x[r], state.by_leaf("error")))
        if t < golden.START_ITER:  # torch has no error before it starts compressing
          np.testing.assert_array_equal(error, 0)
        else:
          np.testing.assert_allclose(error, data[f"c{config}_err"][r, t - golden.START_ITER], **TOL,
                                     err_msg=f"config {golden.CONFIGS[config]}, step {t}, error")
  rate, before, after = state.compression_stats()
  torch_rate, torch_before, torch_after = data[f"c{config}_stats"]
  assert (before, after) == (torch_before, torch_after)
  assert rate == pytest.approx(torch_rate, rel=1e-12)


# Each combination of error feedback and warm start (the code paths) in the fast tier, each at
# another rank; the other ranks in the slow tier.
FAST = ((1, True, True), (2, True, False), (4, False, True), (2, False, False))


@pytest.mark.parametrize("config", [
    pytest.param(i, id=f"rank{r}-ef{int(e)}-ws{int(w)}",
                 marks=() if (r, e, w) in FAST else pytest.mark.slow)
    for i, (r, e, w) in enumerate(golden.CONFIGS)])
def test_matches_torch_golden(config):
  data = dict(np.load(golden.GOLDEN))
  check_parity(data, config)


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_matches_live_torch(tmp_path):
  torch = pytest.importorskip("torch")
  path = tmp_path / "live.npz"
  golden.run_torch(str(path), timeout=300)
  data = dict(np.load(path))
  assert str(data["torch_version"]) == torch.__version__
  for config in range(len(golden.CONFIGS)):
    check_parity(data, config)
  # torch's batched hook raises at its first compressed step; jaxcomp's works
  # (test_powersgd_hooks.py).
  assert str(data["batched_raised"]).startswith(f"AssertionError at step {golden.START_ITER}")
