"""Throwaway probe connector: logs every call vLLM makes to a KV connector.

Not product code. Used by `vllm_smoke.py` to record what vLLM 0.32 actually calls, in which
process/thread, in what order and with which arguments (see docs/vllm-interface-notes.md).

Each call appends one JSON line to `extra_config["probe_log"]` (or `$PROBE_LOG`):
    {"seq", "t", "pid", "thread", "role", "method", "args": {...}, "ret": ...}
Tensors are described by shape/stride/dtype/data_ptr/storage, bytes by length + hex prefix,
other objects by their fields (depth-limited).

With `extra_config["probe_store_dir"]` set, it also works as a minimal file-backed prefix
store (like vLLM's ExampleConnector, but block-granular and keyed by vLLM block hashes) so
the load/store paths run for real:
  * scheduler: leading full blocks whose hash file exists are reported as hits;
    `probe_load_async` picks async (get_finished) or sync (layer-wise) loading;
  * worker: after the forward (`wait_for_save`) new full prompt blocks are saved, per
    layer, to `<dir>/<hash hex>.pt`; loads copy them back into the paged KV tensors.
    If a file `<dir>/CORRUPT` exists, loaded blocks are perturbed (to show that the
    output depends on the restored KV).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

_LOCK = threading.Lock()
_SEQ = [0]


def describe(obj: Any, depth: int = 0) -> Any:
    """JSON-able summary of an argument."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        d = {
            "tensor": True,
            "shape": list(obj.shape),
            "stride": list(obj.stride()),
            "dtype": str(obj.dtype),
            "device": str(obj.device),
            "contiguous": obj.is_contiguous(),
        }
        try:
            st = obj.untyped_storage()
            d.update(
                data_ptr=obj.data_ptr(),
                storage_ptr=st.data_ptr(),
                storage_nbytes=st.nbytes(),
                storage_offset_elems=obj.storage_offset(),
                element_size=obj.element_size(),
            )
        except Exception as e:  # noqa: BLE001 - probe: record, don't fail
            d["storage_error"] = repr(e)
        if obj.numel() <= 16 and obj.device.type == "cpu":
            d["values"] = obj.tolist()
        return d
    if isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        return {"bytes_type": type(obj).__name__, "len": len(b), "hex_prefix": b[:12].hex()}
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__name__}.{obj.name}"
    if depth > 3:
        return f"<{type(obj).__name__}>"
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
        out: dict[str, Any] = {"seq_type": type(obj).__name__, "len": len(items)}
        if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            out["ints"] = items[:64]
        else:
            out["items"] = [describe(x, depth + 1) for x in items[:4]]
        if items:
            out["elem_types"] = sorted({type(x).__name__ for x in items})
        return out
    if isinstance(obj, dict):
        return {
            "dict_len": len(obj),
            "items": {str(k): describe(v, depth + 1) for k, v in list(obj.items())[:12]},
        }
    name = type(obj).__name__
    fields: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = [k for k in getattr(obj, "__dict__", {}) if not k.startswith("__")]
    for k in names[:40]:
        try:
            fields[k] = describe(getattr(obj, k), depth + 1)
        except Exception as e:  # noqa: BLE001
            fields[k] = f"<error {e!r}>"
    return {"type": name, "fields": fields} if fields else f"<{name}>"


def describe_request(req: Any) -> dict[str, Any]:
    hashes = list(getattr(req, "block_hashes", []) or [])
    return {
        "request_id": req.request_id,
        "status": describe(getattr(req, "status", None)),
        "num_tokens": req.num_tokens,
        "num_prompt_tokens": req.num_prompt_tokens,
        "num_computed_tokens": req.num_computed_tokens,
        "num_output_tokens": len(req.output_token_ids),
        "block_hashes": {
            "container": type(req.block_hashes).__name__,
            "len": len(hashes),
            "elem_types": sorted({type(h).__name__ for h in hashes}),
            "elem_lens": sorted({len(h) for h in hashes}) if hashes else [],
            "first_hex": bytes(hashes[0]).hex() if hashes else None,
        },
        "kv_transfer_params": describe(getattr(req, "kv_transfer_params", None)),
    }


@dataclass
class _Op:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    loads: list[_Op] = field(default_factory=list)
    stores: list[_Op] = field(default_factory=list)
    load_async: bool = False


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._log_path = extra.get("probe_log") or os.environ.get("PROBE_LOG", "/tmp/probe.jsonl")
        self._store_dir = extra.get("probe_store_dir")
        self._load_async = bool(extra.get("probe_load_async", False))
        self._block_size = vllm_config.cache_config.block_size
        self._hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self._block_size
        # scheduler state
        self._pending_loads: dict[str, _Op] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._req_stored: dict[str, int] = {}
        self._reqs: dict[str, Any] = {}
        self._local_hit: dict[str, int] = {}
        # worker state
        self._kv: dict[str, torch.Tensor] = {}
        self._finished_recving: set[str] = set()
        pc = vllm_config.parallel_config
        self._log(
            "__init__",
            role=describe(role),
            kv_transfer_config=describe(self._kv_transfer_config),
            parallel=dict(
                tensor_parallel_size=pc.tensor_parallel_size,
                pipeline_parallel_size=pc.pipeline_parallel_size,
                data_parallel_size=pc.data_parallel_size,
                data_parallel_rank=pc.data_parallel_rank,
                data_parallel_rank_local=getattr(pc, "data_parallel_rank_local", None),
                rank=getattr(pc, "rank", None),
                distributed_executor_backend=str(pc.distributed_executor_backend),
            ),
            cache_config=dict(
                block_size=vllm_config.cache_config.block_size,
                cache_dtype=str(vllm_config.cache_config.cache_dtype),
                kv_cache_layout=getattr(vllm_config.cache_config, "kv_cache_layout", None),
                enable_prefix_caching=vllm_config.cache_config.enable_prefix_caching,
                prefix_caching_hash_algo=str(
                    getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
                ),
            ),
            model_config=dict(
                model=vllm_config.model_config.model,
                revision=vllm_config.model_config.revision,
                dtype=str(vllm_config.model_config.dtype),
            ),
            kv_cache_config=describe(kv_cache_config),
            tp_rank_from_distributed=self._tp_rank(),
            env_layout=os.environ.get("VLLM_KV_CACHE_LAYOUT"),
        )

    # ---- helpers ----------------------------------------------------------------------
    @staticmethod
    def _tp_rank() -> Any:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return get_tensor_model_parallel_rank()
        except Exception as e:  # noqa: BLE001
            return f"<unavailable: {type(e).__name__}>"

    def _log(self, method: str, ret: Any = "<none>", **args: Any) -> None:
        with _LOCK:
            _SEQ[0] += 1
            rec = {
                "seq": _SEQ[0],
                "t": round(time.time(), 4),
                "pid": os.getpid(),
                "thread": threading.current_thread().name,
                "role": "scheduler" if self._role == KVConnectorRole.SCHEDULER else "worker",
                "method": method,
                "args": args,
            }
            if ret != "<none>":
                rec["ret"] = describe(ret)
            with open(self._log_path, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

    def _block_hashes(self, request) -> list[bytes]:
        hashes = [bytes(h) for h in request.block_hashes]
        k = self._block_size // self._hash_block_size
        return hashes[k - 1 :: k] if k > 1 else hashes

    def _path(self, h: bytes) -> str:
        return os.path.join(self._store_dir, h.hex() + ".pt")

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        ext, is_async = 0, False
        if self._store_dir:
            n = 0
            for h in self._block_hashes(request):
                if not os.path.exists(self._path(h)):
                    break
                n += 1
            hit = min(n * self._block_size, request.num_tokens - 1)
            if hit > num_computed_tokens:
                ext, is_async = hit - num_computed_tokens, self._load_async
        self._local_hit[request.request_id] = num_computed_tokens
        self._log(
            "get_num_new_matched_tokens",
            ret=(ext, is_async),
            request=describe_request(request),
            num_computed_tokens=num_computed_tokens,
        )
        return ext, is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        block_ids = blocks.get_block_ids()
        self._log(
            "update_state_after_alloc",
            request=describe_request(request),
            blocks_type=type(blocks).__name__,
            block_ids=describe(block_ids),
            num_external_tokens=num_external_tokens,
        )
        self._reqs[request.request_id] = request
        if num_external_tokens > 0:
            # Blocks [first, total) receive the external tokens; the local prefix-cache hit
            # (remembered from the last get_num_new_matched_tokens call) comes first.
            bs = self._block_size
            num_local = self._local_hit.get(request.request_id, 0)
            first = num_local // bs
            total = (num_local + num_external_tokens + bs - 1) // bs
            hashes = self._block_hashes(request)
            ids = list(block_ids[0])
            self._pending_loads[request.request_id] = _Op(
                request.request_id, hashes[first:total], ids[first:total]
            )

    def build_connector_meta(self, scheduler_output):
        meta = ProbeMetadata(load_async=self._load_async)
        meta.loads = list(self._pending_loads.values())
        self._pending_loads.clear()
        if self._store_dir:
            bs = self._block_size
            for nr in scheduler_output.scheduled_new_reqs:
                self._req_blocks[nr.req_id] = list(nr.block_ids[0])
                self._req_stored.setdefault(nr.req_id, 0)
            cr = scheduler_output.scheduled_cached_reqs
            for i, rid in enumerate(cr.req_ids):
                nb = cr.new_block_ids[i]
                if nb is not None:
                    self._req_blocks.setdefault(rid, []).extend(nb[0])
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                req = self._reqs.get(rid)
                if req is None:
                    continue
                done = min(req.num_computed_tokens + n, req.num_prompt_tokens)
                full = done // bs
                lo = self._req_stored.get(rid, 0)
                if full > lo:
                    hashes = self._block_hashes(req)
                    ids = self._req_blocks.get(rid, [])
                    todo = [
                        (hashes[b], ids[b])
                        for b in range(lo, min(full, len(hashes), len(ids)))
                        if not os.path.exists(self._path(hashes[b]))
                    ]
                    if todo:
                        meta.stores.append(_Op(rid, [h for h, _ in todo], [b for _, b in todo]))
                    self._req_stored[rid] = full
        self._log(
            "build_connector_meta",
            scheduler_output=dict(
                scheduled_new_reqs=[
                    dict(
                        req_id=r.req_id,
                        block_ids=describe(r.block_ids),
                        num_computed_tokens=r.num_computed_tokens,
                        prompt_len=len(r.prompt_token_ids or []),
                    )
                    for r in scheduler_output.scheduled_new_reqs
                ],
                scheduled_cached_reqs=repr(scheduler_output.scheduled_cached_reqs),
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
                finished_req_ids=sorted(scheduler_output.finished_req_ids),
                preempted_req_ids=describe(scheduler_output.preempted_req_ids),
                has_sync_kv_loads=scheduler_output.has_sync_kv_loads,
                new_block_ids_to_zero=describe(scheduler_output.new_block_ids_to_zero),
            ),
            meta=describe(meta),
        )
        return meta

    def request_finished(self, request, block_ids):
        self._log(
            "request_finished",
            ret=(False, None),
            request=describe_request(request),
            block_ids=describe(block_ids),
        )
        for d in (self._req_blocks, self._req_stored, self._reqs, self._local_hit):
            d.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output):
        if not connector_output.is_empty():
            self._log("update_connector_output", connector_output=describe(connector_output))

    def take_events(self):
        self._log("take_events")
        return ()

    def get_kv_connector_stats(self):
        self._log("get_kv_connector_stats(%s)" % ("scheduler" if self._role == KVConnectorRole.SCHEDULER else "worker"))
        return None

    def reset_cache(self):
        self._log("reset_cache", ret=True)
        return True

    def bind_kv_cache_manager(self, kv_cache_manager):
        self._log("bind_kv_cache_manager", manager=type(kv_cache_manager).__name__)
        super().bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request):
        self._log("on_new_request", request=describe_request(request))

    def get_loaded_kv_cache_group_ids(self, request):
        ret = super().get_loaded_kv_cache_group_ids(request)
        self._log("get_loaded_kv_cache_group_ids", ret=ret, request_id=request.request_id)
        return ret

    def has_pending_block_frees(self):
        return False

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self._kv = dict(kv_caches)
        self._log(
            "register_kv_caches",
            kv_caches={k: describe(v) for k, v in kv_caches.items()},
            kv_cache_config_layout=getattr(self._kv_cache_config, "kv_cache_layout", None),
            cache_config_layout=getattr(self._vllm_config.cache_config, "kv_cache_layout", None),
            tp_rank=self._tp_rank(),
        )

    def bind_connector_metadata(self, connector_metadata):
        self._log("bind_connector_metadata", meta=describe(connector_metadata))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self):
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata):
        self._log("handle_preemptions", meta=describe(kv_connector_metadata))

    def start_load_kv(self, forward_context, **kwargs):
        fc = forward_context
        self._log(
            "start_load_kv",
            forward_context_type=type(fc).__name__,
            attn_metadata=describe(getattr(fc, "attn_metadata", None), depth=2),
            no_compile_layers=sorted(getattr(fc, "no_compile_layers", {}) or {})[:8],
            kwargs=list(kwargs),
        )
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMetadata)
        corrupt = self._store_dir and os.path.exists(os.path.join(self._store_dir, "CORRUPT"))
        for op in meta.loads:
            for h, b in zip(op.hashes, op.block_ids):
                saved = torch.load(self._path(h))
                for name, t in self._kv.items():
                    src = saved[name]
                    if corrupt:
                        src = src.float().add(torch.randn_like(src.float()) * 4).to(src.dtype)
                    t[b].copy_(src)
            if meta.load_async:
                self._finished_recving.add(op.req_id)

    def wait_for_layer_load(self, layer_name):
        self._log("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._log(
            "save_kv_layer",
            layer_name=layer_name,
            kv_layer=describe(kv_layer),
            attn_metadata_type=type(attn_metadata).__name__,
            attn_metadata=describe(attn_metadata, depth=2),
            kwargs=list(kwargs),
        )

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        self._log("wait_for_save", num_stores=len(getattr(meta, "stores", [])))
        for op in getattr(meta, "stores", []):
            for h, b in zip(op.hashes, op.block_ids):
                blob = {name: t[b].clone() for name, t in self._kv.items()}
                tmp = self._path(h) + f".tmp{os.getpid()}"
                torch.save(blob, tmp)
                os.replace(tmp, self._path(h))

    def get_finished(self, finished_req_ids):
        recv, self._finished_recving = self._finished_recving, set()
        ret = (None, recv or None)
        self._log("get_finished", ret=ret, finished_req_ids=sorted(finished_req_ids))
        return ret

    def get_block_ids_with_load_errors(self):
        self._log("get_block_ids_with_load_errors", ret=set())
        return set()

    def build_connector_worker_meta(self):
        return None

    def get_kv_connector_kv_cache_events(self):
        return None

    def shutdown(self):
        self._log("shutdown")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None
