"""What the vLLM scheduler pays per prefix lookup, measured from Python.

    python python/bench/bench_lookup.py [--json] [--iterations N] [--blocks 64,1024]

The connector's hot path for one TP rank, with every block present (the longest walk):
* `keys_and_match_N`: derive the object keys of a prompt's block hashes (`object_keys`,
  one native call) and `Index.match_prefix` them in the pool's shared-memory index;
* `match_hashes_N`: the same in one call (`Index.match_hashes`, keys derived in Rust,
  no key object per block): what the connector does.
The pool is an `EmbeddedPool` in this process; the index is read through the same mapping
a scheduler in another process gets.

Baselines, measured in the same run:
* `unix socket round trip`: the same key derivation, then the keys sent to another process
  that owns a Python set of the stored keys and answers the prefix count (what an RPC
  design costs at best: no serialization beyond raw bytes);
* `python dict` (extra field `dict_us`): the prefix walked in an in-process dict keyed by
  block hash, no key derivation — a floor no shared, cross-process index can reach.
Values are medians (p50) of per-call times in microseconds; p99 is an extra field.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import case, emit  # noqa: E402

KEY = 16


def _serve(path: str, keys: list[bytes]) -> None:
    present = set(keys)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn, _ = srv.accept()
    buf = bytearray()
    while True:
        hdr = conn.recv(4, socket.MSG_WAITALL)
        if len(hdr) < 4:
            return
        (n,) = struct.unpack("<I", hdr)
        data = conn.recv(n * KEY, socket.MSG_WAITALL)
        buf[:] = data
        hit = 0
        for i in range(n):
            if bytes(buf[i * KEY : (i + 1) * KEY]) not in present:
                break
            hit += 1
        conn.sendall(struct.pack("<I", hit))


def _pcts(samples: list[int]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


def _time(fn, iterations: int) -> list[int]:
    for _ in range(min(200, iterations)):  # warm up
        fn()
    out = []
    pc = time.perf_counter_ns
    for _ in range(iterations):
        t = pc()
        fn()
        out.append(pc() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--blocks", default="64,1024")
    args = ap.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    nmax = max(sizes)

    import hashlib

    import umbp._native as native
    from umbp.vllm.keys import make_keys

    ns = native.namespace_digest("bench_lookup")
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(nmax)]
    keys = make_keys(native, ns, 0, 0, hashes)

    tmp = tempfile.mkdtemp(prefix="umbp-bench-")
    rpc_path = os.path.join(tmp, "rpc.sock")
    # The RPC server is forked before the pool's threads exist.
    server = mp.get_context("fork").Process(target=_serve, args=(rpc_path, keys), daemon=True)
    server.start()

    page = 4096
    pool = native.EmbeddedPool(max(8 << 20, nmax * page * 2), socket_path=os.path.join(tmp, "pool.sock"),
                               min_object_bytes=page)
    buf = (ctypes.c_ubyte * (nmax * page))()
    w = native.Worker(pool.socket_path, ns)
    aid = w.register_host_memory(ctypes.addressof(buf), len(buf))
    w.register_layout(0, [(aid, 0, page, page, nmax)])
    for lo in range(0, nmax, 256):
        st = w.wait(w.store(0, keys[lo : lo + 256], list(range(lo, min(nmax, lo + 256)))), 10_000)
        assert st is not None and all(s == native.STATUS_STORED for s in st), st
    idx = native.Index(pool.socket_path, namespace=ns)
    assert idx.match_prefix(keys) == nmax

    for _ in range(100):
        if os.path.exists(rpc_path):
            break
        time.sleep(0.05)
    cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cli.connect(rpc_path)

    d = {h: True for h in hashes}
    cases = []
    for n in sizes:
        hs = hashes[:n]
        iters = max(200, args.iterations * 64 // n)

        def shm() -> int:
            return idx.match_prefix(make_keys(native, ns, 0, 0, hs))

        def rpc() -> int:
            ks = make_keys(native, ns, 0, 0, hs)
            cli.sendall(struct.pack("<I", len(ks)) + b"".join(ks))
            return struct.unpack("<I", cli.recv(4, socket.MSG_WAITALL))[0]

        def pydict() -> int:
            m = 0
            for h in hs:
                if h not in d:
                    break
                m += 1
            return m

        def one_call() -> int:
            return idx.match_hashes(ns, 0, 0, hs)

        assert shm() == one_call() == rpc() == pydict() == n
        t_shm, t_one, t_rpc, t_dict = (_time(f, iters) for f in (shm, one_call, rpc, pydict))
        keys_only = _time(lambda: make_keys(native, ns, 0, 0, hs), iters)
        (b50, b99), (d50, _), (k50, _) = map(_pcts, (t_rpc, t_dict, keys_only))
        for name, samples in ((f"keys_and_match_{n}_blocks", t_shm), (f"match_hashes_{n}_blocks", t_one)):
            p50, p99 = _pcts(samples)
            cases.append(case(
                "py_lookup", name, p50, "us", b50, "unix socket round trip",
                p99_us=round(p99, 3), baseline_p99_us=round(b99, 3), dict_us=round(d50, 3),
                speedup_vs_dict=round(d50 / p50, 2), object_keys_us=round(k50, 3),
                blocks=n, iterations=iters, target_us=20 if n == 64 else None,
            ))
    cli.close()
    server.join(timeout=5)
    w.close()
    pool.close()
    shutil.rmtree(tmp, ignore_errors=True)
    emit(cases, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
