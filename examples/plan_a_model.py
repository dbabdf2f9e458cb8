"""Size a cluster for your own Flax model, then train with what the planner recommends.

``make_params`` returns a Flax Linen model's parameters; the planner reads only their shapes
(``jax.eval_shape``: nothing is allocated), so the same function plans a 7B-parameter model::

    python -m jaxcomp.train --plan --model examples/plan_a_model.py:make_params \\
        --devices 64 --gbits 1 --device h100

This script asks the planner from Python for a few entries (``planner.plan``), prints its
recommendation, and trains a few steps of the recommended entry with ``jaxcomp.data_parallel`` on
simulated CPU devices::

    python examples/plan_a_model.py --steps 20 --devices 4
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = 256, 128, 256, 4, 4


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.SelfAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=mask)
    hidden = nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x)))
    return x + nn.Dense(WIDTH)(hidden)


class LanguageModel(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, WIDTH)
    x = embed(tokens) + self.param("position", nn.initializers.normal(0.02), (CONTEXT, WIDTH))
    for _ in range(DEPTH):
      x = Block()(x)
    return embed.attend(nn.LayerNorm()(x))  # the head tied to the embedding


def make_params():
  """The model's parameters (the planner runs this under ``jax.eval_shape``)."""
  return LanguageModel().init(jax.random.key(0), jnp.zeros((1, CONTEXT), jnp.int32))["params"]


def loss_fn(params, tokens):  # one device's shard of the batch
  logits = LanguageModel().apply({"params": params}, tokens[:, :-1])
  targets = jax.nn.one_hot(tokens[:, 1:], VOCAB)
  return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), -1))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20, help="training steps")
  parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (mesh size)")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

  import numpy as np
  import optax

  import jaxcomp
  from jaxcomp.train import planner, registry

  plan = planner.plan(jax.eval_shape(make_params), devices=64, gbits=[1], device="h100",
                      names=["allreduce", "bf16", "quantized_int8", "onebit_adam"],
                      about="the example's language model")
  print(plan.text.split("\n\n")[1])  # the recommendation and its reasons
  winner = plan.recommendations[1.0].winner.label
  entry = registry.REGISTRY[winner]
  tx = entry.optimizer(optax.adamw(1e-3), "batch")
  mesh = jax.make_mesh((jax.device_count(),), ("batch",))
  dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="batch", tx=tx)
  params = make_params()
  params, opt_state = dp.make_params(params), dp.make_state(params)
  rng = np.random.default_rng(0)
  for step in range(args.steps):
    tokens = rng.integers(0, VOCAB, (8 * jax.device_count(), CONTEXT + 1)).astype(np.int32)
    params, opt_state, losses = dp.step(params, opt_state, *dp.shard((tokens,)))
    loss = float(np.mean(losses))  # blocks on every step, as XLA:CPU's collectives need
  print(f"trained {winner} for {args.steps} steps on {jax.device_count()} devices: loss {loss:.3f}")


if __name__ == "__main__":
  main()
