"""vLLM's paged KV tensors -> the pool's KV layout (docs/protocol.md §3 and docs/architecture.md "An object's life"): pure shape arithmetic.

The pool never sees tensors. It is told, once per worker, which memory ranges hold KV
("storages", registered with the pool) and a list of segments
`(storage, offset, block_stride, page_bytes, num_blocks)`: block `b` of a segment is the
byte range `offset + b * block_stride .. + page_bytes` of its storage, and one pool object
is block `b` of every segment, concatenated in order. Loads and stores then carry only
`(key, block id)` pairs.

Every vLLM layout whose block is one dense page per layer maps onto that:
* CPU `LBHNC` and GPU `LBNHC`/`LBHNC`: one segment per layer (a permuted page is still one
  dense range; the pool copies bytes, not elements);
* cross-layer `BLHNC`...: the per-layer views interleave, and adjacent segments merge into
  one, so an object is a single contiguous copy;
* legacy `(2, num_blocks, ...)` tensors (K and V apart): two segments per layer.
Anything else (a block scattered over several ranges) is refused at registration with the
shape and strides in the message, rather than stored wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class Storage:
    """One memory range to register with the pool (a tensor's whole storage)."""

    device: str  # "cpu" | "cuda"
    device_index: int
    base: int  # address of the storage's first byte
    nbytes: int


@dataclass(frozen=True)
class Segment:
    storage: int  # index into KVLayout.storages
    offset: int  # bytes from the storage base to block 0
    block_stride: int
    page_bytes: int
    num_blocks: int

    def as_tuple(self, alloc_ids: Sequence[int]) -> tuple[int, int, int, int, int]:
        """`Worker.register_layout`'s form, with the pool's alloc id for the storage."""
        return (alloc_ids[self.storage], self.offset, self.block_stride, self.page_bytes, self.num_blocks)


@dataclass(frozen=True)
class KVLayout:
    storages: list[Storage]
    segments: list[Segment]

    @property
    def object_bytes(self) -> int:
        return sum(s.page_bytes for s in self.segments)


def kv_layout(
    kv_caches: Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"],
    layer_names: Sequence[str],
    num_blocks: int,
) -> KVLayout:
    """The layout of `layer_names` (a cache group's layers, in order) in `kv_caches`."""
    names = [n for n in layer_names if n in kv_caches]
    if not names:
        raise ValueError("UMBP: none of the KV cache group's layers were registered")
    storages: list[Storage] = []
    by_base: dict[tuple[str, int, int], int] = {}
    segments: list[Segment] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    # A Mamba layer registers a list of state tensors (conv, ssm, ...), each one page per block.
    tensors = [
        (name, t)
        for name in names
        for t in (kv_caches[name] if isinstance(kv_caches[name], (list, tuple)) else [kv_caches[name]])
    ]
    for name, t in tensors:
        ident = (t.data_ptr(), tuple(t.shape))
        if ident in seen:  # a layer sharing another layer's KV: one copy suffices
            continue
        seen.add(ident)
        st = t.untyped_storage()
        base = int(st.data_ptr())
        dev = (t.device.type, t.device.index or 0, base)
        if dev not in by_base:
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"UMBP: KV cache on unsupported device {t.device}")
            by_base[dev] = len(storages)
            storages.append(Storage(t.device.type, t.device.index or 0, base, int(st.nbytes())))
        sid = by_base[dev]
        for v in block_views(t, num_blocks, name):
            es = v.element_size()
            page = dense_page_elems(v, name) * es
            stride = v.stride(0) * es
            if stride < page:
                raise ValueError(f"UMBP: layer {name}: blocks overlap (stride {stride} < page {page})")
            segments.append(Segment(sid, v.data_ptr() - base, stride, page, int(v.shape[0])))
    return KVLayout(storages, merge_adjacent(segments))


def merge_adjacent(segments: list[Segment]) -> list[Segment]:
    """Fuse segments whose pages sit back to back in every block.

    The object bytes stay the same (concatenation order is kept), but the pool then copies
    one range per block instead of one per layer: a cross-layer layout becomes one copy.
    """
    out: list[Segment] = []
    for s in segments:
        p = out[-1] if out else None
        if (
            p is not None
            and p.storage == s.storage
            and p.block_stride == s.block_stride
            and p.num_blocks == s.num_blocks
            and s.offset == p.offset + p.page_bytes
            and p.page_bytes + s.page_bytes <= p.block_stride
        ):
            out[-1] = Segment(p.storage, p.offset, p.block_stride, p.page_bytes + s.page_bytes, p.num_blocks)
        else:
            out.append(s)
    return out


def block_views(t: torch.Tensor, num_blocks: int, name: str) -> list[torch.Tensor]:
    """Per-layer tensor -> views whose dim 0 is the block index."""
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return [t]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [t[0], t[1]]  # (2, num_blocks, ...): K and V pages
    raise ValueError(
        f"UMBP: layer {name}: unsupported KV cache shape {tuple(t.shape)} "
        f"(expected ({num_blocks}, ...) or (2, {num_blocks}, ...))"
    )


def dense_page_elems(v: torch.Tensor, name: str) -> int:
    """Elements of one block; raise unless each block is one dense (maybe permuted) page."""
    dims = [(v.stride(i), v.shape[i]) for i in range(1, v.dim()) if v.shape[i] != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            raise ValueError(
                f"UMBP: layer {name}: a block is not one contiguous page "
                f"(shape {tuple(v.shape)}, stride {tuple(v.stride())}); this KV layout "
                "is not supported"
            )
        expected *= size
    return expected
