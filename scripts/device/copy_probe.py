#!/usr/bin/env python3
"""GB/s of one 16 MiB copy and a stream synchronize at a time, per stream (8 streams) and per
kind of pinned host memory (cudaHostAlloc, and 4 KiB-page memory registered with
cudaHostRegister as the pool's DRAM is), both directions; no pool. One JSON line per
(round, stream). Needs CuPy and a CUDA GPU (the device machine):

    python3 scripts/device/copy_probe.py

Asks whether the copy engine a stream lands on, or the kind of memory, moves the one-copy
floor (docs/history/benchmarks-2026-11.md, "twelfth pass": neither does).
"""
import ctypes
import json
import mmap
import time

import cupy as cp

MiB = 1 << 20
SIZE = 16 * MiB
REPS = 60
rt = cp.cuda.runtime
device = cp.cuda.alloc(SIZE)


def copy_gbps(dst, src, kind, stream):
    """Median GB/s of one copy and a stream synchronize, after 5 warm-up copies."""
    for _ in range(5):
        rt.memcpyAsync(dst, src, SIZE, kind, stream.ptr)
        stream.synchronize()
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        rt.memcpyAsync(dst, src, SIZE, kind, stream.ptr)
        stream.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return round(SIZE / times[len(times) // 2] / 1e9, 2)


def both_ways(host, stream):
    return {
        "d2h": copy_gbps(host, device.ptr, rt.memcpyDeviceToHost, stream),
        "h2d": copy_gbps(device.ptr, host, rt.memcpyHostToDevice, stream),
    }


# cudaHostAlloc memory.
pinned = cp.cuda.alloc_pinned_memory(SIZE)
# 4 KiB-page anonymous memory registered with the driver, as the pool's memfd DRAM is.
buf = mmap.mmap(-1, SIZE + 2 * MiB)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
registered = (addr + 2 * MiB - 1) & ~(2 * MiB - 1)
ctypes.memset(registered, 1, SIZE)
rt.hostRegister(registered, SIZE, 0)
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
for rnd in range(2):
    for i, s in enumerate(streams):
        print(json.dumps({"round": rnd, "stream": i, "alloc": both_ways(pinned.ptr, s), "registered": both_ways(registered, s)}), flush=True)
