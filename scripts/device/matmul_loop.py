#!/usr/bin/env python3
"""bf16 matmul loop for `umbp-bench transfer --matmul` (interference_pct).

Runs N x N x N bf16 matrix products on the GPU for --seconds and prints one JSON line
{"tflops": ..., "iters": ..., "ms": ...}, timed with CUDA events. Random inputs (never
zeros: they run faster, see the device notes)."""
import argparse
import json
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=5.0)
p.add_argument("--n", type=int, default=8192)
a = p.parse_args()
n = a.n
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    z = x @ y
torch.cuda.synchronize()
start = torch.cuda.Event(enable_timing=True)
end = torch.cuda.Event(enable_timing=True)
iters = 0
t0 = time.perf_counter()
start.record()
while time.perf_counter() - t0 < a.seconds:
    for _ in range(20):
        z = x @ y
    iters += 20
    torch.cuda.synchronize()
end.record()
torch.cuda.synchronize()
ms = start.elapsed_time(end)
print(json.dumps({"tflops": 2 * n**3 * iters / (ms / 1e3) / 1e12, "iters": iters, "ms": ms}), flush=True)
