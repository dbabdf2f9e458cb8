"""DiLoCo (and MuLoCo, SparseLoCo: DiLoCo with a ``compressor``; Streaming DiLoCo: with
``fragments``) across processes that goes on when a process dies and takes it back when it
restarts.

Each process is one DiLoCo replica: it runs its inner steps alone, on its own device, and meets the
others only to synchronize, every ``sync_every`` steps, over the processes alive then
(``jaxcomp.Membership`` says who and on which devices). The math is DiLoCo's
(``jaxcomp.DiLoCoConfig``'s outer step); what this module adds is who takes part.

The steps, per process (the ``# n:`` comments below point here):

1. a round over the live processes (``jaxcomp.Membership.next_round``); a process that has not yet
   synchronized (at the start, or restarted) takes part without a pseudo-gradient;
2. in one program over the round's devices: θ and the outer optimizer's state are sent, bit for
   bit, from process 0 (an integer sum of its copy and zeros), so a process that joins receives
   them;
3. the pseudo-gradient θ − θᵢ is averaged over the members that trained this period (weight 1;
   a joining one has weight 0), exactly or through ``compressor`` (MuLoCo's 2-bit exchange: each
   member sends its weighted share, scaled by members ÷ trained, so that the compressor's mean
   over all members is the mean over those who trained), and DiLoCo's outer step moves θ (kept if
   no member trained);
4. the members vote and process 0 decides (``Membership.agree``): if any member failed (died,
   or its collective timed out), every member drops the round's result and tries again with the
   survivors, from the same θ and its own θᵢ;
5. every member writes its own inner optimizer's state to ``checkpoint_dir``, and process 0 θ,
   the outer state and the step (orbax), each in the background and alone
   (``jaxcomp.train.fault_tolerant_checkpoints``);
6. every member sets its parameters to θ and trains ``sync_every`` inner steps on its own data; a
   process that joined takes its inner optimizer's state from its own checkpoint of this step, or
   starts it afresh with a warning naming it where there is none.

With P ``fragments`` (Streaming DiLoCo's, ``jaxcomp.fragment_layout``; without overlap, mixing 1)
a round every ``sync_every // P`` inner steps runs steps 1–6 on one fragment of the parameters,
each fragment in turn with its own outer state and compressor state, so it sends 1/P of θ; in
step 6 a member sets that fragment of its parameters to θ and keeps the rest. A round that a
process joins (``Round.joining``) also sends it the other fragments (their programs with every
weight 0: θ and the outer state, unchanged), and it sets all of its parameters to θ.

After each round that counted, every member compiles in the background the programs of the
memberships one death or one return away (``Programs``), so that the survivors of a death, and the
members taking a process back, wait for no compilation: a restarted process loads the binaries its
earlier life compiled (its inner step, and the programs of the memberships it was one death away
from), kept in the coordination service's store.

A process that dies loses its current period's inner steps; the survivors lose nothing. Process 0
hosts the coordination service: when it dies, every process ends with one line on stderr, and a
restart of the job (on any number of processes) resumes from the last synchronization's
checkpoint: each process whose id the job had takes back its inner optimizer's state, a new one
starts it afresh, with a warning, and the states of ids the restarted job lacks are left unused.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp.train import fault_tolerant_checkpoints as checkpoints

log = logging.getLogger(__name__)
SOURCE = 0  # the process θ is sent from: it hosts the coordination service, so it never rejoins
LOST = (f"the coordination service on process {SOURCE} is gone (process {SOURCE} died, or cannot "
        f"be reached)")


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               heartbeat_timeout_seconds: int = 10, collective_timeout_seconds: int = 30) -> None:
  """``jax.distributed.initialize`` for ``train``, before any other use of JAX: with
  ``jax_enable_recoverability`` and a bounded collective; and when process 0, which hosts the
  coordination service, dies, every other process ends with one line on stderr and exit status
  1, in place of JAX's abort with a stack trace (``jaxcomp.Membership.one_line_on_service_loss``
  says how).

  Args:
    coordinator_address, num_processes, process_id: ``jax.distributed.initialize``'s.
    heartbeat_timeout_seconds: how long the service waits for a silent process before dropping it
      from the synchronizations (a process that dies is usually noticed sooner, by its closed
      connection).
    collective_timeout_seconds: how long a synchronization's collective waits for a member that
      hangs (XLA:CPU's ``--xla_cpu_collective_timeout_seconds``; gloo's default is 1,800 s); more
      than the members take to reach a synchronization one after another, a compilation
      included, and less than ``train``'s ``vote_timeout``.
  """
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_cpu_collective_timeout_seconds={collective_timeout_seconds}")
  if process_id != SOURCE:
    jaxcomp.Membership.one_line_on_service_loss(
        f"jaxcomp.train.fault_tolerant: process {process_id} stops: {LOST}; the job cannot go on "
        f"without process {SOURCE}: restart every process, and train(checkpoint_dir=...) resumes "
        f"from the last synchronization's checkpoint")
  jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds)


class Synced(NamedTuple):
  """What every member holds after a round that counted.

  Attributes:
    step: the job's step count.
    members: the process ids that took part.
    fragment: the fragment of the parameters whose outer step the round took (0 with one).
    theta: θ, the parameters after the last outer step of each fragment.
    outer_state: the outer optimizer's state of each fragment, a list.
  """
  step: int
  members: tuple
  fragment: int
  theta: object
  outer_state: list


def digest(tree) -> str:
  """A SHA-256 of ``tree``'s leaves' bytes, to compare processes' copies bit for bit."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()


def _broadcast(x, is_source):
  """The source's ``x``, bit for bit, on every device: an integer sum of its bits and zeros."""
  if x.dtype.itemsize != 4:
    raise TypeError(f"fault_tolerant: θ and the outer state must have 4-byte leaves, got {x.dtype}")
  bits = lax.bitcast_convert_type(x, jnp.int32)
  bits = lax.psum(jnp.where(is_source, bits, jnp.zeros_like(bits)), "replica")
  return lax.bitcast_convert_type(bits, x.dtype)


@functools.lru_cache(maxsize=None)
def _sync_program(config: jaxcomp.DiLoCoConfig, devices: tuple) -> Callable:
  """Steps 2–3 over ``devices``, one per member, as one jitted program: ``(θ, outer state,
  θᵢ, weight, is_source, compressor state) -> (θ, outer state, compressor state)``."""
  mesh = Mesh(np.asarray(devices), ("replica",))

  def body(theta, outer_state, local, weight, is_source, compressor_state):
    theta, outer_state, local, compressor_state = jax.tree.map(
        lambda x: x[0], (theta, outer_state, local, compressor_state))
    weight, is_source = weight[0], is_source[0]
    # 2: θ and the outer state from the source, bit for bit.
    theta, outer_state = jax.tree.map(lambda x: _broadcast(x, is_source), (theta, outer_state))
    # 3: the mean pseudo-gradient of those who trained, then DiLoCo's outer step; kept if nobody
    # trained.
    trained = lax.psum(weight, "replica")
    if config.compressor is None:
      mean = jax.tree.map(lambda t, x: lax.psum(weight * (t - x), "replica")
                          / jnp.maximum(trained, 1), theta, local)
    else:
      share = weight * lax.axis_size("replica") / jnp.maximum(trained, 1)
      mean, compressor_state = config.compressor.update(
          jax.tree.map(lambda t, x: share * (t - x), theta, local), compressor_state)
    new = config.outer_step(theta, outer_state, mean)
    kept = jax.tree.map(lambda n, o: jnp.where(trained > 0, n, o), new, (theta, outer_state))
    return *kept, jax.tree.map(lambda x: x[None], compressor_state)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("replica"),
                               out_specs=(P(), P(), P("replica")), check_vma=False))


def _on_mesh(tree, devices: tuple):
  """This process's ``tree`` as the local row of global arrays over ``devices``."""
  mine = next(d for d in devices if d.process_index == jax.process_index())
  sharding = NamedSharding(Mesh(np.asarray(devices), ("replica",)), P("replica"))

  def put(x):
    x = jnp.asarray(x)
    return jax.make_array_from_single_device_arrays(
        (len(devices),) + x.shape, sharding, [jax.device_put(x[None], mine)])
  return jax.tree.map(put, tree)


def _local(tree):
  """This process's copy of replicated global arrays, on its first device."""
  return jax.tree.map(lambda x: jax.device_put(x.addressable_shards[0].data,
                                               jax.local_devices()[0]), tree)


class Exchange(NamedTuple):
  """This process's state of the compressor (``optax.EmptyState()`` without one) and the members
  it was made for: a compressor's state (its error feedback, its rows) holds for one list of
  members, so every member starts it afresh when the list changes."""
  members: tuple
  state: object


def _exchange(config: jaxcomp.DiLoCoConfig, members: tuple, devices: tuple,
              exchange: Exchange | None, theta) -> Exchange:
  """``exchange`` if it was made for ``members``, else a fresh one for them (on ``devices``)."""
  if exchange is not None and exchange.members == members:
    return exchange
  if config.compressor is None:
    return Exchange(members, optax.EmptyState())
  with jax.set_mesh(Mesh(np.asarray(devices), ("replica",))):  # its axis's size
    state = config.compressor.init(theta)
  return Exchange(members, _local(state))


class Programs:
  """This process's compiled synchronization programs (steps 2–3), one per list of devices and
  fragment.

  After a round that counted, the programs of the memberships one death or one return away
  (``Round.ahead``) that take this process are compiled in the background, one at a time, so that
  a membership change waits for no compilation; a restarted process loads the binaries of its
  earlier life (``_compiled``). Each process compiles its own: XLA:CPU's binaries, and JAX's
  cache keys, are per process.
  """

  def __init__(self, config: jaxcomp.DiLoCoConfig, client):
    self.config, self.client = config, client
    self._compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._compiled = {}

  def _compile(self, members: tuple, devices: tuple, fragment: int, theta, outer_state):
    state = _exchange(self.config, members, devices, None, theta).state
    return _compiled(self.client, _sync_program(self.config, devices).lower(*_on_mesh(
        (theta, outer_state, theta, np.float32(1), np.bool_(False), state), devices)), devices,
        f"the synchronization of fragment {fragment} over processes {members}")

  def prepare(self, members: tuple, devices: tuple, fragment: int, theta, outer_state) -> None:
    """Starts compiling the program of ``fragment`` over ``devices`` for its θ and outer
    state's shapes."""
    if (devices, fragment) not in self._compiled:
      self._compiled[devices, fragment] = self._compiler.submit(
          self._compile, members, devices, fragment, theta, outer_state)

  def get(self, members: tuple, devices: tuple, fragment: int, theta, outer_state):
    """The program of ``fragment`` over ``devices``, compiled now if it was not prepared."""
    self.prepare(members, devices, fragment, theta, outer_state)
    return self._compiled[devices, fragment].result()

  def close(self) -> None:
    """Drops the compilations not started."""
    self._compiler.shutdown(wait=False, cancel_futures=True)


class Fragments(NamedTuple):
  """The parameters' fragments (Streaming DiLoCo's, ``jaxcomp.fragment_layout``): each fragment's
  leaf indices, and the parameters' tree structure."""
  layout: tuple
  structure: object

  @classmethod
  def of(cls, params, fragments: int, sync_every: int | None = None) -> "Fragments":
    """``fragments`` fragments of ``params``; one holds them all.

    Raises:
      ValueError: ``fragments`` does not divide ``sync_every`` (each fragment synchronizes once
        per period), or a fragment would hold no leaf.
    """
    if not isinstance(fragments, int) or fragments < 1 or (
        sync_every is not None and sync_every % fragments):
      raise ValueError(f"fragments must be a positive integer that divides sync_every "
                       f"({sync_every}), so that every fragment synchronizes once per period; "
                       f"got {fragments!r}")
    layout = jaxcomp.fragment_layout(jaxcomp.TreeSignature.of(params), fragments)
    leaves = jax.tree.leaves(params)
    if any(not f for f in layout) or sorted(i for f in layout for i in f) != list(
        range(len(leaves))):
      raise ValueError(f"fragments: {fragments} fragments of these parameters would leave one "
                       f"empty, or a leaf in none (layout {layout} of {len(leaves)} leaves): "
                       "use fewer fragments")
    return cls(layout, jax.tree.structure(params))

  def pieces(self, tree) -> list:
    """``tree``'s leaves, a list per fragment."""
    leaves = jax.tree.leaves(tree)
    return [[leaves[i] for i in fragment] for fragment in self.layout]

  def whole(self, pieces) -> object:
    """The tree of ``pieces`` (``pieces``'s inverse)."""
    leaves = [None] * self.structure.num_leaves
    for fragment, values in zip(self.layout, pieces):
      for i, value in zip(fragment, values):
        leaves[i] = value
    return jax.tree.unflatten(self.structure, leaves)

  def due(self, step: int, period: int) -> int:
    """The fragment whose outer step the synchronization after inner step ``step`` takes: each
    in turn, every ``period`` steps."""
    return max(step // period - 1, 0) % len(self.layout)


def synchronize(rounds: jaxcomp.Membership, programs: Programs, fragments: Fragments,
                fragment: int, step: int, theta, outer_states: list, local,
                exchanges: list | None = None,
                on_round: Callable = lambda this_round: None) -> tuple[Synced, list]:
  """Steps 1–4 for ``fragment``: rounds until one counts. ``local`` is this process's θᵢ, or
  None if it has not trained since it (re)joined; ``exchanges``, each fragment's compressor state
  of the last round that counted (None: none yet); ``on_round`` is called with each round before
  its collectives. A round with a process joining also sends it the other fragments' θ and outer
  state (their programs with every weight 0). Returns the round's result and the compressor
  states after it, and has the programs of the rounds likely next compiled in the background."""
  config, count = programs.config, len(fragments.layout)
  exchanges = exchanges or [None] * count
  thetas, locals_ = fragments.pieces(theta), fragments.pieces(theta if local is None else local)
  while True:
    this_round = rounds.next_round(step)  # 1
    on_round(this_round)
    run = range(count) if this_round.joining else [fragment]
    new_thetas, new_states, new_exchanges = list(thetas), list(outer_states), list(exchanges)
    try:
      for q in run:
        program = programs.get(this_round.members, this_round.devices, q, thetas[q],
                               outer_states[q])
        before = _exchange(config, this_round.members, this_round.devices, exchanges[q],
                           thetas[q])
        weight = np.float32(local is not None and q == fragment)
        theta_out, state_out, compressor_state = _local(program(*_on_mesh(
            (thetas[q], outer_states[q], locals_[q], weight,
             np.bool_(jax.process_index() == SOURCE), before.state), this_round.devices)))
        compressor_state = jax.tree.map(lambda x: x[0], compressor_state)  # this member's row
        jax.block_until_ready((theta_out, state_out, compressor_state))
        new_thetas[q], new_states[q] = theta_out, state_out
        # Another fragment's round only sent θ: its exchange state stays as it was.
        new_exchanges[q] = (Exchange(this_round.members, compressor_state) if q == fragment
                            else before)
      ok = True
    except jax.errors.JaxRuntimeError as e:  # a member died: a closed connection, or the timeout
      log.warning("round %d over processes %s failed: %s", this_round.number,
                  this_round.members, str(e).splitlines()[0])
      ok = False
    if rounds.agree(this_round, ok):  # 4
      for members, devices in this_round.ahead:
        if jax.process_index() in members:
          for q in range(count):
            programs.prepare(members, devices, q, new_thetas[q], new_states[q])
      return (Synced(this_round.step, this_round.members, fragment,
                     fragments.whole(new_thetas), new_states), new_exchanges)
    log.warning("round %d over processes %s did not count; retrying over the live ones",
                this_round.number, this_round.members)


def train(loss_fn: Callable, params, batch: Callable, *, inner: optax.GradientTransformation,
          sync_every: int, steps: int, outer_learning_rate: float = 0.7,
          outer_momentum: float = 0.9, nesterov: bool = True,
          compressor: optax.GradientTransformation | None = None, fragments: int = 1,
          vote_timeout: float = 60.0,
          checkpoint_dir: str | None = None, on_round: Callable = lambda this_round: None,
          on_sync: Callable = lambda synced: None) -> Synced:
  """Fault-tolerant DiLoCo of this process, until the job's step count reaches ``steps``.

  Call it in every process after ``initialize``; a restarted process calls it again and joins at
  the next synchronization. The module docstring numbers the steps.

  Args:
    loss_fn: ``loss_fn(params, *batch) -> scalar``.
    params: the initial parameters, the same in every process. Process 0's are the ones used:
      the others may pass their shapes (``jax.eval_shape`` of the initializer), which spares a
      restarted process, and the members waiting for it, the initializer's time.
    batch: ``batch(step) -> tuple`` of this process's data for inner step ``step``.
    inner: the inner optimizer; sync_every: H; steps: the job's step count.
    outer_learning_rate, outer_momentum, nesterov: DiLoCo's outer SGD (``jaxcomp.diloco``).
    compressor: a jaxcomp compressor over ``"replica"`` that averages the pseudo-gradient, e.g.
      MuLoCo's ``jaxcomp.quantized(2, error_decay=0.9, axis_name="replica")`` (with a Muon
      ``inner``), or SparseLoCo's ``jaxcomp.chunked_topk(64, bits=2, error_decay=0.95,
      axis_name="replica")`` (with ``outer_momentum=0``, ``outer_learning_rate=1``); None: the
      exact mean. Its state (error feedback) is this process's, kept from
      one synchronization to the next while the members stay the same, started afresh by every
      member when they change, and not checkpointed.
    fragments: P, Streaming DiLoCo's fragments (``jaxcomp.fragment_layout``): a synchronization
      every ``sync_every // fragments`` inner steps takes the outer step of one fragment, in
      turn, so it sends 1/P of the parameters; each fragment keeps its own outer state and
      compressor state. A process that joins receives every fragment; the others take the
      synchronized fragment's θ and keep what they learned of the others. 1: DiLoCo.
    vote_timeout: seconds process 0 waits for a member's vote after a round's collective.
    checkpoint_dir: where process 0 writes θ, the outer state and the step after every round
      that counted, and resumes from the newest one at the start (the others receive it at the
      first synchronization, so any number of processes resumes); and where every process writes
      its inner optimizer's state (``inner/process_<id>``), which it takes back when it joins at
      a step it has one of. None: no checkpoints.
    on_round: called with each round (``jaxcomp.Membership.next_round``'s) before its
      collectives: who takes part, on which devices, at which step.
    on_sync: called with the ``Synced`` result of every round that counted.

  Returns:
    The last round's result.
  """
  if compressor is not None and getattr(compressor, "axis_name", None) != "replica":
    raise ValueError(f"compressor: fault_tolerant.train synchronizes over 'replica'; got a "
                     f"compressor over {getattr(compressor, 'axis_name', None)!r}: pass "
                     "axis_name='replica' to it")
  config = jaxcomp.DiLoCoConfig(inner=inner, sync_every=sync_every,
                                outer_learning_rate=outer_learning_rate,
                                outer_momentum=outer_momentum, nesterov=nesterov,
                                compressor=compressor)
  rounds = jaxcomp.Membership(vote_timeout=vote_timeout)
  programs = Programs(config, rounds.client)
  grad_step = jax.jit(lambda p, s, *b: _inner_step(loss_fn, config.inner, p, s, *b))
  theta = jax.device_put(jax.tree.map(_value, params), jax.local_devices()[0])
  parts, period = Fragments.of(theta, fragments, sync_every), sync_every // fragments
  outer_state = [config.outer_optimizer().init(piece) for piece in parts.pieces(theta)]
  local, inner_state, inner_step, exchange, step = None, None, None, None, 0
  outer_checkpoints = inner_states = None
  if checkpoint_dir is not None:
    inner_states = checkpoints.InnerStates(checkpoint_dir)
    if jax.process_index() == SOURCE:
      outer_checkpoints = checkpoints.outer(checkpoint_dir, SOURCE)
      step, theta, outer_state = checkpoints.resume(outer_checkpoints, step, theta, outer_state)
  saved = outer_checkpoints.latest_step() if outer_checkpoints else None  # the step resumed from
  while True:
    synced, exchange = synchronize(rounds, programs, parts, parts.due(step, period), step, theta,
                                   outer_state, local, exchange, on_round)  # 1-4
    on_sync(synced)
    theta, outer_state, step = synced.theta, synced.outer_state, synced.step
    if inner_state is None:  # 6 (first half): a process that joined, its inner state
      inner_state = checkpoints.inner_state(inner_states, step, config.inner.init(theta))
    if inner_states:  # 5: the inner state first: a step with θ's checkpoint has them too
      inner_states.save(step, inner_state)
    if outer_checkpoints and step != saved:
      outer_checkpoints.save(step, args=checkpoints.orbax().args.StandardSave(
          jax.tree.map(np.asarray, {"theta": theta, "outer_state": outer_state})))
      saved = step
    if step >= steps:
      if outer_checkpoints:
        outer_checkpoints.wait_until_finished()
        outer_checkpoints.close()
      if inner_states:
        inner_states.close()
      programs.close()
      rounds.finish()
      return synced
    # 6: a period of inner steps from θ (of the fragment synchronized; of all of them for a
    # process that joined).
    if local is None:
      local = theta
    else:
      pieces = parts.pieces(local)
      pieces[synced.fragment] = parts.pieces(theta)[synced.fragment]
      local = parts.whole(pieces)
    for _ in range(period):
      data = batch(step)
      if inner_step is None:
        inner_step = _inner_program(rounds.client, grad_step, local, inner_state, *data)
      local, inner_state, loss = inner_step(local, inner_state, *data)
      jax.block_until_ready(loss)
      step += 1


def _value(leaf):
  """``leaf``, or zeros where it is a ``jax.ShapeDtypeStruct`` (process 0 sends θ)."""
  if not isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  if jax.process_index() == SOURCE:
    raise TypeError(f"params: process {SOURCE} sends θ to the others, so it needs the values of "
                    f"the initial parameters, got a shape ({leaf}): pass the initializer's "
                    "result there")
  return np.zeros(leaf.shape, leaf.dtype)


def _inner_program(client, grad_step, *args) -> Callable:
  """``grad_step`` compiled for ``args`` (``_compiled``); arguments of other shapes than the
  first's are left to ``grad_step`` itself."""
  compiled = _compiled(client, grad_step.lower(*args), jax.local_devices()[:1], "its inner step")

  def run(*args):
    try:
      return compiled(*args)
    except TypeError:  # other shapes or dtypes than the first step's
      return grad_step(*args)
  return run


def _compiled(client, lowered, devices: list, name: str):
  """``lowered`` compiled for ``devices``; its binary is kept in the coordination service's store
  under this process's id and the program's hash, so that a restarted process loads what its
  earlier life compiled (the others would wait for its compilation)."""
  from jax.experimental import serialize_executable
  key = (f"fault_tolerant/binary/{jax.process_index()}/"
         f"{hashlib.sha256(lowered.as_text().encode()).hexdigest()}/{[d.id for d in devices]}")
  try:
    stored = client.key_value_try_get_bytes(key)
  except jax.errors.JaxRuntimeError:  # not compiled yet in this job
    compiled = lowered.compile()
    client.key_value_set_bytes(key, serialize_executable.serialize(compiled)[0])
    return compiled
  log.warning("process %d: %s loaded from its earlier life's binary", jax.process_index(), name)
  return serialize_executable.deserialize_and_load(stored, lowered.in_tree, lowered.out_tree,
                                                   execution_devices=devices)


def _inner_step(loss_fn, inner, params, state, *batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
  updates, state = inner.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss
