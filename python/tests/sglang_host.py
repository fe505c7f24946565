"""Real SGLang objects for the SGLang backend's tests and bench: a CPU host KV pool
(`MHATokenToKVPoolHost`, the class SGLang's HiCache uses for MHA models), page hashes from
SGLang's own hash function, and a backend created through SGLang's own factory
(`StorageBackendFactory.create_backend("dynamic", ...)`), as the HiCache controller does.

Also a command-line driver, run as a separate process by the tests:
    python sglang_host.py store|load|ctl-store|ctl-load|hyb-store|hyb-load SOCKET LAYOUT SEED NPAGES
prints one JSON line with what it did (ctl-*: through SGLang's HiCacheController; hyb-*:
KV + Mamba state through its HybridCacheController).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Optional

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16  # 64 KiB pages (the pool's default minimum object)
MODEL = "umbp-test/tiny-mha"


def host_pool(layout: str = "page_first", tokens: int = 1024, layers: int = LAYERS,
              heads: int = HEADS, head_dim: int = HEAD_DIM, page: int = PAGE,
              dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real SGLang MHA host pool on CPU, `2 * tokens` host tokens."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1)


def mamba_pool(slots: int = 8, layers: int = 2, side_state: bool = False) -> Any:
    """A real SGLang Mamba state host pool on CPU (page_first: one object per state slot):
    temporal state 4 x 32 x 64 fp32 and one conv state 64 x 3 bf16 per layer, 64.75 KiB per
    slot with 2 layers; `side_state` adds a registered extra checkpoint buffer."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 32, 64, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, 64, 3, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(slots, 16, dtype=torch.int32),) if side_state else (),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1, model: str = MODEL) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=extra,
    )


def umbp_extra(socket: str, **more: Any) -> dict:
    return {"backend_name": "umbp", "module_path": "umbp.sglang", "class_name": "UMBPHiCacheStorage",
            "interface_v1": 1, "endpoint": socket, "timeout_ms": 2000, "startup_timeout_ms": 5000, **more}


def make_backend(hp: Any, extra: dict, backend: str = "dynamic", **cfg: Any) -> Any:
    """The backend exactly as the HiCache controller attaches it (cache_controller.py)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend(backend, storage_config(extra, **cfg), hp)
    b.register_mem_pool_host(hp)
    b.on_host_pools_registered()
    return b


def controller(hp: Any, extra: Optional[dict], backend: str = "dynamic", model: str = MODEL) -> Any:
    """SGLang's real `HiCacheController` over a real CPU device pool (MHATokenToKVPool +
    its paged allocator) and `hp`, single rank (no process groups: its rank reductions are
    no-ops), with its storage threads running; `extra` None: no storage backend."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    # What the scheduler process publishes at startup: one rank, no PP/DCP.
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    tokens = hp.size // 2
    dev = MHATokenToKVPool(tokens, hp.page_size, hp.dtype, hp.head_num, hp.head_dim, hp.layer_num, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(tokens, hp.page_size, hp.dtype, "cpu", dev, False)
    return HiCacheController(alloc, hp, hp.page_size, None, threading.Event(), io_backend="direct",
                             storage_backend=None if extra is None else backend, model_name=model,
                             storage_backend_extra_config=extra)


def hybrid_controller(kv: Any, mamba: Any, extra: dict, model: str = MODEL) -> Any:
    """SGLang's real `HybridCacheController` (what SGLang runs for Mamba-hybrid models) over
    a `HostPoolGroup` of the KV host pool (anchor, with a CPU device pool) and a Mamba
    state host pool; it attaches the backend and registers the Mamba pool through
    `register_mem_host_pool_v2`. The Mamba entry has no device pool: only the storage
    (host <-> L3) path runs here."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    tokens, n = kv.size // 2, kv.layer_num
    dev = MHATokenToKVPool(tokens, kv.page_size, kv.dtype, kv.head_num, kv.head_dim, n, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(tokens, kv.page_size, kv.dtype, "cpu", dev, False)
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=kv, device_pool=dev,
                         layer_mapping={i: i for i in range(n)}, transfer_layer_id_max=n, is_anchor=True),
        build_pool_entry(name=PoolName.MAMBA, host_pool=mamba, device_pool=None, layer_mapping={},
                         transfer_layer_id_max=n),
    ])
    return HybridCacheController(alloc, group, kv.page_size, None, threading.Event(), io_backend="direct",
                                 storage_backend="dynamic", model_name=model, storage_backend_extra_config=extra)


def mamba_transfer(host_indices: Any = None, keys: Optional[list] = None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(PoolName.MAMBA, host_indices=host_indices, keys=keys if keys is not None else [None],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)


def hybrid_backup(cc: Any, host_indices: Any, tokens: list[int], mamba_slot: Any, timeout: float = 60) -> int:
    """`write_storage` with the Mamba state of the last page as a trailing extra pool."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=cc.page_size)
    op_id = cc.write_storage(host_indices, tokens, hash_value=hashes,
                             extra_pools=[mamba_transfer(mamba_slot, hashes[-1:])])
    op = cc.ack_backup_queue.get(timeout=timeout)
    assert op.id == op_id
    return int(op.completed_tokens)


def hybrid_prefetch(cc: Any, mamba: Any, tokens: list[int], timeout: float = 60) -> dict:
    """`prefetch` with a trailing Mamba transfer, driven as the radix cache does: hit
    query (batch_exists_v2), host pages for the KV hit and a Mamba slot, then the io
    thread (KV batch_get_v1, Mamba batch_get_v2)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.radix_cache import RadixKey

    op = cc.prefetch(SimpleNamespace(rid="req-" + str(os.getpid())), RadixKey(tokens), extra_pools=[mamba_transfer()])
    got = cc.prefetch_hit_queue.get(timeout=timeout)
    assert got is op
    out = {"hit_tokens": int(op.storage_hit_count),
           "pool_hits": {str(getattr(k, "value", k)): v for k, v in op.query_pool_hit_pages.items()},
           "completed_tokens": 0, "mamba_pages": 0, "kv_indices": None, "mamba_slot": None}
    if op.storage_hit_count == 0:
        return out
    out["kv_indices"] = op.host_indices = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    out["mamba_slot"] = op.pool_transfers[0].host_indices = mamba.alloc(1)
    cc.prefetch_buffer.put(op)
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=timeout)
        if ack.completed_tokens is not None:
            out["completed_tokens"] = max(out["completed_tokens"], int(ack.completed_tokens))
        if ack.pool_hits:
            out["mamba_pages"] = int({str(getattr(k, "value", k)): v for k, v in ack.pool_hits.items()}["mamba"])
        if ack.completed_req:
            return out


def controller_backup(cc: Any, host_indices: Any, tokens: list[int], timeout: float = 60) -> int:
    """`write_storage` as the radix cache calls it; the backup thread's completed tokens."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=cc.page_size)
    op_id = cc.write_storage(host_indices, tokens, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=timeout)
    assert op.id == op_id
    return int(op.completed_tokens)


def controller_prefetch(cc: Any, tokens: list[int], timeout: float = 60) -> tuple[int, int, Any]:
    """`prefetch` as the radix cache drives it: the prefetch thread's storage hit query,
    then (as the scheduler's drain does) host pages for the hit into `prefetch_buffer`, then
    the io thread's transfer. (hit tokens, completed tokens, host indices or None)."""
    op = cc.prefetch("req-" + str(os.getpid()), tokens)
    got = cc.prefetch_hit_queue.get(timeout=timeout)
    assert got is op
    hit = int(op.storage_hit_count)
    if hit == 0:
        return 0, 0, None
    idx = cc.alloc_prefetch_host_buffers(op, hit)
    op.hash_value = op.hash_value[: hit // cc.page_size]
    op.host_indices = idx
    cc.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=timeout)
        if ack.completed_tokens is not None:
            done = max(done, int(ack.completed_tokens))
        if ack.completed_req:
            return hit, done, idx


def tokens_of(seed: int, npages: int, page: int = PAGE) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (npages * page,), generator=g).tolist()


def page_hashes(tokens: list[int], page: int = PAGE) -> list[str]:
    """SGLang's own storage page hashes (sha256 chain over each page's tokens)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    return [str(h) for h in get_hash_str(tokens, None, page_size=page)]


def fill_pages(hp: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Deterministic bytes in every page of `host_indices`, through the pool's own API."""
    ps = hp.page_size
    for i in range(0, host_indices.numel(), ps):
        idx = int(host_indices[i])
        flat = expected_page(hp, seed, i // ps)
        hp.set_from_flat_data_page(idx, flat)


def expected_page(hp: Any, seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + n)
    ref = hp.get_dummy_flat_data_page()
    raw = torch.randint(-(2**15), 2**15, (ref.numel(),), generator=g, dtype=torch.int32).to(torch.int16)
    return raw.view(ref.dtype)


def page_bytes(hp: Any, idx: int) -> bytes:
    """The page at token `idx` as bytes; `get_data_page` and `set_from_flat_data_page`
    use the same (layout's) order, so this equals the flat page written there."""
    return hp.get_data_page(idx, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def main(argv: list[str]) -> int:
    op, sock, layout, seed, npages = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    hp = host_pool(layout)
    if op.startswith("ctl-"):
        return controller_main(op, hp, sock, seed, npages)
    if op.startswith("hyb-"):
        return hybrid_main(op, hp, sock, seed, npages)
    b = make_backend(hp, umbp_extra(sock))
    keys = page_hashes(tokens_of(seed, npages))
    if op == "store":
        idx = hp.alloc(npages * hp.page_size)
        fill_pages(hp, idx, seed)
        ok = b.batch_set_v1(keys, idx)
        out = {"op": op, "ok": ok, "pid": os.getpid()}
    else:
        hp.alloc(3 * hp.page_size)  # land the pages elsewhere than the writer had them
        idx = hp.alloc(npages * hp.page_size)
        hit = b.batch_exists(keys)
        ok = b.batch_get_v1(keys, idx)
        exact = [page_bytes(hp, int(idx[i * hp.page_size])) ==
                 expected_page(hp, seed, i).contiguous().view(torch.uint8).numpy().tobytes()
                 if ok[i] else None for i in range(npages)]
        out = {"op": op, "hit": hit, "ok": ok, "exact": exact, "pid": os.getpid()}
    b.close()
    print(json.dumps(out), flush=True)
    return 0


def controller_main(op: str, hp: Any, sock: str, seed: int, npages: int) -> int:
    """ctl-store / ctl-load: the same through SGLang's HiCacheController."""
    cc = controller(hp, umbp_extra(sock))
    tokens = tokens_of(seed, npages)
    out: dict = {"op": op, "pid": os.getpid(), "backend": type(cc.storage_backend).__name__,
                 "zero_copy": cc.page_get_func.__name__ == "_page_get_zero_copy"}
    if op == "ctl-store":
        idx = hp.alloc(npages * hp.page_size)
        fill_pages(hp, idx, seed)
        out["completed_tokens"] = controller_backup(cc, idx, tokens)
    else:
        hp.alloc(3 * hp.page_size)  # land the pages elsewhere than the writer had them
        hit, done, idx = controller_prefetch(cc, tokens)
        out.update(hit_tokens=hit, completed_tokens=done)
        out["exact"] = [page_bytes(hp, int(idx[i * hp.page_size])) ==
                        expected_page(hp, seed, i).contiguous().view(torch.uint8).numpy().tobytes()
                        for i in range(done // hp.page_size)] if idx is not None else []
    cc.detach_storage_backend()
    print(json.dumps(out), flush=True)
    return 0


def mamba_state(mamba: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 31 + 7)
    ref = mamba.get_dummy_flat_data_page()
    return torch.randint(0, 256, (ref.numel(),), generator=g, dtype=torch.int32).to(torch.uint8)


def hybrid_main(op: str, hp: Any, sock: str, seed: int, npages: int) -> int:
    """hyb-store / hyb-load: KV + Mamba state through SGLang's HybridCacheController."""
    mamba = mamba_pool()
    cc = hybrid_controller(hp, mamba, umbp_extra(sock))
    tokens = tokens_of(seed, npages)
    out: dict = {"op": op, "pid": os.getpid(), "pools": sorted(cc.storage_backend.pools)}
    if op == "hyb-store":
        idx = hp.alloc(npages * hp.page_size)
        fill_pages(hp, idx, seed)
        slot = mamba.alloc(1)
        mamba.set_from_flat_data_page(int(slot[0]), mamba_state(mamba, seed))
        out["completed_tokens"] = hybrid_backup(cc, idx, tokens, slot)
    else:
        hp.alloc(3 * hp.page_size)
        mamba.alloc(2)  # other slots than the writer's
        r = hybrid_prefetch(cc, mamba, tokens)
        idx, slot = r.pop("kv_indices"), r.pop("mamba_slot")
        out.update(r)
        done = r["completed_tokens"] // hp.page_size
        out["exact"] = [page_bytes(hp, int(idx[i * hp.page_size])) ==
                        expected_page(hp, seed, i).contiguous().view(torch.uint8).numpy().tobytes()
                        for i in range(done)]
        out["mamba_exact"] = (slot is not None and r["mamba_pages"] == 1 and
                              torch.equal(mamba.get_data_page(int(slot[0])), mamba_state(mamba, seed)))
    cc.detach_storage_backend()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
