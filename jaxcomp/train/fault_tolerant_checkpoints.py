"""The checkpoints of ``jaxcomp.train.fault_tolerant``: θ, the outer optimizer's state and the step
(orbax, written by process 0 alone), and each process's inner optimizer's state (``InnerStates``,
NumPy files of its own)."""

from __future__ import annotations

import concurrent.futures
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("jaxcomp.train.fault_tolerant")


def orbax():
  try:
    import orbax.checkpoint
  except ImportError as e:
    raise ImportError("fault_tolerant.train(checkpoint_dir=...) needs orbax: pip install "
                      "orbax-checkpoint, or pass checkpoint_dir=None") from e
  return orbax.checkpoint


def outer(directory: str, source: int):
  """Process ``source``'s orbax ``CheckpointManager`` of θ and the outer state over
  ``directory``: it saves in the background, and that process alone takes part (a dead process
  must not hold up a barrier)."""
  ocp = orbax()
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)  # orbax does not create it for a subset of processes
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=3, enable_async_checkpointing=True, create=False,
      multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=source, active_processes={source})))


class InnerStates:
  """This process's inner optimizer states, one NumPy file per synchronization
  (``checkpoint_dir/inner/process_<id>/<step>.npz``, the newest ``KEEP``), written in the
  background.

  Not orbax: orbax 0.12's background saves agree on their progress through the coordination
  service's key-value store under keys that do not name the process, so two processes saving
  each its own checkpoint wait for each other's signals for ever (seen with 3 processes).
  """
  KEEP = 3

  def __init__(self, checkpoint_dir: str):
    self.directory = os.path.join(os.path.abspath(checkpoint_dir), "inner",
                                  f"process_{jax.process_index()}")
    os.makedirs(self.directory, exist_ok=True)
    self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, f"{step}.npz")

  def steps(self) -> list:
    """The steps written, oldest first."""
    return sorted(int(name[:-4]) for name in os.listdir(self.directory)
                  if name.endswith(".npz"))

  def save(self, step: int, tree) -> None:
    """Writes ``tree``'s leaves as ``step``'s file in the background (complete, or absent)."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]

    def write():
      temporary = self._path(step) + ".tmp"
      with open(temporary, "wb") as f:
        np.savez(f, *leaves)
      os.replace(temporary, self._path(step))
      for old in self.steps()[:-self.KEEP]:
        os.remove(self._path(old))
    self._writer.submit(write)

  def restore(self, step: int, like):
    """``step``'s state in ``like``'s structure; None if there is no file of ``step``.

    Raises:
      ValueError: the file's leaves are not ``like``'s shapes and dtypes (another optimizer).
    """
    if step not in self.steps():
      return None
    leaves, structure = jax.tree.flatten(like)
    with np.load(self._path(step)) as f:
      stored = [f[f"arr_{i}"] for i in range(len(f.files))]
    expected = [(np.shape(x), np.dtype(x.dtype)) for x in leaves]
    if [(x.shape, x.dtype) for x in stored] != expected:
      raise ValueError(f"fault_tolerant: {self._path(step)} holds another inner optimizer's "
                       f"state (leaves {[(x.shape, str(x.dtype)) for x in stored]}, expected "
                       f"{[(s, str(d)) for s, d in expected]}): use the same inner optimizer, or "
                       "another checkpoint_dir")
    return jax.tree.unflatten(structure, [jnp.asarray(x) for x in stored])

  def close(self) -> None:
    """Waits for the writes in flight."""
    self._writer.shutdown(wait=True)


def inner_state(inner_states, step: int, fresh):
  """This process's inner optimizer state of ``step`` from its files; ``fresh`` where there is
  none, with a warning naming it once the job is past its start."""
  restored = inner_states.restore(step, fresh) if inner_states else None
  if restored is not None:
    log.warning("process %d: its inner optimizer's state restored from step %d's checkpoint",
                jax.process_index(), step)
    return jax.device_put(restored, jax.local_devices()[0])
  if step > 0:
    log.warning("process %d: its inner optimizer's state starts afresh at step %d (%s)",
                jax.process_index(), step, f"none of this step in {inner_states.directory}"
                if inner_states else "checkpoint_dir=None")
  return fresh


def resume(checkpoints, step: int, theta, outer_state):
  """The newest checkpoint's step, θ and outer state; the given ones where there is none."""
  newest = checkpoints.latest_step()
  if newest is None:
    return step, theta, outer_state
  restored = checkpoints.restore(newest, args=orbax().args.StandardRestore(
      jax.tree.map(np.asarray, {"theta": theta, "outer_state": outer_state})))
  log.warning("resuming from the checkpoint of step %d in %s: θ and the outer optimizer's state "
              "restored; each process takes back its own inner optimizer's state where it has "
              "one", newest, checkpoints.directory)
  return newest, *jax.device_put((restored["theta"], restored["outer_state"]),
                                 jax.local_devices()[0])
