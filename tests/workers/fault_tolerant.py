"""One process of a fault-tolerant DiLoCo job (``jaxcomp.train.fault_tolerant``): 2 CPU devices,
``jax.distributed`` with recoverability on 127.0.0.1, a small MLP on this process's own data, and a
line of JSON per synchronization (the step, the members, the digests of θ and the outer state,
the loss of θ on held-out data), and one per round (its members, its devices and those it names
ahead) in the same file's ``.rounds``. ``--signal-in-sync STEP:SIGNAL`` makes it send itself
SIGNAL (SIGKILL: it dies; SIGSTOP: it hangs) as its round of the synchronization at STEP begins,
once it has its plan: the others are then in the round's collectives without it. ``--muloco``
trains MuLoCo's way: Muon inside, the pseudo-gradient sent in 2 bits with a decaying error;
``--fragments P`` Streaming DiLoCo's way, one fragment of P per synchronization."""

import argparse
import json
import os
import signal
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nodes_harness  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train import fault_tolerant  # noqa: E402

HEARTBEAT = 5  # seconds before the coordination service drops a silent process


def main():
  parser = argparse.ArgumentParser()
  for name in ("--coordinator", "--out"):
    parser.add_argument(name, required=True)
  for name in ("--process-id", "--processes", "--steps", "--sync-every", "--collective-timeout"):
    parser.add_argument(name, type=int, required=True)
  parser.add_argument("--step-seconds", type=float, default=0.0,
                      help="sleep per inner step: the time a larger model would compute")
  parser.add_argument("--checkpoint-dir", default=None)
  parser.add_argument("--signal-in-sync", default=None, help="STEP:SIGNAL, e.g. 75:SIGKILL")
  parser.add_argument("--muloco", action="store_true")
  parser.add_argument("--fragments", type=int, default=1)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_platforms", "cpu")
  fault_tolerant.initialize(args.coordinator, args.processes, args.process_id,
                            heartbeat_timeout_seconds=HEARTBEAT,
                            collective_timeout_seconds=args.collective_timeout)
  out, rounds = open(args.out, "a"), open(args.out + ".rounds", "a")
  held_out = nodes_harness.batch(-1)

  def batch(step):
    time.sleep(args.step_seconds)
    rng = np.random.default_rng([step, args.process_id])
    return (rng.normal(size=(8, nodes_harness.IN)).astype(np.float32),
            rng.normal(size=(8, nodes_harness.OUT)).astype(np.float32))

  step, name = (args.signal_in_sync or "-1:SIGKILL").split(":")

  def on_round(this_round):
    ids = lambda devices: [d.id for d in devices]  # noqa: E731
    rounds.write(json.dumps({"step": this_round.step, "members": this_round.members,
                             "devices": ids(this_round.devices),
                             "ahead": [(m, ids(d)) for m, d in this_round.ahead],
                             "joining": this_round.joining}) + "\n")
    rounds.flush()
    if this_round.step == int(step):
      print(f"{name} inside the synchronization at step {this_round.step}", flush=True)
      os.kill(os.getpid(), signal.Signals[name])

  pieces = fault_tolerant.Fragments.of(nodes_harness.init_params(), args.fragments).pieces

  def on_sync(synced):
    out.write(json.dumps({"pid": os.getpid(), "time": time.time(), "step": synced.step,
                          "members": synced.members,
                          "theta": fault_tolerant.digest(synced.theta),
                          "outer": fault_tolerant.digest(synced.outer_state),
                          "fragment": synced.fragment,
                          "pieces": [fault_tolerant.digest(p) for p in pieces(synced.theta)],
                          "loss": float(nodes_harness.loss_fn(synced.theta, *held_out))}) + "\n")
    out.flush()

  if args.muloco:
    algorithm = dict(inner=optax.contrib.muon(0.02, adam_learning_rate=0.01),
                     compressor=jaxcomp.quantized(2, error_decay=0.9, axis_name="replica"))
  else:
    algorithm = dict(inner=nodes_harness.inner())
  # Process 0 sends θ: the others pass its shapes.
  params = (nodes_harness.init_params() if args.process_id == 0 else
            jax.eval_shape(nodes_harness.init_params))
  fault_tolerant.train(nodes_harness.loss_fn, params, batch, **algorithm, fragments=args.fragments,
                       sync_every=args.sync_every, steps=args.steps,
                       checkpoint_dir=args.checkpoint_dir, on_round=on_round, on_sync=on_sync)
  print("done", flush=True)


if __name__ == "__main__":
  main()
