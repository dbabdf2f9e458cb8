"""Streaming DiLoCo: DiLoCo one fragment of the parameters at a time, its exchange overlapping
training.

Streaming DiLoCo lowers DiLoCo's peak: one step of every H sends all the
parameters, which a link must carry at once while every device waits. It splits the parameters into
P fragments (``fragment_layout``: whole leaves, strided across depth), runs the outer step of each
at its own offset in the period (torchft's: fragment p after the steps ⌊(p + 1)·H/P⌋ − 1 + kH, the
last where DiLoCo's is), and lets the exchange of a fragment overlap τ inner steps: its
pseudo-gradient travels in τ pieces (the rows, along the first axis, of its leaves, cut in τ near
equal blocks), one per step. No step sends more than one piece of one fragment (τ < H // P): for
fragments of equal size 1/(P·τ) of DiLoCo's sync, and over a period the same bytes. Its steps, per
device, in the order a step runs them (``# Sn:`` below):

* S1. Pieces in flight: for each fragment whose exchange began k steps ago, 1 ≤ k ≤ τ, piece k of
  the pseudo-gradient kept at its beginning (S5) is averaged over the devices (DiLoCo's step 4,
  through ``compressor``, one state per piece) and stored. It reads the state only, never this
  step's gradient, so XLA may run it alongside the forward and backward pass.
* S2. Inner step (DiLoCo's step 1).
* S3. The outer step of each fragment whose exchange began τ steps ago (with τ = 0: begins now, its
  pseudo-gradient averaged at once, steps 3–4): the outer SGD on the fragment's θ with its own
  momentum, kept if not finite (steps 5–6);
* S4. mixed into this device's parameters: θᵢ ← mix·θ + (1 − mix)·θᵢ, θᵢ holding what the device
  learned during the τ steps of the exchange (mix = 1: every device set to θ, step 6).
* S5. A fragment's exchange begins (τ > 0): Δᵢ = θ − θᵢ (step 3) kept for S1 of the next τ steps.

With P = 1, τ = 0 and mix = 1 that is DiLoCo, and ``streaming_diloco`` computes what ``diloco``
does; the step numbers 1–6 are DiLoCo's (``jaxcomp._src.diloco``), whose pieces it reuses.

References:
  Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy, Shen, Ramé, Szlam,
  Ranzato, Barham, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
  Lunch", 2025 (https://arxiv.org/abs/2501.18512): fragments, overlap, mixing (α = 0.5), 4-bit
  outer gradients. torchft ``local_sgd.DiLoCo``: the fragments' offsets, ``fragment_sync_delay``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, diloco, local_steps, phases, validate
from jaxcomp._src import tree as tree_lib

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StreamingDiLoCoConfig(diloco.DiLoCoConfig):
  """Streaming DiLoCo's settings, validated; a static node of the state. With ``fragments=1``,
  ``delay=0`` and ``mix=1`` it is DiLoCo.

  Attributes:
    fragments: P, how many fragments the parameters are split into (``fragment_layout``). Each
      fragment synchronizes once per period at its own offset, so a step sends at most 1/P of the
      parameters (torchft's ``model_fragments``).
    delay: τ, the inner steps a fragment's exchange overlaps (torchft's ``fragment_sync_delay``):
      the pseudo-gradient is sent in τ pieces, one per step, while training goes on, and applied
      after the τ-th. 0: sent and applied in the step it is taken, as DiLoCo does. The paper finds
      quality robust for τ < 5. At most ``sync_every // fragments − 1``, so that one fragment's
      exchange ends before the next one's begins.
    mix: the weight of the synchronized value when a fragment's outer step lands:
      θᵢ ← mix·θ + (1 − mix)·θᵢ, the rest being what the device learned during the τ steps of the
      exchange. The paper's 0.5; 1 sets every device to θ, as DiLoCo does (torchft's
      ``fragment_update_alpha`` is the local weight, 1 − mix).
  """
  name = "streaming_diloco"

  fragments: int = validate.setting(1, check=functools.partial(
      validate.integer, minimum=1, static="fixes which parameters synchronize when"))
  delay: int = validate.setting(0, check=functools.partial(
      validate.integer, minimum=0, static="fixes when a fragment's pieces travel"))
  mix: float = validate.setting(0.5, check=functools.partial(validate.number, low=0, high=1,
                                                             low_open=True))

  def check(self):
    if self.fragments > self.sync_every:
      raise ValueError(f"fragments must be at most sync_every ({self.sync_every}): each fragment "
                       f"synchronizes at its own step of the period; got {self.fragments}. Raise "
                       "sync_every or use fewer fragments")
    spacing = self.sync_every // self.fragments
    if self.delay >= spacing:
      raise ValueError(f"delay must be less than sync_every // fragments = {spacing}, the steps "
                       "between the beginnings of two fragments' exchanges, so that one fragment's "
                       f"exchange ends before the next one's begins; got {self.delay}. Lower "
                       "delay, or raise sync_every")

  @property
  def pieces(self) -> int:
    """How many pieces a fragment's pseudo-gradient travels in: τ, or 1 without delay."""
    return max(self.delay, 1)

  def first_start(self, fragment: int) -> int:
    """The step (0-based) after which ``fragment``'s first exchange begins: ⌊(p + 1)·H/P⌋ − 1,
    torchft's offsets; the last fragment's is the end of the period, where DiLoCo's is."""
    return (fragment + 1) * self.sync_every // self.fragments - 1

  def starts_after(self, fragment: int, step):
    """Whether ``fragment``'s exchange begins after step ``step`` (an int or an array)."""
    return (step - self.first_start(fragment)) % self.sync_every == 0

  def piece_sent_in(self, fragment: int, step):
    """The piece of ``fragment``'s pseudo-gradient that step ``step`` sends, or −1: piece k − 1
    on the k-th step after an exchange began, 1 ≤ k ≤ τ."""
    since = step - self.first_start(fragment)
    k = since % self.sync_every
    return jnp.where((since > 0) & (k >= 1) & (k <= self.delay), k - 1, -1)

  def applies_after(self, fragment: int, step):
    """Whether ``fragment``'s outer step lands after step ``step``: τ steps after its exchange
    began (with τ = 0, when it begins)."""
    since = step - self.first_start(fragment) - self.delay
    return (since >= 0) & (since % self.sync_every == 0)

  def syncs_after(self, step):
    """Whether every device holds the same parameters after step ``step``: only with one fragment
    and ``mix=1``, after its outer step (with several fragments and ``mix=1`` each fragment is the
    same on every device right after its own outer step, never all of them at once)."""
    return self.applies_after(0, step) & (self.fragments == 1 and self.mix == 1)


def fragment_layout(signature: tree_lib.TreeSignature, fragments: int) -> tuple:
  """Which leaves each fragment holds: ``fragments`` tuples of leaf indices, in leaf order.

  Fragments are strided across depth, whole leaves each (the paper finds strided fragments better
  than sequential ones): the k-th reduced leaf with at least two dimensions (a layer's kernel, an
  embedding) goes to fragment k mod P, and every other reduced leaf (a bias, a norm's scale) to the
  fragment of the next such leaf after it — in Flax's alphabetical order, the kernel of its own
  layer — or of the last one. (Striding every leaf alike would put all biases into one fragment and
  all kernels into another for P = 2.) Without leaves of two dimensions every leaf is strided. A
  pytree with fewer such leaves than P leaves some fragments empty, and a fragment is never smaller
  than its largest leaf (the peak step sends a piece of the largest fragment).

  Example:
    >>> import jax.numpy as jnp, jaxcomp
    >>> params = {"dense1": {"bias": jnp.zeros(8), "kernel": jnp.zeros((4, 8))},
    ...           "dense2": {"bias": jnp.zeros(2), "kernel": jnp.zeros((8, 2))}}
    >>> jaxcomp.fragment_layout(jaxcomp.TreeSignature.of(params), 2)  # each bias with its kernel
    ((0, 1), (2, 3))
  """
  reduced = signature.reduced
  units = [i for i in reduced if len(signature.shapes[i]) >= 2] or list(reduced)
  owner = {unit: k % fragments for k, unit in enumerate(units)}
  layout = [[] for _ in range(fragments)]
  for i in reduced:
    unit = i if i in owner else next((u for u in units if u > i), units[-1])
    layout[owner[unit]].append(i)
  return tuple(tuple(f) for f in layout)


def _rows(shape: tuple, pieces: int, piece: int) -> tuple:
  """The rows (along the first axis; a 0-d leaf is one row) of a leaf that ``piece`` holds."""
  n = shape[0] if shape else 1
  return piece * n // pieces, (piece + 1) * n // pieces


def _cut(x, pieces: int, piece: int):
  """``piece`` of ``x``: its rows, as an array of at least one dimension (``x`` itself when it
  travels whole)."""
  if pieces == 1:
    return x
  start, stop = _rows(x.shape, pieces, piece)
  return x.reshape((-1,) + x.shape[1:])[start:stop]


def _paste(x, pieces: int, piece: int, value):
  """``x`` with the rows of ``piece`` replaced by ``value`` (a ``_cut`` of ``x``'s shape)."""
  if pieces == 1:
    return value
  start, stop = _rows(x.shape, pieces, piece)
  return x.reshape((-1,) + x.shape[1:]).at[start:stop].set(value).reshape(x.shape)


def _in_piece(signature: tree_lib.TreeSignature, fragment: tuple, pieces: int, piece: int) -> tuple:
  """The positions in ``fragment`` of the leaves that ``piece`` holds rows of."""
  spans = [_rows(signature.shapes[i], pieces, piece) for i in fragment]
  return tuple(k for k, (start, stop) in enumerate(spans) if stop > start)


def _subtree(signature: tree_lib.TreeSignature, indices: tuple, values: list):
  """A tree of the parameters' structure with ``values`` at leaves ``indices`` and empty
  ``optax.MaskedNode``\\ s elsewhere: what the compressor averages, its leaves keeping their
  paths."""
  flat = [optax.MaskedNode()] * len(signature.shapes)
  for i, value in zip(indices, values):
    flat[i] = value
  return signature.unflatten(flat)


class StreamingDiLoCoState(NamedTuple):
  """State of ``streaming_diloco``.

  Attributes:
    count: inner steps taken (int32), every step counted; the same on every device.
    outer_params: θ, one entry per parameter leaf (``optax.MaskedNode()`` for leaves that are not
      reduced), each fragment's as of its last outer step; the same on every device.
    outer_states: the outer SGD's state of each fragment (its momentum); the same on every device.
    compressor_states: for each fragment, the compressor's state of each of its pieces (``()``
      without a compressor; ``optax.EmptyState()`` for a piece that holds no rows); they declare
      their own per-device fields.
    pending: for each fragment, this device's pseudo-gradient Δᵢ of its exchange in flight, one
      array per leaf of the fragment (``()`` each without delay). PER DEVICE.
    received: for each fragment, the mean pseudo-gradient, piece by piece as it arrives (``()``
      each without delay); the same on every device.
    inner_state: the inner optimizer's state, with a leading axis of length 1 on every leaf. PER
      DEVICE.
    config: the static settings.
    signature: the gradient pytree's signature.
  """
  count: jax.Array
  outer_params: tuple
  outer_states: tuple
  compressor_states: tuple
  pending: tuple
  received: tuple
  inner_state: Any
  config: StreamingDiLoCoConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("pending", "inner_state")  # see jaxcomp.sharding
  PARAMS_PER_DEVICE = True  # the parameters differ between synchronizations

  @property
  def layout(self) -> tuple:
    """The leaf indices of each fragment (``fragment_layout``)."""
    return fragment_layout(self.signature, self.config.fragments)

  def syncs_after(self, step):
    """Whether every device holds the same parameters after step ``step``: with ``mix=1``, after the
    outer step of the one fragment that holds leaves (fragments land at different steps, so with
    two or more the devices never agree on all of them at once); always without reduced leaves.
    ``config.syncs_after`` answers the same without knowing the pytree (one fragment)."""
    held = [p for p, fragment in enumerate(self.layout) if fragment]
    if not held:
      return True
    return self.config.applies_after(held[0], step) & (len(held) == 1 and self.config.mix == 1)


def _layout(signature: tree_lib.TreeSignature, fragments: int) -> tuple:
  """``fragment_layout``, with a warning where a fragment would hold nothing: the algorithm runs
  (those fragments send nothing), but the peak bytes do not fall by ``fragments``."""
  layout = fragment_layout(signature, fragments)
  empty = [p for p, fragment in enumerate(layout) if not fragment]
  if empty and signature.reduced:
    units = sum(len(signature.shapes[i]) >= 2 for i in signature.reduced) or len(signature.reduced)
    axis.warn_once_per_trace(("fragments", fragments, signature), (
        f"streaming_diloco: fragments={fragments} but the parameters have only {units} leaves to "
        f"deal into fragments (leaves of 2+ dimensions; {len(signature.reduced)} trained leaves in "
        f"all): fragment{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
        f"hold{'' if len(empty) > 1 else 's'} nothing, and the peak bytes do not fall by "
        f"{fragments}. Use fragments={units} or fewer"))
  return layout


def init(config: StreamingDiLoCoConfig, signature: tree_lib.TreeSignature,
         params) -> StreamingDiLoCoState:
  """θ = ``params``, per fragment its outer state and its pieces' compressor states, the exchange
  buffers (with a delay), and the inner optimizer's state, kept per device."""
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
  layout = _layout(signature, config.fragments)
  theta = diloco.outer_params(leaves)
  outer = config.outer_optimizer()

  def piece_state(fragment: tuple, piece: int):
    held = _in_piece(signature, fragment, config.pieces, piece)
    if not held:
      return optax.EmptyState()
    return config.compressor.init(_subtree(signature, [fragment[k] for k in held],
                                           [_cut(leaves[fragment[k]], config.pieces, piece)
                                            for k in held]))

  buffers = tuple(tuple(jnp.zeros_like(leaves[i]) for i in f) if config.delay else ()
                  for f in layout)
  return StreamingDiLoCoState(
      jnp.zeros([], jnp.int32), theta,
      tuple(outer.init(tuple(theta[i] for i in f)) for f in layout),
      tuple(() if config.compressor is None else
            tuple(piece_state(f, j) for j in range(config.pieces)) for f in layout),
      buffers, buffers, local_steps.to_device(config.inner.init(params)), config, signature)


def _send(config: StreamingDiLoCoConfig, axis_name: axis.AxisName, state: StreamingDiLoCoState,
          p: int, piece: int, received: tuple, compressor_states: tuple, pending: tuple) -> tuple:
  """S1: ``piece`` of fragment ``p``'s ``pending`` pseudo-gradient averaged into ``received``."""
  fragment, signature = state.layout[p], state.signature
  held = _in_piece(signature, fragment, config.pieces, piece)
  if not held:
    return received, compressor_states, pending
  values = [_cut(pending[k], config.pieces, piece) for k in held]
  tree = _subtree(signature, [fragment[k] for k in held], values)
  mean, piece_state = diloco.average(config.compressor, axis_name, tree,
                                     compressor_states[piece] if config.compressor else None)
  received = list(received)
  for k, value in zip(held, jax.tree.leaves(mean)):  # typed as the state holds it
    received[k] = local_steps.varying_like(_paste(received[k], config.pieces, piece, value),
                                           received[k])
  if config.compressor is not None:
    compressor_states = (compressor_states[:piece] + (piece_state,)
                         + compressor_states[piece + 1:])
  return tuple(received), compressor_states, pending


def _land(config: StreamingDiLoCoConfig, axis_name: axis.AxisName, state: StreamingDiLoCoState,
          p: int, received: tuple, local: list, theta: tuple, outer_state,
          compressor_states: tuple) -> tuple:
  """S3–S4 for fragment ``p``: the outer step on its mean pseudo-gradient (averaged here when
  there is no delay), mixed into this device's parameters."""
  mean = received
  if not config.delay:  # S3 with τ = 0: steps 3–4 on this fragment
    delta = [t - x for t, x in zip(theta, local)]
    tree = _subtree(state.signature, state.layout[p], delta)
    mean, piece_state = diloco.average(config.compressor, axis_name, tree,
                                       compressor_states[0] if config.compressor else None)
    mean = tuple(jax.tree.leaves(mean))
    if config.compressor is not None:
      compressor_states = (piece_state,)
  # S3: steps 5–6 on the fragment's θ.
  new_theta, outer_state = diloco.outer_step(config.outer_optimizer(), theta, outer_state, mean)
  # S4: mixed into this device's parameters.
  mixed = [t if config.mix == 1 else config.mix * t + (1 - config.mix) * x
           for t, x in zip(new_theta, local)]
  return local_steps.varying_like(mixed, local), new_theta, outer_state, compressor_states


def step(config: StreamingDiLoCoConfig, state: StreamingDiLoCoState, grads, params,
         axis_name: axis.AxisName) -> tuple:
  """S1–S5 (the module docstring): ``(new params, new state)``."""
  layout, share = state.layout, 1 / config.sync_every
  received, compressor_states = list(state.received), list(state.compressor_states)
  for p, fragment in enumerate(layout):
    for j in range(config.delay if fragment else 0):
      # S1: the piece of each exchange in flight, from the state alone.
      received[p], compressor_states[p], _ = phases.when(
          config.piece_sent_in(p, state.count) == j,
          phases.Phase(f"{config.name}.fragment{p}.piece{j}", share),
          functools.partial(_send, config, axis_name, state, p, j), received[p],
          compressor_states[p], state.pending[p])
  # S2: the inner step on this device.
  local, inner_state = local_steps.local_update(
      config, grads, local_steps.from_device(state.inner_state), params, axis_name)
  leaves = jax.tree.leaves(local)
  theta, outer_states, pending = (list(state.outer_params), list(state.outer_states),
                                  list(state.pending))
  for p, fragment in enumerate(layout):
    if not fragment:
      continue
    # S3–S4: the outer step of a fragment whose exchange is complete, mixed in.
    new_local, new_theta, outer_states[p], compressor_states[p] = phases.when(
        config.applies_after(p, state.count), phases.Phase(f"{config.name}.fragment{p}", share),
        functools.partial(_land, config, axis_name, state, p, received[p]),
        [leaves[i] for i in fragment], tuple(theta[i] for i in fragment), outer_states[p],
        compressor_states[p])
    for i, x, t in zip(fragment, new_local, new_theta):
      leaves[i], theta[i] = x, t
    if config.delay:  # S5: an exchange begins; Δᵢ kept for S1 of the next τ steps.
      mine = tuple(leaves[i] for i in fragment)
      pending[p], _, _ = phases.when(
          config.starts_after(p, state.count), None,
          lambda _, t, x: (tuple(a - b for a, b in zip(t, x)), t, x),
          local_steps.varying_like(pending[p], mine), tuple(theta[i] for i in fragment), mine)
  return tree_lib.like(local, leaves), state._replace(
      outer_params=tuple(theta), outer_states=tuple(outer_states),
      compressor_states=tuple(compressor_states), pending=tuple(pending),
      received=tuple(received), inner_state=local_steps.to_device(inner_state))


def streaming_diloco(inner: optax.GradientTransformation, *, sync_every: int, fragments: int,
                     delay: int = 0, mix: float = 0.5, outer_learning_rate: float = 0.7,
                     outer_momentum: float = 0.9, nesterov: bool = True,
                     compressor: Optional[optax.GradientTransformation] = None,
                     axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """Streaming DiLoCo: DiLoCo one fragment of the parameters at a time, its exchange overlapping
  ``delay`` inner steps.

  The module docstring numbers the steps (S1–S5). The parameters are split into ``fragments``
  strided fragments (``fragment_layout``); each runs DiLoCo's outer step once every ``sync_every``
  steps at its own offset, so a step sends at most one fragment: 1/P of DiLoCo's peak. With
  ``delay`` τ > 0 the fragment's pseudo-gradient travels in τ pieces over the next τ steps (1/τ of
  the fragment each), while every device goes on training, and the outer step lands after the τ-th,
  mixed with what the device learned meanwhile. Each piece's exchange reads the state only, never
  the step's gradient, so XLA may run it alongside the forward and backward pass.

  Like ``diloco`` it is the whole optimizer: its update needs ``params`` and returns
  ``jaxcomp.Assign`` updates. With ``fragments=1, delay=0, mix=1`` it is ``diloco``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
    >>> tx = jaxcomp.streaming_diloco(optax.sgd(0.1), sync_every=4, fragments=2, delay=1, mix=1)
    >>> loss_fn = lambda p, x: ((x @ p["a"]) ** 2).mean() + ((x @ p["b"]) ** 2).mean()
    >>> dp = jaxcomp.data_parallel(loss_fn, jax.make_mesh((8,), ("batch",)), tx=tx)
    >>> params = {"a": jnp.ones((4, 1)), "b": jnp.ones((4, 1))}  # a fragment each
    >>> opt_state, params = dp.make_state(params), dp.make_params(params)
    >>> x = dp.shard(jnp.linspace(0, 1, 64).reshape(16, 4))  # 2 examples per device
    >>> for step in range(5):  # "a" lands after step 2, "b" after step 4
    ...   params, opt_state, _ = dp.step(params, opt_state, x)
    ...   print(step, [bool((np.asarray(v) == np.asarray(v)[0]).all()) for v in params.values()])
    0 [False, False]
    1 [False, False]
    2 [True, False]
    3 [False, False]
    4 [False, True]

  Args:
    inner: the optimizer each device runs (the papers: AdamW).
    sync_every: H, inner steps between two outer steps of the same fragment.
    fragments: P, the number of fragments; at most ``sync_every``.
    delay: τ, the inner steps a fragment's exchange overlaps; less than ``sync_every // fragments``.
    mix: the weight of the synchronized value when an outer step lands (the paper's 0.5; 1 sets
      every device to it).
    outer_learning_rate: η of the outer SGD.
    outer_momentum: μ of the outer SGD; 0 for none. Each fragment keeps its own momentum.
    nesterov: Nesterov momentum (the paper's) rather than heavy-ball.
    compressor: a jaxcomp transformation that averages the pseudo-gradient over the same axis, or
      over it and a node's (``jaxcomp.hierarchical``, as ``jaxcomp.diloco``'s) (the
      paper sends it in 4 bits: ``jaxcomp.quantized(...)`` sends 8); one state per piece of each
      fragment. A piece holds rows (first-axis slices) of the fragment's leaves, so a compressor
      that views leaves as matrices (PowerSGD) sees row blocks of them. None sends the float32 mean.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A ``GradientTransformation`` with a ``StreamingDiLoCoState``, whose update requires ``params``.

  References:
    Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy, Shen, Ramé, Szlam,
    Ranzato, Barham, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
    Lunch", 2025 (https://arxiv.org/abs/2501.18512). torchft ``local_sgd.DiLoCo`` (its offsets and
    the names ``model_fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``).
  """
  config = StreamingDiLoCoConfig(
      inner=inner, sync_every=sync_every, outer_learning_rate=outer_learning_rate,
      outer_momentum=outer_momentum, nesterov=nesterov, compressor=compressor,
      fragments=fragments, delay=delay, mix=mix)
  diloco.same_axis(config.compressor, axis.check_axis_name(axis_name), config.name)
  return local_steps.transformation(config, init, step, axis_name)
