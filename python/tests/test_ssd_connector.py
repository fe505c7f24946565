"""UMBPStoreConnector with an SSD tier under its embedded pool (issue #16), against vLLM's
real `Scheduler` (sched_harness.py): prompts that overflow the pool's DRAM stay hits (their
blocks were demoted to SSD and are promoted on load, bytes exact), and the KV events follow
the tier: a demoted block is announced again with medium STORAGE (tier_events.py)."""

from __future__ import annotations

import time

import pytest

from conftest import harness_factory

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(300)

BLOCK = 128


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"key_namespace": "ssd-connector"})


def take(h):
    """The connector's events since the last call: media CPU and STORAGE (the recorder's
    own `take` keeps one medium)."""
    ev = [e for e in h.recorder.events if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    h.recorder.events = []
    return ev


def T(seed, n=300):
    from sched_harness import tokens

    return tokens(seed, n)


def test_overflowing_dram_demotes_and_events_carry_the_medium(make, tmp_path):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # 4 MiB of DRAM = 64 objects of 64 KiB; 20 prompts of 4 blocks overflow it.
    h = make(events=True, extra={"capacity_bytes": "4MiB", "ssd_dir": str(ssd),
                                 "ssd_capacity": "128MiB", "ssd_admission": "all"})
    assert (ssd / "dp0-tp0").is_dir(), "the worker's own directory under ssd_dir"
    reqs = [h.add(f"r{i}", T(100 + i, 4 * BLOCK + 10)) for i in range(20)]
    h.run(timeout=60)
    medium: dict = {}  # hash -> its latest announced medium (None: removed)
    removed_for_good = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for e in take(h):
            hh = e.block_hashes[0]
            if type(e).__name__ == "BlockStored":
                medium[hh] = e.medium
            else:
                assert medium.get(hh) == e.medium, "a removal names the medium the block was announced with"
                medium[hh] = None
                removed_for_good.append(hh)
        ssd_report = h.pool_report()["ssd"]
        if ssd_report and ssd_report["demotions"] and sum(m == "STORAGE" for m in medium.values()) >= ssd_report["demotions"]:
            break
        h.step()  # an idle step: vLLM still collects events
        time.sleep(0.05)
    report = h.pool_report()
    assert report["pool"]["evictions"] > 0 and report["ssd"]["demotions"] > 0, report["ssd"]
    on_ssd = {hh for hh, m in medium.items() if m == "STORAGE"}
    assert len(on_ssd) == report["tiers"]["ssd"], (len(on_ssd), report["tiers"])
    assert all(medium[hh] in ("CPU", "STORAGE") for hh in medium), "no block dropped: the SSD kept all"
    first = maybe_convert_block_hash(bytes(reqs[0].block_hashes[0]))
    assert medium[first] == "STORAGE", "the first prompt went to SSD first (LRU)"

    # The first prompt is still a hit, loaded from SSD, bytes exact.
    h.reset_local_cache()
    again = h.add("again", T(100, 4 * BLOCK + 10), max_tokens=2)
    h.step_until(lambda: h.sched.requests["again"].num_computed_tokens > 4 * BLOCK, timeout=30)
    assert h.holds_blocks_of(again, h.block_ids("again"), 4)
    h.run(timeout=30)
    assert h.external_tokens("again") == 4 * BLOCK
    assert h.pool_report()["ssd"]["promotions"] >= 4
    # Promoted back to DRAM: announced again with medium CPU.
    deadline = time.monotonic() + 10
    while medium[first] != "CPU" and time.monotonic() < deadline:
        for e in take(h):
            medium[e.block_hashes[0]] = e.medium if type(e).__name__ == "BlockStored" else None
        h.step()
        time.sleep(0.05)
    assert medium[first] == "CPU"


def test_a_block_found_on_ssd_is_announced_with_medium_storage(make, pool_factory, monkeypatch, tmp_path):
    """Issue #33 item 5: engine B finds in a shared standalone pool a block that engine A
    stored and the pool has since demoted to its SSD tier. B announces it (it can serve
    it) with the medium of the tier holding it, read through `Index.tier`: STORAGE, not
    CPU (a found block in DRAM is announced CPU: test_group_events.py). Read as DRAM, as a
    binding without `Index.tier` is, the block was announced CPU."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # The standalone pool reads its SSD tier from its environment (umbp-pool --help).
    monkeypatch.setenv("UMBP_SSD_DIR", str(ssd))
    monkeypatch.setenv("UMBP_SSD_CAPACITY", "128MiB")
    monkeypatch.setenv("UMBP_SSD_ADMISSION", "all")
    pool = pool_factory("ssd-found", capacity="4MiB")
    extra = {"mode": "standalone", "endpoint": str(pool.socket_path), "key_namespace": "ssd-found"}
    a = make(extra=extra)
    b = make(events=True, extra=extra)
    # 4 MiB of DRAM = 64 objects of 64 KiB; 20 prompts of 4 blocks overflow it, the oldest
    # (LRU) go to SSD first.
    reqs = [a.add(f"r{i}", T(200 + i, 4 * BLOCK + 10)) for i in range(20)]
    a.run(timeout=60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        report = pool.report()
        if (report.get("ssd") or {}).get("demotions", 0) >= 4:
            break
        time.sleep(0.1)
    report = pool.report()
    assert report["ssd"]["demotions"] >= 4 and report["tiers"]["ssd"] >= 4, report.get("ssd")
    b.step()
    assert take(b) == [], "B announced something it neither stored nor found"

    def found_media(rid: str, seed: int) -> dict:
        b.add(rid, T(seed, 4 * BLOCK + 10), max_tokens=1)
        b.step()  # B's scheduler looks the prompt up and announces what it found
        ev = take(b)
        assert all(type(e).__name__ == "BlockStored" for e in ev), ev
        return {e.block_hashes[0]: e.medium for e in ev}

    first = [maybe_convert_block_hash(bytes(x)) for x in reqs[0].block_hashes[:4]]
    media = found_media("b-first", 200)
    assert list(media) == first, "B announces the four blocks of A's first prompt it found"
    assert set(media.values()) == {"STORAGE"}, media
    b.run(timeout=30)
    assert b.external_tokens("b-first") == 4 * BLOCK
