"""What the scheduler side tells the workers each step, and what they answer.

Plain dataclasses of bytes, ints and strings: vLLM pickles them to worker processes, and
the worker metadata of all TP ranks is folded with `aggregate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockOp:
    """Transfer `hashes[i]` <-> paged KV block `block_ids[i]` for one request."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Loads only: True when vLLM holds the request in WAITING_FOR_REMOTE_KVS and expects it
    # in get_finished's "received" set; False for a load the forward waits for (sync).
    is_async: bool = False
    # The KV cache group (None: the metadata's `group`); hybrid models have several.
    group: int | None = None
    # Stores of blocks the scheduler pinned in vLLM's block pool (sliding-window and Mamba
    # groups, lazy offload): every worker reports the op in `ops_done` once the pool no
    # longer reads the blocks, and the scheduler unpins them when all ranks did. Such ops
    # are not tied to the request's lifetime (`store_done`).
    op_id: int | None = None


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    namespace: bytes = b""  # 16 bytes; each worker derives its own TP rank's keys from it
    group: int = 0  # the KV cache group the ops refer to
    loads: list[BlockOp] = field(default_factory=list)
    stores: list[BlockOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Finished requests whose free the scheduler delayed because some of their stores were
    # still in flight: each worker reports them as "finished sending" once its stores for
    # them are done (and only them: a report for a request whose blocks vLLM already freed
    # would break the scheduler).
    finish_after_stores: list[str] = field(default_factory=list)
    # reset_cache ran on the scheduler: every worker drops this engine's objects from its
    # pool before this step's transfers (only a worker attachment may ask the pool).
    reset_pool: bool = False


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers finished since their last report (summed over the workers: TP ranks
    × PCP ranks).

    `store_done`: request id -> number of its store ops whose outcome is known (stored,
    present, refused or not submitted); the scheduler compares it with the ops it planned
    to decide whether a finished request's blocks can be freed at once.
    `stored`: (KV cache group, block hash) -> number of ranks that now hold it in the pool
    (for KV events).
    """

    store_done: dict[str, int] = field(default_factory=dict)
    stored: dict[tuple[int, bytes], int] = field(default_factory=dict)
    ops_done: dict[int, int] = field(default_factory=dict)  # pinned store op -> ranks done

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, UMBPWorkerMetadata):
            for r, n in other.store_done.items():
                self.store_done[r] = self.store_done.get(r, 0) + n
            for h, n in other.stored.items():
                self.stored[h] = self.stored.get(h, 0) + n
            for o, n in other.ops_done.items():
                self.ops_done[o] = self.ops_done.get(o, 0) + n
        return self
