"""SGLang HiCache L3: the UMBP backend (`umbp.sglang`) against SGLang's own `file` backend,
on the same pages in the same run.

    PATH=<venv>/bin:$PATH python python/bench/bench_sglang_storage.py [--json] \
        [--pages 128] [--iterations 20] [--layers 8] [--heads 2] [--head-dim 64] [--page 16]

Needs SGLang (scripts/setup-sglang-env.sh) and `umbp-pool` (UMBP_POOL_BIN, default
target/release/umbp-pool), which is started on a private socket. Real SGLang objects: a CPU
`MHATokenToKVPoolHost` (page_first), SGLang's page hashes, both backends made by SGLang's
`StorageBackendFactory` as the HiCache controller makes them.

One batch = `--pages` pages (SGLang's STORAGE_BATCH_SIZE is 128), all present. Each backend
does what the HiCache controller does with it:
* `batch_exists`: `backend.batch_exists(keys)` (UMBP: shared-memory index; file: a stat per page);
* `batch_get`: UMBP `batch_get_v1(keys, host_indices)` (the pool writes the host pool pages);
  file: `batch_get(keys, dummy_pages)` + `set_from_flat_data_page` per page (the
  controller's `_generic_page_get`);
* `batch_set`: UMBP `batch_set_v1` (first store of fresh pages); file `batch_set` of
  `get_data_page` copies (`_generic_page_set`), fresh pages too.
The file backend writes into a temporary directory (`--file-dir`, default under /dev/shm
when it exists, so neither side touches a disk: it measures the code paths, not a device).
Values are p50 over iterations; p99 and throughput are extra fields / cases.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import case, emit  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--file-dir", default=None)
    a = ap.parse_args()

    import torch

    import sglang_host as sh

    pool_bin = Path(os.environ.get("UMBP_POOL_BIN") or HERE.parents[1] / "target/release/umbp-pool")
    tmp = Path(tempfile.mkdtemp(prefix="umbp-sgb-"))
    fdir = Path(a.file_dir) if a.file_dir else Path(tempfile.mkdtemp(
        prefix="hicache-file-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    sock = tmp / "pool.sock"
    npages = a.pages
    env = dict(os.environ, UMBP_STANDALONE_ADDRESS=str(sock), UMBP_DRAM_CAPACITY="2GiB")
    pool = subprocess.Popen([str(pool_bin)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        tokens = (a.iterations + 4) * npages * a.page * 2
        mk = lambda: sh.host_pool("page_first", tokens=tokens, layers=a.layers, heads=a.heads,  # noqa: E731
                                  head_dim=a.head_dim, page=a.page)
        hp_w, hp_r, hp_f = mk(), mk(), mk()
        um_w = sh.make_backend(hp_w, sh.umbp_extra(str(sock)))
        um_r = sh.make_backend(hp_r, sh.umbp_extra(str(sock)))
        fb = sh.make_backend(hp_f, {"file_storage_path": str(fdir)}, backend="file")
        obj = um_w.layout.object_bytes
        batch_bytes = obj * npages
        src = hp_w.alloc(npages * a.page)
        sh.fill_pages(hp_w, src, 5)
        # The file backend reads from its own pool: copy the same pages there.
        src_f = hp_f.alloc(npages * a.page)
        sh.fill_pages(hp_f, src_f, 5)

        t_set_u, t_set_f = [], []
        batches = []
        for it in range(a.iterations):
            keys = sh.page_hashes(sh.tokens_of(1000 + it, npages, a.page), a.page)
            batches.append(keys)
            t0 = time.perf_counter()
            ok = um_w.batch_set_v1(keys, src)
            t_set_u.append(time.perf_counter() - t0)
            assert all(ok), "umbp batch_set_v1 failed"
            t0 = time.perf_counter()
            data = [hp_f.get_data_page(int(src_f[i * a.page])) for i in range(npages)]
            assert fb.batch_set(keys, data)
            t_set_f.append(time.perf_counter() - t0)

        t_ex_u, t_ex_f, t_get_u, t_get_f = [], [], [], []
        dst = hp_r.alloc(npages * a.page)
        dst_f = hp_f.alloc(npages * a.page)
        for keys in batches:
            t0 = time.perf_counter()
            hu = um_r.batch_exists(keys)
            t_ex_u.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hf = fb.batch_exists(keys)
            t_ex_f.append(time.perf_counter() - t0)
            assert hu == npages and hf == npages, (hu, hf)
            t0 = time.perf_counter()
            ok = um_r.batch_get_v1(keys, dst)
            t_get_u.append(time.perf_counter() - t0)
            assert all(ok)
            t0 = time.perf_counter()
            pages = fb.batch_get(keys, [hp_f.get_dummy_flat_data_page() for _ in keys])
            for i, p in enumerate(pages):
                assert p is not None
                hp_f.set_from_flat_data_page(int(dst_f[i * a.page]), p)
            t_get_f.append(time.perf_counter() - t0)
        # Byte-exact check of the last batch, both backends.
        for i in range(npages):
            ref = sh.page_bytes(hp_w, int(src[i * a.page]))
            assert sh.page_bytes(hp_r, int(dst[i * a.page])) == ref
            assert sh.page_bytes(hp_f, int(dst_f[i * a.page])) == ref

        ctx = dict(pages=npages, object_bytes=obj, iterations=a.iterations, layout="page_first",
                   file_dir=str(fdir), sglang=__import__("sglang").__version__)
        us, ms = 1e6, 1e3
        gbs = lambda ts: batch_bytes / pct(ts, 50) / 1e9  # noqa: E731
        cases = [
            case("sglang", f"batch_exists_{npages}p_p50", pct(t_ex_u, 50) * us, "us", pct(t_ex_f, 50) * us,
                 "sglang file backend batch_exists", p99_us=round(pct(t_ex_u, 99) * us, 1),
                 baseline_p99_us=round(pct(t_ex_f, 99) * us, 1), **ctx),
            case("sglang", f"batch_get_{npages}p_p50", pct(t_get_u, 50) * ms, "ms", pct(t_get_f, 50) * ms,
                 "sglang file backend batch_get + set_from_flat_data_page",
                 p99_ms=round(pct(t_get_u, 99) * ms, 3), baseline_p99_ms=round(pct(t_get_f, 99) * ms, 3), **ctx),
            case("sglang", "batch_get_throughput", gbs(t_get_u), "GB/s", gbs(t_get_f),
                 "sglang file backend batch_get + set_from_flat_data_page", lower_is_better=False, **ctx),
            case("sglang", f"batch_set_{npages}p_p50", pct(t_set_u, 50) * ms, "ms", pct(t_set_f, 50) * ms,
                 "sglang file backend batch_set of get_data_page", p99_ms=round(pct(t_set_u, 99) * ms, 3),
                 baseline_p99_ms=round(pct(t_set_f, 99) * ms, 3), **ctx),
            case("sglang", "batch_set_throughput", gbs(t_set_u), "GB/s", gbs(t_set_f),
                 "sglang file backend batch_set of get_data_page", lower_is_better=False, **ctx),
        ]
        emit(cases, a.json)
        for b in (um_w, um_r):
            b.close()
    finally:
        pool.terminate()
        pool.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
        if not a.file_dir:
            shutil.rmtree(fdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
