"""jit-first data parallelism: a loss function (or a per-device step) and a ``Mesh`` → one jitted
step.

Under plain ``jax.jit`` with a batch sharded over a mesh axis, the SPMD partitioner averages the
gradient itself, in full precision, before any optimizer sees it: a compressor has nothing left to
compress. ``data_parallel`` builds the step that lets it work, from what a jit user already has:

1. ``jax.shard_map`` over the data axis, so each device computes the gradient of its own shard of
   the batch and the compressor's collectives are the step's only gradient traffic;
2. the gradient is taken of ``lax.pcast(params, axis, to="varying")``, a per-device copy: taken of
   the replicated parameters, autodiff would insert a full float32 all-reduce of it (the transpose
   of the implicit ``pvary``), which ``jaxcomp.comm_report`` would show;
3. the state's specs come from ``jaxcomp.per_device_mask``: per-device leaves (error feedback,
   momenta, accumulators) are stored as ``jax.pmap`` stores them, stacked along a new leading axis
   of size W and sharded along it (which also holds 0-d leaves), the rest replicated; ``make_state``
   creates them that way;
4. the batch is sharded along its leading axis over the data axis (``shard`` places it);
5. meshes from ``jax.make_mesh`` work with Explicit or Auto axes: inside the step every axis but the
   data axis is left to the partitioner (Auto), so the model code that works under ``jit`` works
   here, and what the step returns has the shardings its inputs had. On a 2-D mesh the compressor
   averages over the data axis only; parameters may be sharded along the others.

The loss form takes a Flax NNX model as the parameters (with its ``nnx.Optimizer`` as the optimizer
state). The step splits the model into the parameters the optimizer updates (its ``wrt``) and the
other Variables, takes the gradient of a per-device copy of the former (2 above), and writes back
what the forward pass writes in the latter — BatchNorm statistics, RNG counters — which differ from
device to device: by the ``buffers`` policy their mean or device 0's, the same on every device, or
kept per device, stacked like per-device optimizer state. Flax is the caller's dependency, not
jaxcomp's: ``flax.nnx`` is looked up where the caller imported it.

``shard_map`` runs with ``check_vma=True``: a value that differs from device to device but would be
returned as replicated — parameters a transformation did not average (``optax.masked`` around a
compressor, a hook that does not communicate), a per-device state leaf no state declares — is an
error naming the leaf, never a silent drift.

Optimizers that let the parameters differ between synchronizations — ``jaxcomp.local_sgd`` and
``jaxcomp.diloco``, whose states declare ``PARAMS_PER_DEVICE`` — need the parameters per device too.
The loss-function form reads the declaration from the optimizer state and keeps the parameters the
way it keeps per-device state leaves: stacked along a leading axis of W, sharded along it
(``make_params`` places them so); the per-device-step form is told by the state, where the
parameters are wrapped in ``jaxcomp.PerDevice``. The step returns them stacked, one copy per
device: the copies are bitwise identical right after a synchronization and differ in between. A
state without the declaration keeps replicated parameters, as before; parameters left replicated
under such an optimizer are refused (they differ from device to device), and parameters not
stacked are refused by shape — never averaged or reduced to one device's copy behind your back.

In a job of several processes (``jax.process_count() > 1``) every process must start from the
same state, as PyTorch DDP makes sure by broadcasting rank 0's at construction. The
per-device-step form's ``make_state`` does the same: every leaf of the state it is given becomes
process 0's (``jaxcomp.broadcast_replicated``'s mechanics, per-device leaves included: before
they are stacked they are one device's start). The loss-function form cannot replace the
parameters the caller keeps, so ``make_state`` and ``make_params`` check them
(``jaxcomp.check_replicated``) and raise ``ReplicaMismatchError`` naming the first leaf that
differs; ``params = jaxcomp.broadcast_replicated(params)`` before them is the fix. Leaves already
sharded over the mesh (a global ``jax.Array``, one value by construction) are left as they are.

Sharded optimizer state (ZeRO-1/2): with ``tx=jaxcomp.sharded_optimizer(exchange, optimizer)``
each device keeps 1/W of the optimizer's state and updates its shard of the parameters, between a
reduce-scatter of the gradient and an all-gather of the update (``jaxcomp._src.zero``). Nothing in
the step changes for it: its state declares those shards per device, so they are stored as
per-device leaves are, stacked along a leading axis of W and sharded along it — the global array of
a shard is its leaf, padded and rearranged — and ``make_state`` makes that state on every device
(each cuts its own shards) instead of stacking copies of one device's.

The interface is small on purpose (other parts of jaxcomp build on it): ``make_state`` (the state,
placed), ``make_params`` (the parameters of the loss-function form, placed), ``step`` (the jitted
global step), ``shard`` (a batch, placed) and ``shardings`` (of a state, e.g. as an orbax restore
target).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import optax
from jax.sharding import Mesh

from jaxcomp._src import axis, hierarchical, misuse, nnx_step, placement, spmd, validate

_LOSS_FORM = ("params", "opt_state")
BUFFER_POLICIES = ("mean", "first", "per_device")


def _loss_step(loss_fn, tx, axes, has_aux, buffers, params, opt_state, *batch):
  """The per-device step of the loss-function form: local gradient, compressed mean, update."""
  if nnx_step.is_module(params) or nnx_step.is_optimizer(opt_state):
    return nnx_step.loss_step(loss_fn, tx, axes, has_aux, buffers, params, opt_state, *batch)
  # 2: no hidden all-reduce of the gradient (per-device parameters already are a per-device copy).
  local_params = jax.tree.map(lambda p: axis.make_varying(p, axes), params)
  value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local_params, *batch)
  extra = {}
  if misuse.takes_the_loss(opt_state):  # optax.contrib.reduce_on_plateau: the devices' mean loss
    extra["value"] = axis.mean(value[0] if has_aux else value, axes)
  updates, opt_state = tx.update(grads, opt_state, params, **extra)
  return optax.apply_updates(params, updates), opt_state, value


def data_parallel(fn: Callable, mesh: Mesh, *, axis_name: axis.AxisName = "batch",
                  tx: Optional[placement.Optimizer] = None, has_aux: bool = False,
                  buffers: str = "mean",
                  donate: bool = False) -> placement.DataParallel:
  """A jitted data-parallel training step for a jaxcomp optimizer, from a function and a ``Mesh``.

  Two forms. With ``tx``, ``fn`` is the loss, ``fn(params, *batch) -> loss`` (or ``(loss, aux)``
  with ``has_aux``) on one device's shard of the batch, and the step is
  ``step(params, opt_state, *batch) -> (params, opt_state, loss)``::

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    tx = optax.chain(jaxcomp.powersgd(rank=2), optax.adamw(1e-3))
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x, y)))

  The parameters may be a Flax NNX model, ``fn(model, *batch)``; the optimizer state is then its
  ``nnx.Optimizer``::

    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    optimizer = dp.make_state(model)        # nnx.Optimizer(model, tx, wrt=nnx.Param), placed
    model, optimizer, loss = dp.step(model, optimizer, *dp.shard((x, y)))

  The gradient is taken of a per-device copy of the parameters, and every other Variable the
  forward pass writes — BatchNorm's running statistics, the RNG counters of Dropout, any Variable —
  is written back into the model. Each device computes them from its own shard, so they differ
  from device to device; ``buffers`` says what they become:

  * ``"mean"`` (the default): their mean over the devices, one all-reduce per dtype per step
    (``jaxcomp.sync_buffers``). With equal shards the running mean is the one a single device
    would keep for the whole batch (the running variance misses the spread between the shards'
    means), and the model stays one model, identical everywhere: ready to evaluate and save.
    Floating-point Variables only: an integer one that differs from device to device is refused.
  * ``"first"``: device 0's, PyTorch DDP's ``broadcast_buffers`` (from 1/W of the batch).
  * ``"per_device"``: each device keeps its own, stacked along a leading axis of W like per-device
    optimizer state (``make_params`` stacks them), at no communication; pick a copy (``x[0]``) or
    reduce them yourself to evaluate.

  A Variable that comes back identical on every device (an RNG counter, which advances alike) is
  left as it is; a parameter (a Variable the optimizer's ``wrt`` selects) that the forward pass
  writes is refused, since the optimizer computes those. Each device draws its own random numbers
  (dropout masks): the streams' keys are folded with the device's index for the forward pass, and
  kept unchanged. Under ``local_sgd`` or ``diloco`` the whole model is per device, these Variables
  too.

  Without ``tx``, ``fn`` is a per-device step written as for ``jax.pmap`` — ``fn(state, *batch) ->
  (state, out)``, with ``tx.update`` inside it as the cross-device mean — and the step is
  ``step(state, *batch) -> (state, out)``. ``state`` is any pytree (``(params, opt_state)``, a Flax
  ``(model, nnx.Optimizer)``); take gradients of ``lax.pcast(params, axis_name, to="varying")``,
  as the loss form does for you. The gradient of the replicated parameters themselves is already
  summed over the devices (autodiff's transpose of their implicit ``pvary`` is a float32
  ``psum``): the compressor then averages a sum, and the update is W times too large. Of an nnx
  model, ``pcast`` makes a copy, and what the forward pass writes in it is lost: use the loss form.

  ``jaxcomp.local_sgd`` and ``jaxcomp.diloco`` move each device's parameters on its own between
  synchronizations, so the parameters are per device: stacked along a leading axis of W (one copy
  per device), sharded over ``axis_name``. The step takes and returns them so, and the copies are
  bitwise identical right after every synchronization (any one copy is then *the* parameters,
  e.g. ``jax.tree.map(lambda p: np.asarray(p)[0], params)``) and differ in between. Loss-function
  form::

    tx = jaxcomp.local_sgd(optax.sgd(0.1, momentum=0.9), sync_every=8)
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)       # from the parameters of one device
    params = dp.make_params(params)         # stacked: (W, ...) per leaf
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x, y)))

  Per-device-step form: wrap the parameters in ``jaxcomp.PerDevice`` in the state
  (``(jaxcomp.PerDevice(params), opt_state)``, ``(jaxcomp.PerDevice(model), optimizer)``); inside
  the step they are this device's own copy, already varying, so take the gradient of them directly
  (no ``pcast``). Left replicated, they are refused with an error naming them.

  Models that fill the devices shard the optimizer state over them (ZeRO-1/2): with
  ``tx=jaxcomp.sharded_optimizer(exchange, optimizer)`` in place of ``optax.chain(exchange,
  optimizer)`` each device keeps 1/W of the optimizer's state, receives its shard of the mean
  gradient (a reduce-scatter through the compressor ``exchange``) and updates that shard of the
  parameters, which are all-gathered (loss-function form, arrays as the parameters)::

    tx = jaxcomp.sharded_optimizer(jaxcomp.bf16_compress(), optax.adamw(1e-3),
                                   gather_dtype="bfloat16")
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)       # made on every device: each keeps its own shards

  In a job of several processes ``make_state`` starts every process from process 0's state (see
  ``DataParallel.make_state``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.quantized(8), optax.sgd(0.1))
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> params = jnp.ones((4, 1))
    >>> opt_state = dp.make_state(params)
    >>> params, opt_state, loss = dp.step(params, opt_state, dp.shard(jnp.ones((16, 4))))
    >>> params.shape, loss.shape  # the parameters, and one loss per device
    ((4, 1), (8,))

  Args:
    fn: the loss (with ``tx``) or the per-device step (without).
    mesh: the device mesh; its other axes (a model axis, say) are left to the partitioner.
    axis_name: the mesh axis (or tuple of axes) the batch is split over; it must be the
      ``axis_name`` of the jaxcomp transformations in the optimizer.
    tx: the optimizer, normally ``optax.chain(<jaxcomp compressor>, <optax optimizer>)``, or
      ``jaxcomp.sharded_optimizer(<jaxcomp compressor>, <optax optimizer>)`` to shard its state;
      an ``optax.MultiSteps`` too.
    has_aux: ``fn`` returns ``(loss, aux)`` (loss-function form only).
    buffers: ``"mean"``, ``"first"`` or ``"per_device"``: what an nnx model's Variables that the
      forward pass writes become (loss-function form; see above).
    donate: donate the state to the step (the parameters and the optimizer state, or the
      per-device step's state): their buffers are reused for the results, so a step holds one
      copy of them, not two, and the arrays passed in must not be used again. On CPU devices it is
      ignored (``donated``): XLA:CPU's in-process all-reduce (jaxlib 0.10.2) crashes on a donated
      step with collectives.

  Returns:
    A ``DataParallel``: ``step``, ``make_state``, ``make_params``, ``shard``, ``shardings``.

  Raises:
    TypeError: ``mesh`` is not a ``Mesh``, ``tx`` not an optax transformation, or ``donate`` not a
      bool.
    ValueError: ``axis_name`` is not an axis of ``mesh``, or puts the exchange on the fast axis of
      a mesh with an axis between nodes (``jaxcomp.hierarchical``); ``has_aux`` or ``buffers``
      given without ``tx``; ``buffers`` is not a policy above.
  """
  validate.function(fn, "fn", "fn(params, *batch)" if tx is not None else "fn(state, *batch)")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)); got "
                    f"{type(mesh).__name__}")
  axis_name = axis.check_axis_name(axis_name)
  missing = [a for a in spmd.axes(axis_name) if a not in mesh.axis_names] if axis_name else [None]
  if missing:
    raise ValueError(f"axis_name must name axes of the mesh {tuple(mesh.axis_names)}; got "
                     f"{axis_name!r}")
  hierarchical.refuse_wrong_axes(mesh, axis_name, tx)
  has_aux = validate.boolean(has_aux, "has_aux")
  buffers = validate.choice(buffers, "buffers", BUFFER_POLICIES)
  donate = validate.boolean(donate, "donate")
  axes = spmd.axes(axis_name)
  if tx is None:
    if has_aux:
      raise ValueError("has_aux applies to a loss function, with tx; a per-device step returns "
                       "(state, out)")
    if buffers != "mean":
      raise ValueError(f"buffers applies to a loss function of an nnx model, with tx; got "
                       f"buffers={buffers!r} for a per-device step, which keeps its model state "
                       "itself (jaxcomp.sync_buffers)")
    step = functools.partial(spmd.global_step, functools.partial(nnx_step.warn_if_lost, fn),
                             mesh, axes, ("state",), placement.step_form_masks)
  else:
    # optax.MultiSteps is a class with init and update, not a GradientTransformation.
    if not isinstance(tx, (optax.GradientTransformation, optax.MultiSteps)):
      raise TypeError(f"tx must be an optax.GradientTransformation (or optax.MultiSteps); got "
                      f"{type(tx).__name__}")
    local = functools.partial(_loss_step, fn, tx, axes, has_aux, buffers)
    step = functools.partial(spmd.global_step, local, mesh, axes, _LOSS_FORM,
                             functools.partial(placement.loss_form_masks, buffers))
  states = len(_LOSS_FORM) if tx is not None else 1
  jitted = jax.jit(step, donate_argnums=tuple(range(states)) if donated(mesh, donate) else ())
  return placement.DataParallel(spmd.OnMesh(jitted, mesh), mesh, axis_name, tx, buffers)


def donated(mesh: Mesh, donate: bool) -> bool:
  """Whether a step over ``mesh`` donates its state when asked to (``donate``).

  Not on CPU devices: XLA:CPU (jaxlib 0.10.2) segfaults in its in-process all-reduce
  (InProcessCommunicator's ReduceScatter<F32> reads a null buffer) when the step donates its
  inputs — PowerSGD rank 1 on the main job's transformer, 8 devices, crashed within 5 steps in
  every run; the same steps without donation run. Undonated, a state that the step updates in
  place is copied first: two passes over it per step (``benchmarks/step_profile.py``'s bytes, in
  "other": the 8-bit exchange's two errors, three of 1-bit Adam's states).
  """
  return donate and mesh.devices.flat[0].platform != "cpu"
