"""Parameter shapes of published models, as ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).

Flax layout: Dense kernels ``(in, out)``, Conv kernels ``(kh, kw, in, out)``, embeddings under
``embedding``, norms' ``scale`` (and ``bias`` for LayerNorm and BatchNorm). The planner
(``python -m jaxcomp.train --plan --model NAME``) sizes a cluster for these; ``MODELS`` names them.
The benchmarks measure on the same trees (``benchmarks/common.py``, which adds torch's layout).

* ``resnet18``: He et al. 2016, basic blocks, 1,000 classes (torchvision's 11,689,512).
* ``resnet50``: He et al. 2016, bottleneck blocks, 1,000 classes (torchvision's 25,557,032).
* ``gpt2-small``, ``gpt2-medium``: Radford et al. 2019, 50,257 tokens, context 1,024, the output
  head tied to the token embedding (124,439,808 and 354,823,168; Hugging Face's ``gpt2``,
  ``gpt2-medium``).
* ``llama3.2-1b``: Llama 3.2 1B: 16 blocks of width 2,048, 32 query and 8 key/value heads of 64,
  SwiGLU 8,192, 128,256 tokens, tied head, no biases (1,235,814,400).
* ``llama2-7b``: Llama 2 7B: 32 blocks of width 4,096, 32 heads, SwiGLU 11,008, 32,000 tokens, its
  own output head (6,738,415,616).
* ``transformer(n)``: a GPT-2-shaped transformer of about ``n`` parameters (``--params N``).
* ``mlp``, ``tiny``: the benchmarks' MLP and their quick mode's few-thousand-parameter tree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


def _leaf(*shape):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)


def _norm(width, bias=True):
  return {"scale": _leaf(width), **({"bias": _leaf(width)} if bias else {})}


def dense(cin, cout, bias=True):
  """A Dense layer's parameters: ``kernel`` ``(in, out)``, and ``bias`` unless ``bias=False``."""
  return {"kernel": _leaf(cin, cout), **({"bias": _leaf(cout)} if bias else {})}


def _conv(kh, kw, cin, cout):
  return {"kernel": _leaf(kh, kw, cin, cout)}


def resnet18(num_classes: int = 1000, width: int = 64) -> dict:
  """ResNet-18 (He et al. 2016; torchvision's 11,689,512 parameters at the defaults)."""
  params = {"conv_init": _conv(7, 7, 3, width), "bn_init": _norm(width)}
  cin = width
  for stage, blocks in enumerate((2, 2, 2, 2)):
    cout = width * 2**stage
    for b in range(blocks):
      block = {"conv1": _conv(3, 3, cin, cout), "bn1": _norm(cout),
               "conv2": _conv(3, 3, cout, cout), "bn2": _norm(cout)}
      if cin != cout:
        block["proj_conv"], block["proj_bn"] = _conv(1, 1, cin, cout), _norm(cout)
      params[f"stage{stage + 1}_block{b}"] = block
      cin = cout
  params["fc"] = dense(cin, num_classes)
  return params


def resnet50(num_classes: int = 1000, width: int = 64) -> dict:
  """ResNet-50 with bottleneck blocks (torchvision's 25,557,032 parameters at the defaults)."""
  params = {"conv_init": _conv(7, 7, 3, width), "bn_init": _norm(width)}
  cin = width
  for stage, blocks in enumerate((3, 4, 6, 3)):
    mid = width * 2**stage
    cout = 4 * mid
    for b in range(blocks):
      block = {"conv1": _conv(1, 1, cin, mid), "bn1": _norm(mid),
               "conv2": _conv(3, 3, mid, mid), "bn2": _norm(mid),
               "conv3": _conv(1, 1, mid, cout), "bn3": _norm(cout)}
      if cin != cout:
        block["proj_conv"], block["proj_bn"] = _conv(1, 1, cin, cout), _norm(cout)
      params[f"stage{stage + 1}_block{b}"] = block
      cin = cout
  params["fc"] = dense(cin, num_classes)
  return params


def gpt2(width: int = 768, depth: int = 12, vocab: int = 50257, context: int = 1024) -> dict:
  """GPT-2 (124,439,808 parameters at the defaults, GPT-2 small; the head is tied to ``wte``)."""
  params = {"wte": {"embedding": _leaf(vocab, width)}, "wpe": {"embedding": _leaf(context, width)}}
  for i in range(depth):
    params[f"h{i}"] = {"ln_1": _norm(width), "attn_qkv": dense(width, 3 * width),
                       "attn_proj": dense(width, width), "ln_2": _norm(width),
                       "mlp_fc": dense(width, 4 * width), "mlp_proj": dense(4 * width, width)}
  params["ln_f"] = _norm(width)
  return params


def llama(width: int, depth: int, heads: int, kv_heads: int, hidden: int, vocab: int,
          tied: bool) -> dict:
  """A Llama-architecture transformer: RMSNorm scales, no biases, grouped-query attention,
  SwiGLU."""
  kv = width // heads * kv_heads
  params = {"embed_tokens": {"embedding": _leaf(vocab, width)}}
  for i in range(depth):
    params[f"layers_{i}"] = {
        "input_layernorm": _norm(width, bias=False),
        "self_attn": {"q_proj": dense(width, width, False), "k_proj": dense(width, kv, False),
                      "v_proj": dense(width, kv, False), "o_proj": dense(width, width, False)},
        "post_attention_layernorm": _norm(width, bias=False),
        "mlp": {"gate_proj": dense(width, hidden, False), "up_proj": dense(width, hidden, False),
                "down_proj": dense(hidden, width, False)}}
  params["norm"] = _norm(width, bias=False)
  if not tied:
    params["lm_head"] = dense(width, vocab, False)
  return params


def mlp(sizes=(784, 1024, 1024, 1024, 10)) -> dict:
  """``benchmarks/step_time.py``'s MLP (784-1024×3-10, 2,913,290 parameters at the defaults)."""
  return {f"dense{i}": dense(a, b) for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def tiny() -> dict:
  """A few-thousand-parameter pytree with every kind of leaf the models have (the benchmarks'
  quick mode)."""
  return {"conv": _conv(3, 3, 4, 8), "bn": _norm(8), "embed": {"embedding": _leaf(100, 16)},
          "dense": dense(72, 32), "head": dense(32, 10)}


MIN_PARAMS = 10_000_000
"""``transformer``'s smallest size: GPT-2's token embedding alone is 50,257 × width."""


def _gpt2_count(width: int, depth: int) -> int:
  return (50257 + 1024) * width + depth * (12 * width**2 + 13 * width) + 2 * width


def transformer(n: int) -> tuple:
  """``(shape pytree, description)`` of a GPT-2-shaped transformer of about ``n`` parameters: the
  widest width (a multiple of 64, at most about (64·n/12)^(1/3): depth ≈ width / 64, GPT-2's and
  GPT-3's aspect) whose closest depth comes within 2% of ``n``, else the closest of all."""
  if not MIN_PARAMS <= n <= 1e13:
    raise ValueError(f"a transformer of {n:,.0f} parameters: give 1e7 to 1e13")
  widest = max(64, 64 * round((64 * n / 12) ** (1 / 3) / 64))
  shapes = []
  for width in range(64, widest + 1, 64):
    depth = max(1, round((n - _gpt2_count(width, 0)) / (12 * width**2 + 13 * width)))
    shapes.append((abs(_gpt2_count(width, depth) - n) / n, width, depth))
  close = [s for s in shapes if s[0] <= 0.02]
  _, width, depth = close[-1] if close else min(shapes)
  return gpt2(width=width, depth=depth), (
      f"a GPT-2-shaped transformer for about {n:,.0f} parameters ({depth} "
      f"block{'s' * (depth > 1)} of {width}, 50,257 tokens, context 1,024, tied head)")


@dataclasses.dataclass(frozen=True)
class Model:
  """A named model: its parameter shapes, what they are, and the compute estimate's inputs.

  Attributes:
    about: the model and where its shapes come from.
    build: ``build() -> shape pytree``.
    flops_per_example: forward FLOPs of one example (a token, an image).
    examples: the examples per device per step the compute estimate assumes.
    unit: what an example is ("tokens", "images").
  """
  about: str
  build: Callable[[], dict]
  flops_per_example: Callable[[int], float]
  examples: int
  unit: str


def per_token(n: int) -> float:
  """A transformer's forward FLOPs per token: about 2 per parameter."""
  return 2.0 * n


TOKENS = 8192
"""Tokens per device per step of the transformers' compute estimate: 8 sequences of 1,024."""

MODELS = {
    "resnet50": Model("ResNet-50 (He et al. 2016; torchvision's layer shapes)", resnet50,
                      lambda n: 8.2e9, 256, "images"),
    "gpt2-small": Model("GPT-2 small (Radford et al. 2019; 12 blocks of 768, tied head)", gpt2,
                        per_token, TOKENS, "tokens"),
    "gpt2-medium": Model("GPT-2 medium (24 blocks of 1,024, tied head)",
                         lambda: gpt2(width=1024, depth=24), per_token, TOKENS, "tokens"),
    "llama3.2-1b": Model(
        "Llama 3.2 1B (16 blocks of 2,048, 8 key/value heads, SwiGLU 8,192, tied head)",
        lambda: llama(2048, 16, 32, 8, 8192, 128256, tied=True), per_token, TOKENS, "tokens"),
    "llama2-7b": Model("Llama 2 7B (32 blocks of 4,096, SwiGLU 11,008, untied head)",
                       lambda: llama(4096, 32, 32, 32, 11008, 32000, tied=False), per_token,
                       TOKENS, "tokens"),
}
"""The planner's presets (``--model``), by name."""
