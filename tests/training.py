"""The pmapped training step the training tests share (``pmap_step``), the loop that runs it
(``run``: replicated parameters, waited for every step), and a small regression for the
reliability tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compressors import COMPRESSORS, OPTIMIZERS, optimizer
from helpers import replicate

W = 8
IN, HIDDEN, OUT = 12, 24, 6


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"hidden": {"kernel": rng.normal(0, 0.3, (IN, HIDDEN)).astype(np.float32),
                     "bias": np.zeros(HIDDEN, np.float32)},
          "out": {"kernel": rng.normal(0, 0.3, (HIDDEN, OUT)).astype(np.float32),
                  "bias": np.zeros(OUT, np.float32)}}


TEACHER = init_params(seed=99)


def batch(step, n_devices=W, per_device=8):
  """Per-device regression batches from a fixed teacher network, different on every step."""
  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(n_devices, per_device, IN)).astype(np.float32)
  return x, forward(TEACHER, x, np).astype(np.float32)


def forward(params, x, xp=jnp):
  h = xp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return h @ params["out"]["kernel"] + params["out"]["bias"]


def loss_fn(params, x, y):
  return jnp.mean((forward(params, x) - y) ** 2)


def pmap_step(loss, tx, n_devices=W, poisoned=False, returns="loss", axis_name="batch"):
  """The pmapped training step of ``loss(params, *batch)`` with ``tx``: ``step(params, opt_state,
  *batch) -> (params, opt_state, *returned)``.

  Args:
    loss: the loss function.
    tx: the optimizer.
    n_devices: how many devices (the first ones) run it.
    poisoned: the step takes a last argument (per device: 0 or non-finite) that is added to that
      device's gradient.
    returns: what the step returns after the parameters and the state: ``"loss"``, each device's
      loss; ``"updates"``, the updates; ``None``, nothing (the gradient alone is computed).
    axis_name: the name of the mapped axis.
  """

  def step(params, opt_state, *args):
    batch, poison = (args[:-1], args[-1]) if poisoned else (args, None)
    if returns == "loss":
      value, grads = jax.value_and_grad(loss)(params, *batch)
    else:
      grads = jax.grad(loss)(params, *batch)
    if poisoned:
      grads = jax.tree.map(lambda g: g + poison, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if returns == "loss":
      return params, opt_state, value
    if returns == "updates":
      return params, opt_state, updates
    return params, opt_state

  return jax.pmap(step, axis_name=axis_name, devices=jax.devices()[:n_devices])


def make_step(name, lr=0.05, n_devices=W):
  """A pmapped, poisoned step (``pmap_step``) of the registry entry ``name`` on the regression,
  with ``apply_if_finite`` guarding what follows a compressor (SGD), what a wrapper wraps (SGD,
  inside local SGD and DiLoCo) or what follows a whole optimizer (nothing but the guard, after
  1-bit Adam)."""
  guard = lambda inner: optax.apply_if_finite(inner, max_consecutive_errors=10**6)  # noqa: E731
  if name in OPTIMIZERS:
    tx = optax.chain(COMPRESSORS[name](), guard(optax.identity()))
  else:
    tx = optimizer(name, guard(optax.sgd(lr)))
  return tx, pmap_step(loss_fn, tx, n_devices, poisoned=True)


def start(tx, seed=0, n_devices=W):
  params = init_params(seed)
  return replicate(params, n_devices), replicate(tx.init(params), n_devices)


def run(pstep, params, opt_state, steps, first_step=0, poison_at=None, n_devices=W, batch=batch):
  """Runs ``steps`` steps of ``pstep`` from step ``first_step``, waiting for each (unblocked loops
  deadlock XLA:CPU).

  Args:
    pstep: ``pstep(params, opt_state, *batch[, poison]) -> (params, opt_state, ...)``, pmapped.
    params: the per-device parameters the first step starts from.
    opt_state: the per-device optimizer state the first step starts from.
    steps: how many steps.
    first_step: the number of the first step (which batches, which faults).
    poison_at: ``(step, device, value)`` triples for a step built with ``poisoned``: ``value`` is
      added to that device's gradient at that step, 0 to the others'; None: the step takes no such
      argument.
    n_devices: how many devices run it.
    batch: ``batch(step, n_devices)``, the step's per-device arrays; by default the regression's.

  Returns:
    ``(params, opt_state, outputs)``: the last parameters and state, and every step's outputs.
  """
  outputs = []
  for step in range(first_step, first_step + steps):
    args = batch(step, n_devices)
    if poison_at is not None:
      poison = np.zeros(n_devices, np.float32)
      for at, device, value in poison_at:
        if at == step:
          poison[device] = value
      args = (*args, poison)
    out = jax.block_until_ready(pstep(params, opt_state, *args))
    params, opt_state = out[:2]
    outputs.append(out)
  return params, opt_state, outputs


def mean_losses(outputs):
  """Each step's loss averaged over the devices, from ``run``'s outputs of a ``pmap_step`` that
  returns the loss."""
  return [float(np.mean(loss)) for _, _, loss in outputs]
