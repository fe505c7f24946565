#!/usr/bin/env python3
"""GB/s of one 16 MiB copy and a stream synchronize at a time, per stream (8 streams) and per
kind of pinned host memory (cudaHostAlloc, and 4 KiB-page memory registered with
cudaHostRegister as the pool's DRAM is), both directions; no pool. One JSON line per
(round, stream). Needs CuPy and a CUDA GPU (the device machine):

    python3 scripts/device/copy_probe.py

Asks whether the copy engine a stream lands on, or the kind of memory, moves the one-copy
floor (docs/benchmarks.md, "twelfth pass": neither does).
"""
import cupy as cp, ctypes, mmap, time, json, sys
MiB = 1 << 20
size = 16 * MiB
reps = 60
dev = cp.cuda.Device(0)
d = cp.cuda.alloc(size)
rt = cp.cuda.runtime
def bench(hptr, stream, kind):
    out = {}
    for name, dir_ in (("d2h", rt.memcpyDeviceToHost), ("h2d", rt.memcpyHostToDevice)):
        src, dst = (d.ptr, hptr) if name == "d2h" else (hptr, d.ptr)
        for _ in range(5):
            rt.memcpyAsync(dst, src, size, dir_, stream.ptr); stream.synchronize()
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); rt.memcpyAsync(dst, src, size, dir_, stream.ptr); stream.synchronize(); ts.append(time.perf_counter() - t)
        ts.sort()
        out[name] = round(size / ts[len(ts)//2] / 1e9, 2)
    return out
# cudaHostAlloc memory
pinned = cp.cuda.alloc_pinned_memory(size)
hp = pinned.ptr
# registered 4 KiB-page anonymous memory (as the pool's memfd DRAM)
libc = ctypes.CDLL(None)
buf = mmap.mmap(-1, size + 2 * MiB)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
aligned = (addr + 2 * MiB - 1) & ~(2 * MiB - 1)
ctypes.memset(aligned, 1, size)
rt.hostRegister(aligned, size, 0)
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
for rnd in range(2):
    for i, s in enumerate(streams):
        print(json.dumps({"round": rnd, "stream": i, "alloc": bench(hp, s, "alloc"), "registered": bench(aligned, s, "reg")}), flush=True)
