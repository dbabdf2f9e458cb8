"""What every worker of a 2-process test does first: read ``--coordinator``, ``--process-id`` and
``--out``, give the process 2 CPU devices and join the job (jax.distributed on 127.0.0.1); and how
it reads back its own devices' copies (``local_rows``)."""

import argparse

import jax
import numpy as np


def join() -> argparse.Namespace:
  """Parses the worker's arguments and joins the 2-process job; returns the arguments."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_platforms", "cpu")
  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2,
                             process_id=args.process_id, heartbeat_timeout_seconds=30)
  return args


def local_rows(leaf):
  """This process's shards of ``leaf``, one row per local device, by device id."""
  return np.stack([np.asarray(s.data) for s in sorted(leaf.addressable_shards,
                                                        key=lambda s: s.device.id)])
