"""Worker side with real CUDA torch tensors in vLLM 0.33's per-layer layout
([blocks, kv_heads, tokens, K+V] bf16 views into one buffer), through a real umbp-pool
process: store/load byte-exact, and ordering with torch's current stream (the store
follows a slow kernel that writes the KV; kernels after a load read the loaded KV), with
no CPU synchronisation between them. Prints JSON lines and "N passed, M failed".

Usage (device machine): python3 torch_cuda_check.py PATH/TO/umbp-pool
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import umbp._native as n

LAYERS, BLOCKS, HEADS, TOKENS, HEAD2 = 4, 64, 8, 32, 128  # 8 x 32 x 128 bf16 = 64 KiB pages
results = []


def check(name, ok, **extra):
    results.append(ok)
    print(json.dumps({"check": name, "ok": bool(ok), **extra}), flush=True)


def main():
    pool_bin = sys.argv[1]
    d = tempfile.mkdtemp(prefix="umbp-torch-")
    sock = os.path.join(d, "pool.sock")
    pool = subprocess.Popen([pool_bin, "--socket", sock, "--capacity", "4GiB"])
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        run(sock)
    finally:
        pool.kill()
        pool.wait()
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


def run(sock):
    dev = torch.device("cuda:0")
    per_layer = BLOCKS * HEADS * TOKENS * HEAD2
    buf = torch.zeros(LAYERS * per_layer, dtype=torch.bfloat16, device=dev)
    layers = [buf[i * per_layer:(i + 1) * per_layer].view(BLOCKS, HEADS, TOKENS, HEAD2) for i in range(LAYERS)]
    ns = n.namespace_digest("torch-cuda-check")
    w = n.Worker(sock, ns)
    alloc = w.register_cuda_memory(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    page = HEADS * TOKENS * HEAD2 * 2
    segs = []
    for lt in layers:
        stride = lt.stride(0) * lt.element_size()
        segs.append((alloc, lt.data_ptr() - buf.data_ptr(), stride, page, BLOCKS))
    obj = w.register_layout(0, segs)
    check("layout_object_bytes", obj == LAYERS * page, object_bytes=obj)

    keys = n.object_keys(ns, 0, 0, [i.to_bytes(4, "little") for i in range(16)])
    gen = torch.Generator(device=dev).manual_seed(1)
    pattern = [torch.randn((8, HEADS, TOKENS, HEAD2), generator=gen, device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    torch.cuda.synchronize()

    stream = torch.cuda.current_stream()
    # The first fenced transfer sets up the fence page (CUDA init in this process, one
    # control round trip); do it once so the timing below is of the steady state.
    warm = w.store(0, keys[15:16], [63], stream=stream.cuda_stream)
    check("fence_setup", w.wait(warm, 20000) == [n.STATUS_STORED])
    # A slow kernel, then the "forward pass" writes the KV of blocks 0..7; the store is
    # submitted at once and must still see the final bytes.
    t0 = time.perf_counter()
    torch.cuda._sleep(300_000_000)
    for lt, p in zip(layers, pattern):
        lt[:8].copy_(p)
    tid = w.store(0, keys[:8], list(range(8)), stream=stream.cuda_stream)
    submit_ms = (time.perf_counter() - t0) * 1e3
    st = w.wait(tid, 20000)
    check("fenced_store_completes", st == [n.STATUS_STORED] * 8, statuses=st, submit_ms=round(submit_ms, 2))
    check("store_did_not_block_cpu", submit_ms < 50, submit_ms=round(submit_ms, 2))

    # Poison the destination, load into blocks 8..15 ordered before a reading kernel.
    for lt in layers:
        lt[8:16].fill_(-7.0)
    tid = w.load(0, keys[:8], list(range(8, 16)), stream=stream.cuda_stream)
    # Comparison kernels enqueued right after the load (no CPU sync in between).
    same = torch.stack([(lt[8:16] == p).all() for lt, p in zip(layers, pattern)]).all()
    st = w.wait(tid, 20000)
    check("fenced_load_completes", st == [n.STATUS_LOADED] * 8, statuses=st)
    check("kernel_after_load_reads_loaded_kv", bool(same.item()))
    # Blocks outside the load stay untouched.
    check("untouched_blocks_unchanged", bool(torch.count_nonzero(layers[0][16:63]).item() == 0))

    # Plain (CPU-synchronised) path, byte-exact, another set of keys.
    for lt, p in zip(layers, pattern):
        lt[20:28].copy_(p.flip(0))
    torch.cuda.synchronize()
    st = w.wait(w.store(0, keys[8:15], list(range(20, 27))), 20000)
    check("plain_store", st == [n.STATUS_STORED] * 7, statuses=st)
    for lt in layers:
        lt[30:38].zero_()
    torch.cuda.synchronize()
    st = w.wait(w.load(0, keys[8:15], list(range(30, 37))), 20000)
    exact = all(torch.equal(lt[30:37], p.flip(0)[:7]) for lt, p in zip(layers, pattern))
    check("plain_load_byte_exact", st == [n.STATUS_LOADED] * 7 and exact, statuses=st)
    idx = n.Index(sock, ns)
    check("index_sees_all_16", idx.match_prefix(keys) == 16)


if __name__ == "__main__":
    sys.exit(main())
