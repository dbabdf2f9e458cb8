"""DiLoCo: H local steps of an inner optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

Every device trains its replica for ``sync_every`` (H) steps of the inner optimizer (the paper: AdamW)
on its own data, without communicating. Then the devices average their *pseudo-gradients* — how far
each moved from the parameters θ the period started from — and one outer optimizer step (SGD with
Nesterov momentum) moves θ; every device restarts from the new θ. One all-reduce of the parameters' size
per H steps: H times less traffic than data-parallel training, and with ``compressor`` (float16,
PowerSGD, …) on the pseudo-gradient less still.

Like ``local_sgd``, ``diloco`` is the whole optimizer: its update needs ``params`` and returns
``jaxcomp.Assign`` updates, which ``optax.apply_updates`` applies exactly, so every device holds
bitwise the same θ after every outer step.

The steps, per device (the ``# n:`` comments below point here; the names in quotes are those of the
paper's Algorithm 1):

1. Inner step: the inner optimizer steps on this device's gradient, θᵢ ← "InnerOpt"(θᵢ, ∇L). No
   communication; a device whose new parameters are not finite keeps them and its inner
   state as they were (``local_steps``). The inner state persists across outer steps, per device.
2. After every H-th step (steps H − 1, 2H − 1, … counted from 0), the outer step:
3. the "outer gradient" (pseudo-gradient) Δᵢ = θ − θᵢ, θ being the parameters of the last outer
   step, kept in the state and the same on every device;
4. averaged, Δ = (1/W) Σᵢ Δᵢ: ÷W, then one all-reduce SUM of all leaves packed per dtype — or through
   ``compressor``, a jaxcomp transformation whose output is the cross-device mean (``fp16_compress``,
   ``powersgd``, …), whose state persists across outer steps;
5. the "OuterOpt", SGD with Nesterov momentum μ and learning rate η: m ← μ·m + Δ; θ ← θ − η·(Δ + μ·m)
   (with ``nesterov=False``, θ ← θ − η·m), torch's and optax's ``sgd``, which runs it;
6. every device's parameters are set to the new θ (each replica starts the next period from θ). If the new θ is not
   finite (the average overflowed), θ and m are kept and the devices restart from the old θ. Every
   quantity of steps 4–6 is identical on every device, so the decision is too.

With ``sync_every=1``, η = 1 and μ = 0, θ ← θ − mean(θ − θᵢ) = mean(θᵢ): for an inner optimizer that
is linear in the gradient (SGD, with or without momentum) that is data-parallel training.

The parameters at ``init`` must be the same on every device (as for data-parallel training): they
are the first θ.

**Streaming DiLoCo** (``streaming_diloco``) lowers DiLoCo's peak: one step of every H sends all the
parameters, which a link must carry at once while every device waits. It splits the parameters into
P fragments (``fragment_layout``: whole leaves, strided across depth), runs the outer step of each
at its own offset in the period (torchft's: fragment p after the steps ⌊(p + 1)·H/P⌋ − 1 + kH, the
last where DiLoCo's is), and lets the exchange of a fragment overlap τ inner steps: its
pseudo-gradient travels in τ pieces (the rows, along the first axis, of its leaves, cut in τ near
equal blocks), one per step. No step sends more than one piece of one fragment (τ < H // P): for
fragments of equal size 1/(P·τ) of DiLoCo's sync, and over a period the same bytes. Its steps, per
device, in the order a step runs them (``# Sn:`` below):

* S1. Pieces in flight: for each fragment whose exchange began k steps ago, 1 ≤ k ≤ τ, piece k of the
  pseudo-gradient kept at its beginning (S5) is averaged over the devices (step 4, through
  ``compressor``, one state per piece) and stored. It reads the state only, never this step's
  gradient, so XLA may run it alongside the forward and backward pass.
* S2. Inner step (step 1).
* S3. The outer step of each fragment whose exchange began τ steps ago (with τ = 0: begins now, its
  pseudo-gradient averaged at once, steps 3–4): the outer SGD on the fragment's θ with its own
  momentum, kept if not finite (steps 5–6);
* S4. mixed into this device's parameters: θᵢ ← mix·θ + (1 − mix)·θᵢ, θᵢ holding what the device
  learned during the τ steps of the exchange (mix = 1: every device set to θ, step 6).
* S5. A fragment's exchange begins (τ > 0): Δᵢ = θ − θᵢ (step 3) kept for S1 of the next τ steps.

With P = 1, τ = 0 and mix = 1 that is DiLoCo, and ``streaming_diloco`` computes what ``diloco``
does.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023 (https://arxiv.org/abs/2311.08105),
  Algorithm 1; an outer learning rate of 0.7 with Nesterov momentum 0.9 are its settings.
  Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
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

from jaxcomp._src import axis, finite, local_steps, phases, validate
from jaxcomp._src import tree as tree_lib


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
  """DiLoCo's settings, validated; a static node of the state.

  Attributes:
    sync_every: H, inner steps per outer step. The paper uses 500 and finds quality degrading slowly
      as H grows (communication falls as 1/H); small H approaches data-parallel training.
    outer_learning_rate: η of the outer SGD. The paper's 0.7: with η = 1 and no momentum DiLoCo is
      plain parameter averaging (FedAvg); η < 1 damps the noise of the averaged pseudo-gradient.
    outer_momentum: μ of the outer SGD (0 for none). The paper's 0.9: momentum across outer steps is
      what lets DiLoCo match synchronous training with few, large outer steps.
    nesterov: Nesterov momentum (the paper's outer optimizer) rather than heavy-ball.
  """
  sync_every: int
  outer_learning_rate: float = 0.7
  outer_momentum: float = 0.9
  nesterov: bool = True

  def __post_init__(self):
    checked = dict(
        sync_every=validate.integer(self.sync_every, "sync_every", 1,
                                    static="fixes when the devices communicate"),
        outer_learning_rate=validate.number(self.outer_learning_rate, "outer_learning_rate", 0,
                                            low_open=True),
        outer_momentum=validate.number(self.outer_momentum, "outer_momentum", 0, 1,
                                       high_open=True),
        nesterov=validate.boolean(self.nesterov, "nesterov"))
    for name, value in checked.items():
      object.__setattr__(self, name, value)

  def syncs_after(self, step):
    """Whether an outer step follows inner step ``step`` (0-based; an int or an array)."""
    return (step + 1) % self.sync_every == 0

  def outer_optimizer(self) -> optax.GradientTransformation:
    """The outer SGD of step 5."""
    return optax.sgd(self.outer_learning_rate, momentum=self.outer_momentum or None,
                     nesterov=self.nesterov)


class DiLoCoState(NamedTuple):
  """State of ``diloco``.

  Attributes:
    count: inner steps taken (int32), every step counted; the same on every device.
    outer_params: θ, the parameters of the last outer step, one entry per parameter leaf
      (``optax.MaskedNode()`` for leaves that are not reduced); the same on every device.
    outer_state: the outer SGD's state (its momentum m); the same on every device.
    compressor_state: the compressor's state (``optax.EmptyState()`` without one); it declares its own
      per-device fields (PowerSGD's error feedback).
    inner_state: the inner optimizer's state, with a leading axis of length 1 on every leaf. PER
      DEVICE: each device's optimizer steps on its own gradients.
    config: the static settings.
    signature: the gradient pytree's signature.
  """
  count: jax.Array
  outer_params: tuple
  outer_state: Any
  compressor_state: Any
  inner_state: Any
  config: DiLoCoConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner_state",)  # see jaxcomp.sharding
  PARAMS_PER_DEVICE = True  # the parameters differ between synchronizations


def _mean(compressor: Optional[optax.GradientTransformation], axis_name: axis.AxisName, tree,
          compressor_state) -> tuple:
  """Step 4: ``(mean over the devices of tree's reduced leaves, compressor state)``: one all-reduce
  per dtype, or ``compressor``'s mean."""
  if compressor is None:
    return local_steps.mean_reduced(tree, axis_name), compressor_state
  return compressor.update(tree, compressor_state)


def _outer_step(outer: optax.GradientTransformation, theta: tuple, outer_state,
                mean: tuple) -> tuple:
  """Steps 5–6: ``(θ, outer state)`` after the outer SGD on the mean pseudo-gradient, both kept as
  they were if the new θ is not finite (every input is the same on every device, so the decision
  is too)."""
  updates, new_state = outer.update(mean, outer_state, theta)
  new_theta = optax.apply_updates(theta, updates)
  ok = finite.all_finite(new_theta, None)
  return finite.keep_if_finite(ok, (new_theta, new_state), (theta, outer_state))


def diloco(inner: optax.GradientTransformation, *, sync_every: int,
           outer_learning_rate: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
           compressor: Optional[optax.GradientTransformation] = None,
           axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """DiLoCo: ``sync_every`` local steps of ``inner``, then an outer Nesterov step on the mean drift.

  The module docstring numbers the steps. Every device runs ``inner`` on its own gradient; after
  every ``sync_every``-th step the pseudo-gradients θ − θᵢ are averaged over the devices (through
  ``compressor`` when given), the outer SGD with Nesterov momentum moves θ, and every device is set
  to the new θ.

  It is the whole optimizer: its update needs ``params`` and returns ``jaxcomp.Assign`` updates,
  which ``optax.apply_updates`` and ``nnx.Optimizer`` apply exactly — so the replicas are bitwise
  identical after every outer step. Integer, boolean and zero-size parameters are left as they are.
  Chain nothing after it; put gradient processing into ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
    >>> tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, compressor=jaxcomp.fp16_compress())
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> opt_state, params = dp.make_state(jnp.ones((4, 1))), dp.make_params(jnp.ones((4, 1)))
    >>> x = dp.shard(jnp.linspace(0, 1, 64).reshape(16, 4))  # 2 examples per device
    >>> for _ in range(2):  # H = 2 inner steps apart, then the outer step: the same again
    ...   params, opt_state, loss = dp.step(params, opt_state, x)
    ...   print(bool((np.asarray(params) == np.asarray(params)[0]).all()))
    False
    True

  The parameters differ between outer steps, so they are per device, as for ``jaxcomp.local_sgd``
  (``jaxcomp.data_parallel`` keeps them stacked per device itself: see ``make_params``).

  Args:
    inner: the optimizer each device runs between outer steps (the paper: AdamW).
    sync_every: H, inner steps per outer step.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    outer_learning_rate: η of the outer SGD.
    outer_momentum: μ of the outer SGD; 0 for none.
    nesterov: Nesterov momentum (the paper's) rather than heavy-ball.
    compressor: a jaxcomp transformation that averages the pseudo-gradient over the same axis, e.g.
      ``jaxcomp.fp16_compress()`` or ``jaxcomp.powersgd(4, start_iter=0, error_feedback=False)``
      (its ``start_iter`` counts outer steps; the outer momentum already carries what a step leaves
      out, and error feedback on top of it made DiLoCo much worse in tests/test_diloco_training.py's
      setting); None sends the float32 mean.

  Returns:
    A ``GradientTransformation`` with a ``DiLoCoState``, whose update requires ``params``.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
    Algorithm 1.
  """
  inner = local_steps.check_transformation(inner, "inner", "optax.sgd(0.1, momentum=0.9)")
  if compressor is not None:
    local_steps.check_transformation(compressor, "compressor", "jaxcomp.fp16_compress()")
  config = DiLoCoConfig(sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, nesterov=nesterov)
  axis_name = axis.check_axis_name(axis_name)
  outer = config.outer_optimizer()

  def init_fn(params):
    params = tree_lib.unwrap(params)
    signature = tree_lib.TreeSignature.of(params)
    theta = tuple(jnp.array(x) if tree_lib.is_reduced(x) else optax.MaskedNode()
                  for x in jax.tree.leaves(params))
    return DiLoCoState(
        jnp.zeros([], jnp.int32), theta, outer.init(theta),
        optax.EmptyState() if compressor is None else compressor.init(params),
        local_steps.to_device(inner.init(params)), config, signature)

  def outer_step(state: DiLoCoState, local: list) -> tuple:
    """Steps 3–6: the new parameter leaves, θ, the outer state and the compressor's state."""
    signature, theta = state.signature, state.outer_params
    reduced = {i for i, t in enumerate(theta) if not isinstance(t, optax.MaskedNode)}
    # 3: Δᵢ = θ − θᵢ (leaves that are not reduced pass through the compressor as zeros).
    delta = [jnp.zeros_like(x) for x in local]
    for i in reduced:
      delta[i] = theta[i] - local[i]
    # 4: averaged, through the compressor when there is one.
    mean, compressor_state = _mean(compressor, axis_name, signature.unflatten(delta),
                                   state.compressor_state)
    mean = jax.tree.leaves(mean)
    mean = tuple(mean[i] if i in reduced else optax.MaskedNode() for i in range(len(local)))
    # 5–6: the outer SGD on θ, kept if not finite.
    new_theta, outer_state = _outer_step(outer, theta, state.outer_state, mean)
    params = [new_theta[i] if i in reduced else x for i, x in enumerate(local)]
    return local_steps.varying_like(params, local), new_theta, outer_state, compressor_state

  def update_fn(updates, state: DiLoCoState, params=None):
    state.signature.check(updates)
    params = local_steps.require_params(params, "diloco")
    state.signature.check(params, "params")
    # 1: the inner step on this device.
    local, inner_state = local_steps.local_update(
        inner, updates, local_steps.from_device(state.inner_state), params)
    # 2: the outer step after every H-th inner step.
    new_leaves, theta, outer_state, compressor_state = phases.when(
        state.config.syncs_after(state.count),
        phases.Phase("diloco.sync", 1 / state.config.sync_every),
        lambda leaves, theta, outer_state, compressor_state: outer_step(
            state._replace(outer_params=theta, outer_state=outer_state,
                           compressor_state=compressor_state), leaves),
        jax.tree.leaves(local), state.outer_params, state.outer_state, state.compressor_state)
    new_state = state._replace(count=state.count + 1, outer_params=theta, outer_state=outer_state,
                               compressor_state=compressor_state,
                               inner_state=local_steps.to_device(inner_state))
    return local_steps.assign(tree_lib.like(local, new_leaves)), new_state

  return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------------------ Streaming DiLoCo


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
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
  fragments: int = 1
  delay: int = 0
  mix: float = 0.5

  def __post_init__(self):
    super().__post_init__()
    fragments = validate.integer(self.fragments, "fragments", 1,
                                 static="fixes which parameters synchronize when")
    if fragments > self.sync_every:
      raise ValueError(f"fragments must be at most sync_every ({self.sync_every}): each fragment "
                       f"synchronizes at its own step of the period; got {fragments}. Raise "
                       "sync_every or use fewer fragments")
    delay = validate.integer(self.delay, "delay", 0, static="fixes when a fragment's pieces travel")
    spacing = self.sync_every // fragments
    if delay >= spacing:
      raise ValueError(f"delay must be less than sync_every // fragments = {spacing}, the steps "
                       "between the beginnings of two fragments' exchanges, so that one fragment's "
                       f"exchange ends before the next one's begins; got {delay}. Lower delay, or "
                       "raise sync_every")
    mix = validate.number(self.mix, "mix", 0, 1, low_open=True)
    for name, value in dict(fragments=fragments, delay=delay, mix=mix).items():
      object.__setattr__(self, name, value)

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
    compressor: a jaxcomp transformation that averages the pseudo-gradient over the same axis (the
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
  inner = local_steps.check_transformation(inner, "inner", "optax.adamw(4e-4)")
  if compressor is not None:
    local_steps.check_transformation(compressor, "compressor", "jaxcomp.quantized(8)")
  config = StreamingDiLoCoConfig(sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                                 outer_momentum=outer_momentum, nesterov=nesterov,
                                 fragments=fragments, delay=delay, mix=mix)
  axis_name = axis.check_axis_name(axis_name)
  outer = config.outer_optimizer()

  def init_fn(params):
    params = tree_lib.unwrap(params)
    signature = tree_lib.TreeSignature.of(params)
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
    layout = fragment_layout(signature, config.fragments)
    theta = tuple(x if tree_lib.is_reduced(x) else optax.MaskedNode() for x in leaves)

    def piece_state(fragment: tuple, piece: int):
      held = _in_piece(signature, fragment, config.pieces, piece)
      if not held:
        return optax.EmptyState()
      return compressor.init(_subtree(signature, [fragment[k] for k in held],
                                      [_cut(leaves[fragment[k]], config.pieces, piece)
                                       for k in held]))

    buffers = tuple(tuple(jnp.zeros_like(leaves[i]) for i in f) if config.delay else ()
                    for f in layout)
    return StreamingDiLoCoState(
        jnp.zeros([], jnp.int32), theta, tuple(outer.init(tuple(theta[i] for i in f))
                                               for f in layout),
        tuple(() if compressor is None else tuple(piece_state(f, j) for j in range(config.pieces))
              for f in layout),
        buffers, buffers, local_steps.to_device(inner.init(params)), config, signature)

  def send(state: StreamingDiLoCoState, p: int, piece: int, received: tuple,
           compressor_states: tuple, pending: tuple) -> tuple:
    """S1: ``piece`` of fragment ``p``'s ``pending`` pseudo-gradient averaged into ``received``."""
    fragment, signature = state.layout[p], state.signature
    held = _in_piece(signature, fragment, config.pieces, piece)
    if not held:
      return received, compressor_states, pending
    values = [_cut(pending[k], config.pieces, piece) for k in held]
    tree = _subtree(signature, [fragment[k] for k in held], values)
    mean, piece_state = _mean(compressor, axis_name, tree,
                              compressor_states[piece] if compressor is not None else None)
    received = list(received)
    for k, value in zip(held, jax.tree.leaves(mean)):  # typed as the state holds it
      received[k] = local_steps.varying_like(_paste(received[k], config.pieces, piece, value),
                                             received[k])
    if compressor is not None:
      compressor_states = (compressor_states[:piece] + (piece_state,)
                           + compressor_states[piece + 1:])
    return tuple(received), compressor_states, pending

  def land(state: StreamingDiLoCoState, p: int, received: tuple, local: list, theta: tuple,
           outer_state, compressor_states: tuple) -> tuple:
    """S3–S4 for fragment ``p``: the outer step on its mean pseudo-gradient (averaged here when
    there is no delay), mixed into this device's parameters."""
    mean = received
    if not config.delay:  # S3 with τ = 0: steps 3–4 on this fragment
      delta = [t - x for t, x in zip(theta, local)]
      tree = _subtree(state.signature, state.layout[p], delta)
      mean, piece_state = _mean(compressor, axis_name, tree,
                                compressor_states[0] if compressor is not None else None)
      mean = tuple(jax.tree.leaves(mean))
      if compressor is not None:
        compressor_states = (piece_state,)
    # S3: steps 5–6 on the fragment's θ.
    new_theta, outer_state = _outer_step(outer, theta, outer_state, mean)
    # S4: mixed into this device's parameters.
    mixed = [t if config.mix == 1 else config.mix * t + (1 - config.mix) * x
             for t, x in zip(new_theta, local)]
    return local_steps.varying_like(mixed, local), new_theta, outer_state, compressor_states

  def update_fn(updates, state: StreamingDiLoCoState, params=None):
    state.signature.check(updates)
    params = local_steps.require_params(params, "streaming_diloco")
    state.signature.check(params, "params")
    layout, share = state.layout, 1 / config.sync_every
    received, compressor_states = list(state.received), list(state.compressor_states)
    for p, fragment in enumerate(layout):
      for j in range(config.delay if fragment else 0):
        # S1: the piece of each exchange in flight, from the state alone.
        received[p], compressor_states[p], _ = phases.when(
            config.piece_sent_in(p, state.count) == j,
            phases.Phase(f"streaming_diloco.fragment{p}.piece{j}", share),
            functools.partial(send, state, p, j), received[p], compressor_states[p],
            state.pending[p])
    # S2: the inner step on this device.
    local, inner_state = local_steps.local_update(
        inner, updates, local_steps.from_device(state.inner_state), params)
    leaves = jax.tree.leaves(local)
    theta, outer_states, pending = (list(state.outer_params), list(state.outer_states),
                                    list(state.pending))
    for p, fragment in enumerate(layout):
      if not fragment:
        continue
      # S3–S4: the outer step of a fragment whose exchange is complete, mixed in.
      new_local, new_theta, outer_states[p], compressor_states[p] = phases.when(
          config.applies_after(p, state.count),
          phases.Phase(f"streaming_diloco.fragment{p}", share),
          functools.partial(land, state, p, received[p]),
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
    new_state = state._replace(
        count=state.count + 1, outer_params=tuple(theta), outer_states=tuple(outer_states),
        compressor_states=tuple(compressor_states), pending=tuple(pending),
        received=tuple(received), inner_state=local_steps.to_device(inner_state))
    return local_steps.assign(tree_lib.like(local, leaves)), new_state

  return optax.GradientTransformation(init_fn, update_fn)
