"""`UMBPHiCacheStorage`: SGLang's HiCache L3 storage backed by the node's UMBP pool.

Zero-copy: SGLang's host KV pool (`mem_pool_host.kv_buffer`) is registered with the pool
as process memory, once, with the layout of one page (layout.py); `batch_set_v1` and
`batch_get_v1` then post only (key, page number) pairs on the worker's rings and the pool
copies the pages between its DRAM and the host pool itself. `batch_exists` reads the
pool's shared-memory index (no RPC). Extra host pools of hybrid models (Mamba state,
SWA, indexer...; the `*_v2` forms) are registered the same way, under a key group each.
A pool that is down makes every lookup a miss and every transfer fail (SGLang
recomputes / skips the backup); the worker and the index re-attach by themselves when
the pool is back.

Threads: SGLang calls the backend from its prefetch and backup threads at once. Submits
and cancels are short native calls; waits are sliced (a few ms each) so that one thread's
wait never holds another's submit.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from umbp._keys_common import ENGINE_SGLANG, canonical_text, make_keys, namespace_of

from .config import UMBPSGLangConfig
from .layout import HostLayout, host_layout

logger = logging.getLogger("umbp.sglang")

NAMESPACE_SCHEME = "umbp-sglang-ns-v1"
GROUP_PAGES = 0  # zero-copy objects: a page in the host pool's own byte order
GROUP_FLAT = 1  # copying path: a page in get_dummy_flat_data_page's byte order
# Extra (v2) pools: one key group each, fixed so every process keys a pool alike.
EXTRA_GROUPS = {PoolName.MAMBA.value: 2, PoolName.SWA.value: 3, PoolName.AUXILIARY_SWA.value: 4,
                PoolName.INDEXER.value: 5, PoolName.DRAFT.value: 6, PoolName.DRAFT_SWA.value: 7,
                PoolName.DRAFT_INDEXER.value: 8}
_WAIT_SLICE_MS = 5


def extra_group(name: str) -> int:
    """The key group of extra pool `name` (a fixed table, else a CRC of the name above 15)."""
    name = str(name)
    return EXTRA_GROUPS.get(name, 16 + zlib.crc32(name.encode()) % 4096)


@dataclass(frozen=True)
class _Pool:
    """A host pool registered with the pool: its objects' group, rank in the key, layout."""

    name: str
    host_pool: Any
    layout: HostLayout
    group: int
    rank: int
    writer: bool
    # Extra pools: a digest of the pool's own shape, appended to every page hash of its
    # keys, so pools of different shapes under one namespace never share objects.
    salt: bytes = b""


class UMBPHiCacheStorage(HiCacheStorage):
    """Loaded by SGLang with `--hicache-storage-backend dynamic` and the extra config
    `{"backend_name": "umbp", "module_path": "umbp.sglang", "class_name":
    "UMBPHiCacheStorage", "interface_v1": 1, ...}` (config.py lists the options)."""

    def __init__(self, storage_config: HiCacheStorageConfig, *args: Any, **kwargs: Any):
        from umbp import _native

        self.n = _native
        self.storage_config = storage_config
        self.cfg = UMBPSGLangConfig.from_extra(storage_config.extra_config, _native.default_socket_path())
        sc = storage_config
        cp = max(1, int(getattr(sc, "attn_cp_size", 1) or 1))
        shard = int(sc.pp_rank) * cp + int(getattr(sc, "attn_cp_rank", 0) or 0)
        # MLA KV is the same on every TP rank: one copy (rank 0's key), one writer.
        self.rank = shard if sc.is_mla_model else shard * int(sc.tp_size) + int(sc.tp_rank)
        # Mamba state is TP-sharded even when the model's MLA KV is replicated.
        self.tp_sharded_rank = shard * int(sc.tp_size) + int(sc.tp_rank)
        self.num_ranks = int(sc.pp_size) * cp * (1 if sc.is_mla_model else int(sc.tp_size))
        self.is_writer = bool(getattr(sc, "is_storage_writer", True))
        self._lock = threading.Lock()  # submit / cancel / registration
        self._staging_lock = threading.Lock()
        self.w: Any = None
        self.index: Any = None
        self.namespace: bytes = b""
        self.namespace_text = ""
        self.layout: Optional[HostLayout] = None
        self.pools: dict[str, _Pool] = {}  # KV (the anchor) and every extra (v2) pool
        self._pending_v2: list[tuple[Any, str]] = []  # extra pools named before the anchor
        self._staging: Optional[torch.Tensor] = None
        self._stats = {"exists_calls": 0, "exists_hits": 0, "get_pages": 0, "get_failed": 0,
                       "set_pages": 0, "set_failed": 0}
        self.mem_pool_host = None
        # The built-in calling convention passes the host pool second; register it now.
        if args and hasattr(args[0], "get_page_buffer_meta"):
            self.register_mem_pool_host(args[0])

    # -- attachment -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        if self.mem_pool_host is mem_pool_host and self.w is not None:
            return
        super().register_mem_pool_host(mem_pool_host)
        self.layout = host_layout(mem_pool_host)
        self.namespace, self.namespace_text = self._namespace(mem_pool_host)
        cfg = self.cfg
        try:
            self.w = self.n.Worker(
                cfg.endpoint, self.namespace, tp_rank=self.rank, tp_size=self.num_ranks,
                timeout_ms=cfg.timeout_ms, startup_timeout_ms=cfg.startup_timeout_ms,
                pool_uid=cfg.pool_uid,
            )
        except Exception as e:
            raise RuntimeError(
                f"UMBP: cannot reach the pool at {cfg.endpoint!r} within {cfg.startup_timeout_ms} ms: "
                f"{e}. Start `umbp-pool` there or set extra config 'endpoint' / UMBP_STANDALONE_ADDRESS."
            ) from e
        self.pools[PoolName.KV.value] = self._register_pool(
            PoolName.KV.value, mem_pool_host, self.layout, GROUP_PAGES, self.rank, self.is_writer)
        lay = self.layout
        obj = lay.object_bytes
        self.index = self._attach_index()
        pending, self._pending_v2 = self._pending_v2, []
        for hp, name in pending:
            self._register_extra(hp, name)
        logger.info(
            "UMBP: SGLang host pool registered: %d pages of %d tokens, %d bytes per object in %d "
            "segment(s), rank %d, namespace %s (%s), pool %s",
            lay.num_pages, lay.page_size, obj, len(lay.segments), self.rank,
            self.namespace[::-1].hex(), self.namespace_text, cfg.endpoint,
        )

    def _register_pool(self, name: str, hp: Any, lay: HostLayout, group: int, rank: int, writer: bool) -> _Pool:
        """Registers the pool's buffers and its page layout under `group` with the pool."""
        with self._lock:
            allocs = [int(self.w.register_host_memory(base, nbytes)) for base, nbytes in lay.buffers]
            try:
                obj = int(self.w.register_layout(group, lay.as_tuples(allocs)))
            except Exception as e:
                raise RuntimeError(
                    f"UMBP: the pool refused the layout of SGLang's {name} host pool "
                    f"({type(hp).__name__}, {lay.object_bytes} bytes per page): {e}"
                ) from e
        if obj != lay.object_bytes:
            raise RuntimeError(f"UMBP: pool computed {obj} bytes per {name} page object, expected {lay.object_bytes}")
        salt = b"" if group == GROUP_PAGES else b"|" + bytes(self.n.namespace_digest(canonical_text({
            "pool": name, "host_pool": type(hp).__name__, "layout": getattr(hp, "layout", None),
            "page_size": lay.page_size, "pieces": [sg[3] for sg in lay.segments],
            "dtypes": sorted({str(getattr(hp, a)) for a in ("dtype", "conv_dtype", "temporal_dtype")
                              if getattr(hp, a, None) is not None}),
        })))
        return _Pool(name, hp, lay, group, rank, writer, salt)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool (Mamba, SWA, indexer...) for the v2 forms: registered with the
        pool under a key group of its own. A pool whose pages cannot be described for
        zero-copy transfers is refused here (the attach fails with its name) rather than
        silently never hitting."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == PoolName.KV.value:
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self.mem_pool_host:
                raise ValueError(
                    f"UMBP: a second KV host pool ({type(host_pool).__name__}) besides "
                    f"{type(self.mem_pool_host).__name__}: not supported"
                )
            return
        if self.w is None:
            self._pending_v2.append((host_pool, name))
            return
        self._register_extra(host_pool, name)

    def _register_extra(self, hp: Any, name: str) -> None:
        if name in self.pools and self.pools[name].host_pool is hp:
            return
        group = extra_group(name)
        clash = [p.name for p in self.pools.values() if p.group == group and p.name != name]
        if clash:
            raise ValueError(f"UMBP: SGLang pool {name!r} has key group {group}, as {clash[0]!r}")
        try:
            lay = host_layout(hp)
        except ValueError as e:
            raise ValueError(f"UMBP: cannot store SGLang's {name} pool ({type(hp).__name__}): {e}") from e
        mamba = name == PoolName.MAMBA.value
        rank = self.tp_sharded_rank if mamba else self.rank
        writer = True if mamba else self.is_writer
        self.pools[name] = self._register_pool(name, hp, lay, group, rank, writer)
        logger.info("UMBP: SGLang %s pool registered: %d pages of %d, %d bytes per object, group %d, rank %d",
                    name, lay.num_pages, lay.page_size, lay.object_bytes, group, rank)

    def _attach_index(self) -> Any:
        try:
            return self.n.Index(self.cfg.endpoint, namespace=self.namespace,
                                timeout_ms=max(1, self.cfg.startup_timeout_ms), pool_uid=self.cfg.pool_uid)
        except Exception as e:  # noqa: BLE001 - lazy: attaches whenever the pool is there
            logger.warning("UMBP: index at %s not attached yet (%s); lookups miss", self.cfg.endpoint, e)
            return self.n.Index(self.cfg.endpoint, namespace=self.namespace, timeout_ms=0,
                                pool_uid=self.cfg.pool_uid)

    def _namespace(self, hp: Any) -> tuple[bytes, str]:
        sc, cfg = self.storage_config, self.cfg
        if cfg.key_namespace is not None:
            return namespace_of(self.n, ENGINE_SGLANG, {"scheme": NAMESPACE_SCHEME, "user": cfg.key_namespace})
        lay = self.layout
        assert lay is not None
        desc = {
            "scheme": NAMESPACE_SCHEME,
            "model": sc.model_name,
            "revision": cfg.model_revision,
            "cache_salt": cfg.cache_salt,
            "host_pool": type(hp).__name__,
            "layout": getattr(hp, "layout", None),
            "dtype": str(getattr(hp, "dtype", None)),
            "page_size": lay.page_size,
            "object_bytes": lay.object_bytes,
            "segments": [(s[3]) for s in lay.segments],  # piece sizes: the byte order
            "layer_num": getattr(hp, "layer_num", None),
            "head_num": getattr(hp, "head_num", None),
            "head_dim": getattr(hp, "head_dim", None),
            "v_head_dim": getattr(hp, "v_head_dim", None),
            "kv_lora_rank": getattr(hp, "kv_lora_rank", None),
            "qk_rope_head_dim": getattr(hp, "qk_rope_head_dim", None),
            "is_mla": sc.is_mla_model,
            "tp": sc.tp_size,
            "pp": sc.pp_size,
            "cp": getattr(sc, "attn_cp_size", 1),
            "dcp": getattr(sc, "dcp_size", 1),
            "split_heads": getattr(sc, "should_split_heads", False),
            "tp_lcm": getattr(sc, "tp_lcm_size", None),
        }
        return namespace_of(self.n, ENGINE_SGLANG, desc)

    def keys_of(self, keys: List[str], group: int = GROUP_PAGES, rank: Optional[int] = None,
                salt: bytes = b"") -> list[bytes]:
        """Pool object keys of SGLang page hashes (the hash string's UTF-8 bytes, then `salt`)."""
        return make_keys(self.n, self.namespace, group, self.rank if rank is None else rank,
                         [k.encode() + salt for k in keys])

    # -- transfers ------------------------------------------------------------------------
    def _page_ids(self, n_keys: int, host_indices: torch.Tensor, lay: Optional[HostLayout] = None,
                  name: str = "kv") -> Optional[list[int]]:
        lay = lay or self.layout
        ps = lay.page_size if lay else 0
        if lay is None or host_indices is None or host_indices.numel() != n_keys * ps:
            logger.error("UMBP: %s pool: %d keys but %s host indices (page size %d)", name, n_keys,
                         None if host_indices is None else host_indices.numel(), ps)
            return None
        firsts = host_indices.reshape(n_keys, ps)[:, 0].tolist() if n_keys else []
        if any(int(f) % ps for f in firsts):
            logger.error("UMBP: %s pool: host indices not page aligned: %s", name, firsts[:8])
            return None
        return [int(f) // ps for f in firsts]

    def _run(self, kind: str, group: int, keys: list[bytes], ids: list[int]) -> list[int]:
        """Submit one transfer and wait for it (cancelling past timeout_ms); statuses."""
        if not keys:
            return []
        w = self.w
        if w is None:
            return []
        try:
            with self._lock:
                tid = int((w.store if kind == "store" else w.load)(group, keys, ids))
        except Exception as e:  # noqa: BLE001 - pool down / refusing: nothing moved
            logger.debug("UMBP: %s of %d page(s) not submitted: %s", kind, len(keys), e)
            return []
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        try:
            while True:
                res = w.wait(tid, _WAIT_SLICE_MS)
                if res is not None:
                    return list(res)
                if w.stalled or time.monotonic() >= deadline:
                    break
            return self._cancel(tid, kind)
        except Exception as e:  # noqa: BLE001
            logger.warning("UMBP: %s %d failed: %s", kind, tid, e)
            return []

    def _cancel(self, tid: int, kind: str) -> list[int]:
        """Cancel a transfer past its time. A load the pool already writes keeps its pages
        until it completes or the pool dies: SGLang frees them when we return, so we wait."""
        with self._lock:
            outcome = self.w.cancel(tid)
        logger.warning("UMBP: %s %d got no answer in %d ms; cancel: %s", kind, tid, self.cfg.timeout_ms, outcome)
        while True:
            res = self.w.wait(tid, 0 if outcome != "started" else self.cfg.timeout_ms)
            if res is not None:
                return list(res)
            if outcome != "started":
                return []

    def _pool_io(self, kind: str, pool: Optional[_Pool], keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        """Store or load the pages at `host_indices` of `pool` under `keys`; per page ok."""
        if pool is None:
            return [False] * len(keys)
        if kind == "store" and not pool.writer:
            return [True] * len(keys)  # the writer rank stores the same bytes (MLA)
        ids = self._page_ids(len(keys), host_indices, pool.layout, pool.name)
        if ids is None:
            return [False] * len(keys)
        st = self._run(kind, pool.group, self.keys_of(keys, pool.group, pool.rank, pool.salt), ids)
        ok = (self.n.STATUS_STORED, self.n.STATUS_ALREADY_PRESENT) if kind == "store" else (self.n.STATUS_LOADED,)
        res = [i < len(st) and st[i] in ok for i in range(len(keys))]
        pre = "set" if kind == "store" else "get"
        self._stats[f"{pre}_pages"] += len(keys)
        self._stats[f"{pre}_failed"] += res.count(False)
        return res

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._pool_io("store", self.pools.get(PoolName.KV.value), keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._pool_io("load", self.pools.get(PoolName.KV.value), keys, host_indices)

    # -- lookups --------------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        if self.index is None or not keys:
            return 0
        try:
            hit = int(self.index.match_prefix(self.keys_of(keys)))
        except Exception as e:  # noqa: BLE001 - a broken index is a miss
            logger.debug("UMBP: lookup failed: %s", e)
            hit = 0
        self._stats["exists_calls"] += 1
        self._stats["exists_hits"] += hit
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2 (pool-aware) forms: the KV pool and every registered extra pool -------------
    def _present(self, keys: List[str], pool: _Pool) -> list[bool]:
        """Per key: is `pool`'s object of it in the pool (index lookups, no RPC)."""
        if self.index is None or not keys:
            return [False] * len(keys)
        try:
            return [bool(self.index.contains(k)) for k in self.keys_of(keys, pool.group, pool.rank, pool.salt)]
        except Exception as e:  # noqa: BLE001 - a broken index is a miss
            logger.debug("UMBP: lookup failed: %s", e)
            return [False] * len(keys)

    def _extra_pool(self, name: Any) -> _Pool:
        name = str(getattr(name, "value", name))
        pool = self.pools.get(name)
        if pool is None:
            raise ValueError(
                f"UMBP: SGLang's {name} pool was never registered with this backend "
                f"(register_mem_host_pool_v2); registered: {sorted(self.pools)}"
            )
        return pool

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The longest KV prefix, cut to what every extra pool can restore (its hit policy:
        ALL_PAGES: its object for every page of the prefix; TRAILING_PAGES: for the last
        `len(transfer.keys)` pages of the prefix), as SGLang's own file backend does."""
        kv = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV.value: kv} if kv else {}
        restorable = list(range(1, kv + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            pool = self._extra_pool(t.name)
            present = self._present(keys[:kv], pool)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv + 1) if all(present[max(0, p - trailing):p])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"UMBP: hit policy {t.hit_policy} of SGLang's {pool.name} pool is not supported")
            if boundary:
                hits[pool.name] = boundary
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hits, restorable)

    def _v2(self, kind: str, transfers: List[PoolTransfer]) -> dict[str, List[bool]]:
        out: dict[str, List[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            name = str(getattr(t.name, "value", t.name))
            pool = self.pools.get(name)
            if pool is None:
                logger.error("UMBP: %s of %d page(s) of SGLang's %s pool, which was never registered "
                             "(registered: %s)", kind, len(keys), name, sorted(self.pools))
            out[t.name] = self._pool_io(kind, pool, keys, t.host_indices)
        return out

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._v2("load", transfers)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._v2("store", transfers)

    # -- copying forms (SGLang without interface_v1): flat pages through a staging buffer --
    def _staging_buffer(self) -> Optional[torch.Tensor]:
        if self._staging is not None:
            return self._staging
        if self.w is None or self.mem_pool_host is None:
            return None
        page = self.mem_pool_host.get_dummy_flat_data_page()
        nbytes = page.numel() * page.element_size()
        buf = torch.zeros(self.cfg.staging_pages * nbytes, dtype=torch.uint8)
        with self._lock:
            alloc = int(self.w.register_host_memory(buf.data_ptr(), buf.numel()))
            self.w.register_layout(GROUP_FLAT, [(alloc, 0, nbytes, nbytes, self.cfg.staging_pages)])
        self._staging, self._flat_bytes = buf, nbytes
        return buf

    def _copy_io(self, kind: str, keys: List[str], tensors: List[Any]) -> List[bool]:
        out: List[bool] = []
        with self._staging_lock:
            buf = self._staging_buffer()
            if buf is None:
                return [False] * len(keys)
            nb, cap = self._flat_bytes, self.cfg.staging_pages
            for s in range(0, len(keys), cap):
                ks, ts = keys[s:s + cap], tensors[s:s + cap]
                if kind == "store":
                    for i, t in enumerate(ts):
                        buf[i * nb:(i + 1) * nb].copy_(t.contiguous().view(-1).view(torch.uint8))
                st = self._run(kind, GROUP_FLAT, self.keys_of(ks, GROUP_FLAT), list(range(len(ks))))
                want = (self.n.STATUS_STORED, self.n.STATUS_ALREADY_PRESENT) if kind == "store" else (self.n.STATUS_LOADED,)
                for i, t in enumerate(ts):
                    ok = i < len(st) and st[i] in want
                    if ok and kind == "load":
                        t.view(-1).view(torch.uint8).copy_(buf[i * nb:(i + 1) * nb])
                    out.append(ok)
        return out

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        r = self.batch_get([key], [target_location])
        return r[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        ok = self._copy_io("load", keys, list(target_locations))
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if not self.is_writer:
            return True
        return all(self._copy_io("store", keys, list(values or [])))

    # -- housekeeping ---------------------------------------------------------------------
    def clear(self) -> None:
        """Drops every object of this backend's namespace from the pool."""
        if self.w is None:
            return
        try:
            with self._lock:
                n = int(self.w.reset_namespace())
            logger.info("UMBP: cleared %d object(s) of namespace %s", n, self.namespace[::-1].hex())
        except Exception as e:  # noqa: BLE001
            logger.warning("UMBP: clear failed: %s", e)

    def get_stats(self):
        return None

    def stats(self) -> dict:
        """This backend's counters (pages moved, failures, lookups)."""
        return dict(self._stats)

    def close(self) -> None:
        w, self.w = self.w, None
        if w is not None:
            w.close()


__all__ = ["UMBPHiCacheStorage", "NAMESPACE_SCHEME", "GROUP_PAGES", "GROUP_FLAT"]
