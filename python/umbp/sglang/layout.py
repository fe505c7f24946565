"""SGLang's host KV pool -> the pool's KV layout (pure address arithmetic).

The pool copies objects between its DRAM and memory this process registered; one object
is one SGLang page (`page_size` tokens) and is described by segments
`(storage, offset, block_stride, page_bytes, num_blocks)`: block `b` of a segment is the
byte range `offset + b * block_stride .. + page_bytes` of the storage (docs/architecture.md).

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
    base: int  # address of the registered range
    nbytes: int
    page_size: int  # tokens per page (= per pool object)
    num_pages: int
    segments: list[tuple[int, int, int, int]]  # (offset, block_stride, page_bytes, num_blocks)

    @property
    def object_bytes(self) -> int:
        return sum(s[2] for s in self.segments)

    def as_tuples(self, alloc_id: int) -> list[tuple[int, int, int, int, int]]:
        """`Worker.register_layout`'s form."""
        return [(alloc_id, o, st, pb, n) for (o, st, pb, n) in self.segments]


def host_buffer(host_pool: Any) -> torch.Tensor:
    """The one tensor holding the host pool's pages (`kv_buffer`)."""
    buf = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor):
        raise ValueError(
            f"UMBP: host pool {type(host_pool).__name__} has no kv_buffer tensor; "
            "only single-buffer host pools (MHA/MLA) can be registered"
        )
    if buf.device.type != "cpu":
        raise ValueError(f"UMBP: host pool buffer is on {buf.device}, expected host memory")
    return buf


def host_layout(host_pool: Any) -> HostLayout:
    """Segments of one page of `host_pool`, checked on the first, second and last page."""
    buf = host_buffer(host_pool)
    st = buf.untyped_storage()
    base, nbytes = int(st.data_ptr()), int(st.nbytes())
    ps = int(host_pool.page_size)
    n = int(host_pool.page_num)
    if n < 2:
        raise ValueError(f"UMBP: host pool has {n} page(s); need at least 2")

    def meta(page: int) -> tuple[list[int], list[int]]:
        ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page * ps, (page + 1) * ps))
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    p0, s0 = meta(0)
    p1, s1 = meta(1)
    pl, sl = meta(n - 1)
    if not p0 or len(p0) != len(s0) or len(p1) != len(p0) or len(pl) != len(p0) or s1 != s0 or sl != s0:
        raise ValueError(
            f"UMBP: host pool {type(host_pool).__name__} (layout {host_pool.layout}) describes "
            f"pages with differing pieces: page 0 {len(p0)} sizes {s0[:4]}, page 1 {len(p1)}, "
            f"page {n - 1} {len(pl)}"
        )
    segs = []
    for j, (a, b, last, size) in enumerate(zip(p0, p1, pl, s0)):
        off, stride = a - base, b - a
        if off < 0 or stride < size or last != a + (n - 1) * stride or off + (n - 1) * stride + size > nbytes:
            raise ValueError(
                f"UMBP: host pool {type(host_pool).__name__} (layout {host_pool.layout}) piece {j}: "
                f"offset {off}, stride {stride}, size {size}, last page at {last - base} "
                f"(expected {off + (n - 1) * stride}), buffer {nbytes} bytes: not an affine page layout"
            )
        segs.append((off, stride, size, n))
    return HostLayout(base, nbytes, ps, n, merge_adjacent(segs))


def merge_adjacent(segs: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Fuse pieces that sit back to back in every page (fewer copies, same bytes)."""
    out: list[tuple[int, int, int, int]] = []
    for s in segs:
        if out:
            o, st, pb, n = out[-1]
            if st == s[1] and n == s[3] and s[0] == o + pb and pb + s[2] <= st:
                out[-1] = (o, st, pb + s[2], n)
                continue
        out.append(s)
    return out
