"""Network what-if: an α-β model of the step time on W workers, fed with measured bytes and compute.

Per compressor, for ResNet-50 shaped gradients:

* communication, measured: the collectives of the compiled update at W = 8
  (``jaxcomp.comm_report``): per op, how many there are and their bytes (bf16 at its requested
  width: XLA:CPU widens bf16 collectives to f32, GPUs do not). An all-reduce of N bytes is the same
  N at any W; an all-gather's per-worker contribution c = payload / 8 is gathered from all W
  workers; where the step also has an all-to-all (``quantized``, ``onebit_adam``: a reduce-scatter
  of the whole gradient in W shards, then an all-gather of the averaged shards), the all-to-all's
  input N is the same at any W and the all-gather's contribution is a shard, c·8/W. ``dgc`` sends
  the dense mean where ``W·density·2 ≥ 1`` (W ≥ 500 at density 0.001; ``jaxcomp.dgc`` does the
  same), modelled as allreduce's collectives and compute plus its 4-byte flag.
* compression compute, measured: the jitted ``update`` at world size 1 on this CPU (median of
  interleaved rounds); allreduce's one pass is counted for every compressor alike.
* forward and backward compute: ``--compute-ms`` (default 100 ms, about a ResNet-50 step of 32
  images on one current GPU) — an assumption, not a measurement; communication is not overlapped
  with it.

The α-β formulas — per collective, switched network, the faster of ring and recursive doubling —
are ``jaxcomp.train.network``'s (the main job models its time to target with them).

Step time = forward/backward + compression compute + Σ collectives; speedup = allreduce's step
time / the compressor's. α = ``--alpha-us`` (default 5 µs), β = 1, 10 and 100 Gbit/s, W = 8 …
1024. The plot (``benchmarks/payoff.png``) shows the speedup against W per bandwidth: where a line
is above 1 the compressor pays off.

  PYTHONPATH=. python benchmarks/network_model.py [--quick] [--write]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
# The formulas, here under their old names too (benchmarks/slow_link.py reads shared_medium_time).
from jaxcomp.train.network import (  # noqa: E402,F401
    ALPHA, allgather_time, allreduce_time, alltoall_time, comm_time, gbits_to_beta, operands,
    shared_medium_time)

GBITS = (1, 10, 100)
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
DGC_DENSITY = 0.001


def measured_collectives(compressor, tree) -> list:
  """``(op, bytes)`` per compiled collective; bf16 at its requested width (XLA:CPU widens it)."""
  from benchmarks import bytes as bytes_bench
  compiled, lowered = bytes_bench.measure(compressor, tree)
  scale = lowered.payload_bytes / compiled.payload_bytes if compressor.name == "bf16" else 1.0
  return [(op, scale * nbytes) for op, nbytes, _ in operands(compiled)]


def dense_fallback(name, world) -> bool:
  """``jaxcomp.dgc`` sends the dense mean once the sparse exchange would send more."""
  return name == "dgc" and world * DGC_DENSITY * 2 >= 1


def collectives_at(name, measured, world) -> list:
  """The collectives of ``name``'s step at ``world`` workers, from those measured at W = 8."""
  if dense_fallback(name, world):
    return measured["allreduce"] + [("all-reduce", 4)]
  if any(op == "all-to-all" for op, _ in measured[name]):  # shards of the gradient: 1/W each
    return [(op, b * 8 / world if op == "all-gather" else b) for op, b in measured[name]]
  return measured[name]


def plot(path, compressor_names, speedups, compute_ms, alpha_us):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(GBITS), figsize=(5 * len(GBITS), 4), sharey=True)
  for ax, gbit in zip(axes, GBITS):
    for name in compressor_names:
      ax.plot(WORLDS, [speedups[(name, gbit, w)] for w in WORLDS], marker="o", ms=3, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="workers W", title=f"{gbit} Gbit/s")
    ax.set_xticks(WORLDS, [str(w) for w in WORLDS])
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("speedup over allreduce (> 1: pays off)")
  axes[-1].legend(fontsize=8)
  fig.suptitle(f"α-β model, ResNet-50 gradients, forward+backward {compute_ms:g} ms, "
               f"α = {alpha_us:g} µs")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  from jaxcomp.train import device_setup
  device_setup.simulate_cpu_devices(8)  # before JAX starts; importing the formulas does not
  from benchmarks.compute_vs_torch import jax_runner
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--compute-ms", type=float, default=100.0,
                 help="assumed forward+backward time per step (ms)")
  p.add_argument("--alpha-us", type=float, default=1e6 * ALPHA,
                 help="latency per message per link (µs)")
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 2)")
  args = common.parse(p, argv)
  repeats = args.repeats or (2 if args.quick else 7)
  model, tree = ("tiny", common.tiny()) if args.quick else ("ResNet-50", common.resnet50())
  compressor_list = common.compressors(args.compressors)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  names = [c.name for c in compressor_list]

  measured = {c.name: measured_collectives(c, tree) for c in compressor_list}
  grads = common.random_like(tree)
  times = common.interleaved({c.name: jax_runner(c.make(None), grads) for c in compressor_list},
                             repeats)
  del grads
  compute = {n: common.median(times[n]) for n in names}
  print("  compression compute (ms): "
        + ", ".join(f"{n} {1e3 * t:.1f}" for n, t in compute.items()), file=sys.stderr)

  alpha, fb = args.alpha_us * 1e-6, args.compute_ms * 1e-3
  speedups, rows = {}, []
  for gbit in GBITS:
    beta = gbits_to_beta(gbit)
    for world in WORLDS:
      step = {n: fb + compute["allreduce" if dense_fallback(n, world) else n]
                 + comm_time(collectives_at(n, measured, world), world, alpha, beta) for n in names}
      for n in names:
        speedups[(n, gbit, world)] = step["allreduce"] / step[n]
      rows.append([f"{gbit}", f"{world}"] + [
          f"{1e3 * step[n]:.0f}"
          + ("" if n == "allreduce" else f" ({speedups[(n, gbit, world)]:.2f}×)")
          for n in names])
  table = common.markdown_table(["Gbit/s", "W"] + names, rows)
  inputs = common.markdown_table(
      ["compressor", "bytes sent (W = 8)", "collectives", "compression ms (this CPU)"],
      [[n, common.human(sum(b * (8 if op == "all-gather" else 1) for op, b in measured[n])),
        f"{len(measured[n])}", f"{1e3 * compute[n]:.1f}"] for n in names], "lrrr")

  png = os.path.join(common.ROOT, "benchmarks", "payoff.png") if args.write else os.path.join(
      tempfile.mkdtemp(prefix="jaxcomp_payoff_"), "payoff.png")
  plot(png, names, speedups, args.compute_ms, args.alpha_us)
  print(f"plot: {png}", file=sys.stderr)
  body = (f"{model} gradients; forward+backward {args.compute_ms:g} ms (assumed), α = "
          f"{args.alpha_us:g} µs, no overlap of communication with compute. Inputs (bytes and "
          f"collectives from the compiled update at W = 8, compression compute median of {repeats} "
          f"interleaved rounds):\n\n{inputs}\n\nEstimated step time in ms, and in parentheses the "
          "speedup over allreduce:\n\n" + table
          + "\n\n![speedup over allreduce](benchmarks/payoff.png)")
  common.emit(args, "network_model", "Network what-if (α-β model)", "network_model.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
