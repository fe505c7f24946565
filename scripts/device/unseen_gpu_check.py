"""Issue 8: a pool that cannot see a worker's GPU refuses that worker's CUDA registration
with a clear error, and keeps serving other workers meanwhile. Prints JSON lines and
"N passed, M failed". Usage (device machine): python3 unseen_gpu_check.py PATH/TO/umbp-pool

One GPU: the pool runs with CUDA_VISIBLE_DEVICES="" and the worker uses GPU 0.
Two GPUs: POOL_VISIBLE=0 WORKER_GPU=1 — the pool sees only GPU 0, the refused worker is on
GPU 1, and a second worker on GPU 0 stores and loads byte-exact through the same pool.
"""

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import umbp._native as n

results = []


def check(name, ok, **extra):
    results.append(bool(ok))
    print(json.dumps({"check": name, "ok": bool(ok), **extra}), flush=True)


def main():
    d = tempfile.mkdtemp(prefix="umbp-unseen-")
    sock = os.path.join(d, "pool.sock")
    visible = os.environ.get("POOL_VISIBLE", "")
    worker_gpu = int(os.environ.get("WORKER_GPU", "0"))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    pool = subprocess.Popen([sys.argv[1], "--socket", sock, "--capacity", "1GiB", "--min-object-size", "4KiB"], env=env)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        ns = n.namespace_digest("unseen-gpu")
        gpu = torch.zeros(1 << 20, dtype=torch.uint8, device=f"cuda:{worker_gpu}")
        w = n.Worker(sock, ns)
        try:
            w.register_cuda_memory(gpu.data_ptr(), gpu.numel(), 0)
            check("cuda_registration_refused", False, error=None)
        except n.UmbpError as e:
            msg = str(e)
            check("cuda_registration_refused", True, error=msg)
            check("refusal_names_the_device", "GPU" in msg or "device" in msg.lower() or "UUID" in msg, error=msg)
        check("worker_still_attached", w.connected)
        # Another worker on host memory is served as usual.
        h = n.Worker(sock, ns)
        buf = (ctypes.c_ubyte * (8 * 4096))()
        ctypes.memset(buf, 0x3C, 4 * 4096)
        a = h.register_host_memory(ctypes.addressof(buf), len(buf))
        h.register_layout(0, [(a, 0, 4096, 4096, 8)])
        keys = n.object_keys(ns, 0, 0, [b"a", b"b", b"c", b"d"])
        # Until the first DRAM chunk is pinned for the GPU the pool sees, stores find no
        # room (NotStored, by design): retry for a few seconds, and report how long it took.
        t0 = time.time()
        while True:
            st = h.wait(h.store(0, keys, [0, 1, 2, 3]), 5000)
            if st != [n.STATUS_NOT_STORED] * 4 or time.time() - t0 > 10:
                break
            time.sleep(0.05)
        print(json.dumps({"host_store_first_stored_after_s": round(time.time() - t0, 3)}), flush=True)
        st2 = h.wait(h.load(0, keys, [4, 5, 6, 7]), 5000)
        check("host_worker_served", st == [n.STATUS_STORED] * 4 and st2 == [n.STATUS_LOADED] * 4
              and bytes(buf[4 * 4096:]) == bytes(buf[:4 * 4096]), store=st, load=st2)
        if visible:
            # A worker on a GPU the pool does see is served through the same pool.
            seen = int(visible.split(",")[0])
            t = torch.arange(8 * 65536, dtype=torch.int32, device=f"cuda:{seen}").view(torch.uint8)
            g = n.Worker(sock, ns)
            ga = g.register_cuda_memory(t.data_ptr(), t.numel(), seen)
            g.register_layout(0, [(ga, 0, 65536 * 4, 65536 * 4, 8)])
            gk = n.object_keys(ns, 0, 0, [b"g%d" % i for i in range(4)])
            want = t[: 4 * 65536 * 4].clone()
            torch.cuda.synchronize()
            sg = g.wait(g.store(0, gk, [0, 1, 2, 3]), 5000)
            t.zero_()
            torch.cuda.synchronize()
            lg = g.wait(g.load(0, gk, [0, 1, 2, 3]), 5000)
            torch.cuda.synchronize()
            check("seen_gpu_worker_served", sg == [n.STATUS_STORED] * 4 and lg == [n.STATUS_LOADED] * 4
                  and torch.equal(t[: 4 * 65536 * 4], want), gpu=seen, store=sg, load=lg)
    finally:
        pool.kill()
        pool.wait()
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
