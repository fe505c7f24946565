#!/usr/bin/env bash
# Where does the time go while a 64 GiB pool pins: timestamps of each check case, and
# transfer GB/s during pinning vs after it.
set -u
bin=.device-bin; out=${OUT:-/tmp}
stamp() { python3 -u -c 'import sys,time
for l in sys.stdin: print(f"{time.time():.3f}", l, end="", flush=True)'; }
sock=/tmp/pp.sock
start_pool() { rm -f $sock; RUST_LOG=info $bin/umbp-pool --socket $sock --capacity 64GiB > "$out/$1" 2>&1 & pool=$!; for _ in $(seq 600); do [ -S $sock ] && break; sleep 0.1; done; }
echo "pool start $(date +%s.%N)"
start_pool pp-check-pool.log
$bin/umbp-bench transfer --backend cuda --check --pool-socket $sock 2>&1 | stamp | cut -c1-160 > "$out/pp-check.log"
kill $pool; wait $pool
echo "--- bench during pinning"
start_pool pp-bench-pool.log
date +%s.%N
$bin/umbp-bench transfer --backend cuda --json --layouts kv16k,obj --sizes 16 --reps 3 --pool-socket $sock 2>&1 | stamp > "$out/pp-during.log"
grep -c "registration done" "$out/pp-bench-pool.log"
echo "--- bench after pinning"
while ! grep -q "registration done" "$out/pp-bench-pool.log"; do sleep 1; done
date +%s.%N
$bin/umbp-bench transfer --backend cuda --json --layouts kv16k,obj --sizes 16 --reps 3 --pool-socket $sock 2>&1 | stamp > "$out/pp-after.log"
kill $pool; wait $pool
for f in pp-check pp-during pp-after; do echo "== $f"; python3 - "$out/$f.log" <<'PY'
import sys, json
for l in open(sys.argv[1]):
    t, _, rest = l.partition(" ")
    try:
        j = json.loads(rest)
        keep = {k: j[k] for k in j if k in ("case", "ok", "gbps", "ratio", "store_gbps", "load_gbps", "summary")}
        print(t, json.dumps(keep)[:200])
    except Exception:
        print(t, rest.strip()[:150])
PY
done
