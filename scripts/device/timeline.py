#!/usr/bin/env python3
"""Where a GPU copy call idles: reads the CSVs of `nsys stats --report cuda_gpu_trace
--report cuda_api_trace --format csv` of one profiled run and prints, per copy call (GPU
work separated by more than --call-gap-us of idleness), the span, the time the copy
engines were busy (DMA), the kernels' busy time, and every idle gap of the DMA longer than
--gap-us with its cause: `cpu` when the API call that enqueued the next DMA (or the
kernel feeding it) started after the gap began (the GPU waited for the CPU), `gpu` when
it was enqueued before (the GPU waited on its own work: a kernel, an event).

  nsys profile -t cuda -o run umbp-bench transfer --backend cuda --layouts kv4k ...
  nsys stats -r cuda_gpu_trace -r cuda_api_trace -f csv -o run run.nsys-rep
  python3 scripts/device/timeline.py run_cuda_gpu_trace.csv run_cuda_api_trace.csv

One JSON object per call on stdout (diagnostics only; not a benchmark figure).
"""
import argparse
import csv
import json


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.strip() and not l.startswith("NOTICE") and not l.startswith("Processing")]
    return list(csv.DictReader(lines))


def col(row, *names):
    for n in names:
        for k in row:
            if k.strip().startswith(n):
                return row[k]
    raise KeyError(names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gpu_trace")
    ap.add_argument("api_trace")
    ap.add_argument("--gap-us", type=float, default=5.0, help="least DMA idle gap reported (us)")
    ap.add_argument("--call-gap-us", type=float, default=1000.0, help="GPU idle time that separates two calls (us)")
    ap.add_argument("--min-mb", type=float, default=50.0, help="least MB a call moves to be reported")
    a = ap.parse_args()

    api = {}
    for r in rows(a.api_trace):
        try:
            api[int(col(r, "CorrID", "CorrId"))] = int(col(r, "Start"))
        except (KeyError, ValueError):
            pass
    ops = []
    for r in rows(a.gpu_trace):
        name = col(r, "Name")
        start, dur = int(col(r, "Start")), int(col(r, "Duration"))
        try:
            mb = float(col(r, "Bytes (MB)", "Bytes") or 0)
        except ValueError:
            mb = 0.0
        kind = "dma" if "memcpy" in name.lower() and ("HtoD" in name or "DtoH" in name or "Host" in name) else "kernel"
        ops.append({"start": start, "end": start + dur, "kind": kind, "mb": mb, "corr": int(col(r, "CorrId", "CorrID") or 0), "name": name})
    ops.sort(key=lambda o: o["start"])

    calls, cur = [], []
    for o in ops:
        if cur and o["start"] - max(x["end"] for x in cur[-8:]) > a.call_gap_us * 1000:
            calls.append(cur)
            cur = []
        cur.append(o)
    if cur:
        calls.append(cur)

    for c in calls:
        dma = [o for o in c if o["kind"] == "dma"]
        mb = sum(o["mb"] for o in dma)
        if mb < a.min_mb:
            continue
        t0, t1 = c[0]["start"], max(o["end"] for o in c)
        busy, gaps, end = 0, [], None
        for o in dma:
            if end is not None and o["start"] > end:
                gap = o["start"] - end
                if gap >= a.gap_us * 1000:
                    enq = api.get(o["corr"])
                    gaps.append({"at_us": round((end - t0) / 1000, 1), "us": round(gap / 1000, 1),
                                 "cause": "unknown" if enq is None else ("cpu" if enq > end else "gpu"),
                                 "enqueued_after_gap_start_us": None if enq is None else round((enq - end) / 1000, 1)})
            s = o["start"] if end is None else max(o["start"], end)
            if o["end"] > s:
                busy += o["end"] - s
            end = o["end"] if end is None else max(end, o["end"])
        kern = sum(o["end"] - o["start"] for o in c if o["kind"] == "kernel")
        first_dma = dma[0]["start"] - t0 if dma else None
        tail = t1 - dma[-1]["end"] if dma else None
        print(json.dumps({
            "span_us": round((t1 - t0) / 1000, 1), "mb": round(mb, 1), "dma_busy_us": round(busy / 1000, 1),
            "dma_gbps_busy": round(mb / (busy / 1000) , 2) if busy else None,
            "kernel_us": round(kern / 1000, 1), "kernels": sum(1 for o in c if o["kind"] == "kernel"), "dmas": len(dma),
            "first_dma_after_us": None if first_dma is None else round(first_dma / 1000, 1),
            "tail_after_last_dma_us": None if tail is None else round(tail / 1000, 1),
            "gaps_total_us": round(sum(g["us"] for g in gaps), 1),
            "gaps_cpu_us": round(sum(g["us"] for g in gaps if g["cause"] == "cpu"), 1),
            "gaps": gaps[:40],
        }))


if __name__ == "__main__":
    main()
