"""Records torch DDP's bucket layout for known models into ddp_buckets.json (run with torch
installed).

Each case is a stack of Linear layers, some in float16, wrapped in DDP on a 1-process gloo group
with a hook that records every bucket's parameters; the layout after DDP's first-iteration rebuild
is kept.
    python tests/golden/make_ddp_buckets.py
"""

import json
import os
import pathlib

import torch
import torch.distributed as dist
import torch.nn as nn

CASES = [  # (name, layer widths, float16 layers, bucket_cap_mb or None for DDP's default)
    ("default_cap", [1000] * 30, [3, 7], None),
    ("cap_25", [1000] * 30, [3, 7], 25.0),
    ("cap_10", [1000] * 12, [3, 7], 10.0),
    ("cap_1_uneven", [300, 500, 600, 200, 10], [], 1.0),
]


class Stack(nn.Module):

  def __init__(self, widths, half):
    super().__init__()
    self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
    for i in half:
      self.layers[i].half()

  def forward(self, x):
    for layer in self.layers:
      x = layer(x.to(layer.weight.dtype)).float()
    return x


def layout(widths, half, cap):
  model = Stack(widths, half)
  kwargs = {} if cap is None else {"bucket_cap_mb": cap}
  ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
  index = {id(p): i for i, p in enumerate(model.parameters())}
  seen = []

  def hook(state, bucket):
    seen.append((bucket.index(), bucket.is_last(), [index[id(p)] for p in bucket.parameters()]))
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future

  ddp.register_comm_hook(None, hook)
  for _ in range(2):  # the second iteration runs on the rebuilt buckets
    seen.clear()
    ddp(torch.randn(2, widths[0])).sum().backward()
  params = [{"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for p in model.parameters()]
  buckets = [{"index": i, "is_last": last, "params": members} for i, last, members in sorted(seen)]
  return {"params": params, "bucket_cap_mb": cap, "buckets": buckets}


def main():
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
  dist.init_process_group("gloo", rank=0, world_size=1)
  torch.manual_seed(0)
  golden = {name: layout(w, h, cap) for name, w, h, cap in CASES}
  golden["torch_version"] = torch.__version__
  path = pathlib.Path(__file__).with_name("ddp_buckets.json")
  path.write_text(json.dumps(golden, indent=1) + "\n")
  print("wrote", path)


if __name__ == "__main__":
  main()
