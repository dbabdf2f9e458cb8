"""The harness of the tests of what wraps a chain that communicates (test_guard.py: jaxcomp's
guards; test_misuse.py: optax's wrappers and the like): a two-leaf pytree on 4 devices, gradients
with a NaN on one device where asked, a PowerSGD chain, and its pmapped updates."""

import numpy as np
import optax

import jaxcomp
from helpers import run_updates

W = 4


def params():
  return {"w": np.ones((6, 5), np.float32), "b": np.zeros(5, np.float32)}


def grads(seed=0, nan_on=None):
  """Per-device gradients like ``params()``; with ``nan_on``, that device's ``w[0, 0]`` is NaN."""
  rng = np.random.default_rng(seed)
  g = {"w": rng.normal(size=(W, 6, 5)).astype(np.float32),
       "b": rng.normal(size=(W, 5)).astype(np.float32)}
  if nan_on is not None:
    g["w"][nan_on, 0, 0] = np.nan
  return g


def powersgd_chain():
  return optax.chain(jaxcomp.powersgd(1, start_iter=0), optax.sgd(0.1, momentum=0.9))


def run(tx, steps, state=None):
  """``tx``'s pmapped updates on each of ``steps`` (per-device gradients) in turn, from ``state``
  (by default ``tx.init(params())`` on every device): the last output and state."""
  outputs, states = run_updates(tx, steps, W, state=state, params=params())
  return outputs[-1], states[-1]
