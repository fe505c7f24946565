"""SGLang's host pools -> the pool's KV layout (pure address arithmetic).

The pool copies objects between its DRAM and memory this process registered; one object
is one SGLang page (`page_size` tokens) and is described by segments
`(storage, offset, block_stride, page_bytes, num_blocks)`: block `b` of a segment is the
byte range `offset + b * block_stride .. + page_bytes` of the storage (docs/architecture.md).
A host pool's storages are the tensors of its `kv_buffer` (one for MHA/MLA pools, one per
state kind for Mamba pools), each registered with the pool.

SGLang's host pools already describe a page's memory for zero-copy backends:
`get_page_buffer_meta(indices)` returns the (pointer, size) pieces of the pages at token
`indices`, in the order every zero-copy backend (mooncake, mori) stores them. The pieces of
page 0 give the segments' offsets and sizes, page 1 gives their strides, and the last page
is checked against both: a host pool whose pages are not an affine function of the page
number is refused with the numbers, rather than stored wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HostLayout:
    buffers: list[tuple[int, int]]  # (address, bytes) of each registered range
    page_size: int  # tokens (Mamba: state slots) per page = per pool object
    num_pages: int
    # (buffer index, offset, block_stride, page_bytes, num_blocks)
    segments: list[tuple[int, int, int, int, int]]

    @property
    def object_bytes(self) -> int:
        return sum(s[3] for s in self.segments)

    def as_tuples(self, alloc_ids: list[int]) -> list[tuple[int, int, int, int, int]]:
        """`Worker.register_layout`'s form, `alloc_ids[i]` being buffer i's registration."""
        return [(alloc_ids[b], o, st, pb, n) for (b, o, st, pb, n) in self.segments]


def host_buffers(host_pool: Any) -> list[torch.Tensor]:
    """The tensors holding the host pool's pages: `kv_buffer`, one tensor (MHA/MLA pools)
    or a list of them (Mamba: temporal state, then the conv states)."""
    buf = getattr(host_pool, "kv_buffer", None)
    bufs = [buf] if isinstance(buf, torch.Tensor) else list(buf) if isinstance(buf, (list, tuple)) else []
    if not bufs or not all(isinstance(b, torch.Tensor) for b in bufs):
        raise ValueError(
            f"UMBP: host pool {type(host_pool).__name__} has no kv_buffer tensor(s) "
            f"(got {type(buf).__name__}); only pools whose pages live in kv_buffer can be registered"
        )
    for b in bufs:
        if b.device.type != "cpu":
            raise ValueError(f"UMBP: host pool {type(host_pool).__name__} buffer is on {b.device}, expected host memory")
    return bufs


def host_layout(host_pool: Any) -> HostLayout:
    """Segments of one page of `host_pool`, checked on the first, second and last page."""
    kind = f"{type(host_pool).__name__} (layout {getattr(host_pool, 'layout', None)})"
    ranges = []
    for b in host_buffers(host_pool):
        st = b.untyped_storage()
        ranges.append((int(st.data_ptr()), int(st.nbytes())))
    ps = int(host_pool.page_size)
    n = int(host_pool.page_num)
    if n < 2:
        raise ValueError(f"UMBP: host pool {kind} has {n} page(s); need at least 2")

    def meta(page: int) -> tuple[list[int], list[int]]:
        try:
            ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page * ps, (page + 1) * ps))
        except (NotImplementedError, ValueError, AssertionError) as e:
            raise ValueError(f"UMBP: host pool {kind} has no zero-copy page description: {e}") from e
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def owner(ptr: int, size: int) -> int:
        for i, (base, nbytes) in enumerate(ranges):
            if base <= ptr and ptr + size <= base + nbytes:
                return i
        raise ValueError(f"UMBP: host pool {kind}: piece at {ptr:#x} ({size} bytes) is in none of its kv_buffer tensors")

    p0, s0 = meta(0)
    p1, s1 = meta(1)
    pl, sl = meta(n - 1)
    if not p0 or len(p0) != len(s0) or len(p1) != len(p0) or len(pl) != len(p0) or s1 != s0 or sl != s0:
        raise ValueError(
            f"UMBP: host pool {kind} describes pages with differing pieces: page 0 {len(p0)} "
            f"sizes {s0[:4]}, page 1 {len(p1)}, page {n - 1} {len(pl)}"
        )
    segs = []
    for j, (a, b, last, size) in enumerate(zip(p0, p1, pl, s0)):
        i = owner(a, size)
        base, nbytes = ranges[i]
        off, stride = a - base, b - a
        if off < 0 or stride < size or last != a + (n - 1) * stride or off + (n - 1) * stride + size > nbytes:
            raise ValueError(
                f"UMBP: host pool {kind} piece {j}: offset {off}, stride {stride}, size {size}, "
                f"last page at {last - base} (expected {off + (n - 1) * stride}), buffer {nbytes} "
                "bytes: not an affine page layout"
            )
        segs.append((i, off, stride, size, n))
    return HostLayout(ranges, ps, n, merge_adjacent(segs))


def merge_adjacent(segs: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Fuse pieces that sit back to back in every page of one buffer (fewer copies, same bytes)."""
    out: list[tuple[int, int, int, int, int]] = []
    for s in segs:
        if out:
            b, o, st, pb, n = out[-1]
            if b == s[0] and st == s[2] and n == s[4] and s[1] == o + pb and pb + s[3] <= st:
                out[-1] = (b, o, st, pb + s[3], n)
                continue
        out.append(s)
    return out
