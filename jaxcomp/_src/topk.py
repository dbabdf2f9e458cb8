"""Top-k selection: the indices of the largest magnitudes of a vector, exactly or from a sample.

``exact_topk`` is ``lax.top_k``. ``sampled_topk`` is the selection of the DGC reference
(``DGCCompressor._sparsify``): a threshold estimated from a strided sample of the magnitudes,
lowered while too few entries reach it, and the exact top k taken among the candidates only when
too many do — so the work past one pass over the vector grows with k, not with its length
(``kernels.bits_at_least``, ``kernels.first_at_least``). ``sampling_plan`` fixes its static sizes.

References:
  Lin et al., "Deep Gradient Compression", ICLR 2018; the first author's reference code,
  ``DGCCompressor`` (github.com/synxlin/deep-gradient-compression).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import kernels


class SamplingPlan(NamedTuple):
  """Static sizes of one leaf's sampled selection (the reference's ``initialize``): at most ``k``
  coordinates sent; the threshold is the smallest of the top ``top_k_samples`` of ``num_samples``
  magnitudes taken every ``stride`` elements from a random offset in [0, stride)."""
  numel: int
  k: int
  num_samples: int
  top_k_samples: int
  stride: int


def sampling_plan(numel: int, density: float, sample_ratio: float = 0.01) -> SamplingPlan:
  """The reference's sample sizes: ~``sample_ratio`` of the leaf, and at least 2/density samples."""
  cpr_numel = math.ceil(2 / density)
  stride, num_samples = 1, numel
  if sample_ratio < 1.0 and numel > cpr_numel:
    wanted = max(math.ceil(numel * sample_ratio), cpr_numel)
    stride = math.ceil(numel / wanted / 32) * 32 + 1
    num_samples = numel // stride
    while num_samples < wanted:  # ends at stride 1 at the latest
      stride -= 8
      num_samples = numel // stride
  return SamplingPlan(numel, math.ceil(numel * density), num_samples,
                      math.ceil(num_samples * density), stride)


def exact_topk(x: jax.Array, k: int) -> jax.Array:
  """The int32 indices of the k entries of largest magnitude of the 1-D ``x`` (``lax.top_k``)."""
  return lax.top_k(jnp.abs(x), k)[1].astype(jnp.int32)


def sampled_topk(x: Union[jax.Array, Callable[[], jax.Array]], plan: SamplingPlan,
                 key: jax.Array, *, upper_bound: float = 1.3, lower_bound: float = 0.8,
                 max_adaptation_iters: int = 10) -> tuple:
  """At most k coordinates of the 1-D ``x`` whose magnitude reaches a threshold estimated by
  sampling.

  The reference's ``_sparsify``, with static shapes: the threshold is the smallest of the top
  ``plan.top_k_samples`` strided sample magnitudes; while fewer than ``lower_bound·k`` entries reach
  it, it is multiplied by ``lower_bound`` (at most ``max_adaptation_iters`` times); if then more
  than ``upper_bound·k`` reach it, the exact top k among them are taken, otherwise the first k (in
  index order) of those reaching it. Without sampling (``num_samples == numel``) the threshold is
  exact.

  ``x`` may be a function of no arguments that returns it (DGC's ``v + u``, computed from the
  state where it is read): each pass over it, the rare ones inside conditionals included, then
  computes it from its terms, and it is never written to memory of its own.

  Returns:
    ``(indices, threshold, finite)``: int32 indices of shape ``(k,)``, each with ``|x| >=
    threshold``, slots left empty holding ``numel`` (out of range: scatters drop them); whether
    every entry of ``x`` is finite, from the first pass over it (``kernels.bits_at_least``).
  """
  value = x if callable(x) else lambda: x
  n, k = plan.numel, plan.k
  samples = jnp.abs(value())
  if plan.num_samples < n:  # x[start::stride]: num_samples or num_samples + 1 entries (else -1)
    taken = jax.random.randint(key, (), 0, plan.stride) + plan.stride * jnp.arange(
        plan.num_samples + 1)
    samples = jnp.where(taken < n, jnp.abs(value().at[taken].get(mode="clip")), -1)
  threshold = kernels.kth_largest(samples, plan.top_k_samples)
  bits, finite = kernels.bits_at_least(value(), threshold)
  carry = (threshold, bits, jnp.int32(0))

  def count(bits):
    return lax.population_count(bits).sum(dtype=jnp.int32)

  def too_few(carry):
    _, bits, iters = carry
    return (iters < max_adaptation_iters) & (count(bits) < lower_bound * k)

  def lower(carry):
    threshold, _, iters = carry
    return (threshold * lower_bound, kernels.bits_at_least(value(), threshold * lower_bound)[0],
            iters + 1)

  if plan.num_samples < n:  # adaptation: lower the threshold while too few reach it
    carry = kernels.while_loop_if_needed(too_few, lower, carry)
  threshold, bits, iters = carry
  total, capacity = count(bits), min(2 * k, n)
  candidates, magnitudes = kernels.first_at_least(value(), bits, capacity)

  def top_k_of_candidates():  # capacity >= k
    return lax.cond(total > capacity, lambda: exact_topk(value(), k),
                    lambda: candidates[lax.top_k(magnitudes, k)[1]])

  # The reference counts again only if the loop stopped before its last iteration.
  resample = (total > upper_bound * k) & (iters < max_adaptation_iters)
  return lax.cond(resample, top_k_of_candidates, lambda: candidates[:k]), threshold, finite
