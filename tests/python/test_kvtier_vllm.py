"""kvtier.vllm.KvtierTier under vLLM 0.33.0's own tiering code (issue 18).

Every test drives kvtier through vLLM's ``TieringOffloadingManager``, CPU primary manager and
``SecondaryTierFactory`` from the release wheel (``kvtier_engine.Engine``), which loads the tier
by ``module_path`` exactly as ``vllm serve`` does. The expectations come from vLLM's behaviour
(its manager asserts exactly-once job reports, its digest code, its Prometheus frontend), never
from kvtier's own description of itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier_engine import (
    ROW,
    Engine,
    extra_config,
    key,
    offloading_config,
    payload,
    promote_in_another_process,
    tier_entry,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.metrics.cache_hit_source import CacheHitSource

HERE = Path(__file__).resolve().parent


@pytest.fixture
def engines():
    """Engines a test opened; shut down at the end even when the test fails."""
    opened = []
    yield opened
    for e in opened:
        try:
            e.shutdown()
        except Exception:  # already shut down by the test
            pass


def open_engine(engines, extra, **config) -> Engine:
    e = Engine(extra, **config)
    engines.append(e)
    return e


def fill_primary_with_others(e: Engine, start: int, count: int) -> list:
    """Stores ``count`` new chunks so that LRU must evict older ones; returns evicted keys."""
    req = e.request()
    evicted = e.store([key(start + i) for i in range(count)], req)
    e.settle()
    e.finish(req)
    return evicted


def test_store_cascades_to_kvtier_and_promotes_back_byte_exact(tmp_path, engines):
    e = open_engine(engines, extra_config(tier_entry(tmp_path)))
    tier = e.tier()
    assert type(tier).__name__ == "KvtierTier" and type(tier).__module__ == "kvtier.vllm"
    assert tier.tier_type == "KvtierTier" and tier.block_size_bytes == ROW
    req = e.request()
    keys = [key(i) for i in range(4)]
    e.store(keys, req)
    e.settle()  # the cascades kvtier reported (vLLM asserts each job is reported once)
    e.finish(req)
    for k in keys:
        assert tier.lookup(k, req) is LookupResult.HIT
    # vLLM's manager forwards touch to every tier (KvtierTier -> the G3 tier's LRU).
    e.manager.touch(keys, req)
    for k in keys:
        assert tier.lookup(k, req) is LookupResult.HIT

    evicted = fill_primary_with_others(e, 100, 8)
    assert set(keys) <= set(evicted), "LRU should have evicted the first chunks"

    req = e.request()
    outcome = e.promote(keys, req)
    for k in keys:
        first, last = outcome[k]
        assert first is LookupResult.HIT_PENDING, "the primary missed, kvtier answered HIT"
        assert last is LookupResult.HIT, "the promotion completed"
        assert e.manager.get_load_source(k, req) == CacheHitSource.DISK
    rows = e.load(keys, req)
    assert all(rows[k] == payload(k) for k in keys)
    e.finish(req)

    stats = e.manager.get_stats().data
    values = stats["data"]
    label = ("1:KvtierTier",)
    assert values["vllm:kv_offload_tiering_read_bytes"][label] == 4 * ROW
    assert values["vllm:kv_offload_tiering_write_bytes"][label] == 12 * ROW
    assert values["vllm:kvtier_g3_keys_loaded"][label] == 4
    assert values["vllm:kvtier_g3_keys_stored"][label] == 12
    e.shutdown()
    # kvtier let go of every Python object derived from the view: vLLM could unmap it.
    assert e.spec._scheduler_mmap is None or e.spec._scheduler_mmap.mmap_obj is None


def test_a_second_process_finds_the_chunks_after_a_restart(tmp_path, engines):
    extra = extra_config(tier_entry(tmp_path))
    e = open_engine(engines, extra)
    keys = [key(i) for i in range(5)]
    req = e.request()
    e.store(keys, req)
    e.settle()
    e.finish(req)
    namespace = e.tier().namespace
    e.shutdown()

    report = promote_in_another_process(extra, keys)
    assert report["namespace"] == namespace
    assert set(report["last"].values()) == {"HIT"}, report
    assert all(report["equal"].values()) and len(report["equal"]) == len(keys), report


def test_back_pressure_drops_are_counted_and_never_stored(tmp_path, engines):
    # Water marks far below any real store latency: after one completion vLLM's detector is
    # under pressure and its DropStorePolicy drops every further cascade to this tier.
    bp = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
          "high_water_s": 1e-12, "low_water_s": 1e-13, "warmup_completions": 1, "alpha": 1.0}
    e = open_engine(engines, extra_config(tier_entry(tmp_path, backpressure=bp)))
    tier = e.tier()
    assert tier.bp_detector is not None
    keys = [key(i) for i in range(6)]
    for k in keys:  # one store job per chunk, each reported before the next
        req = e.request()
        e.store([k], req)
        e.settle()
        e.finish(req)
    stored = [k for k in keys if tier.lookup(k, req) is LookupResult.HIT]
    dropped = len(keys) - len(stored)
    assert dropped >= 1, "the detector never dropped a store"
    values = e.manager.get_stats().data["data"]
    label = ("1:KvtierTier",)
    assert values["vllm:kv_offload_tiering_backpressure_blocks_dropped"][label] == dropped
    assert values["vllm:kv_offload_tiering_backpressure_stores_dropped"][label] == dropped
    assert values["vllm:kvtier_g3_keys_stored"][label] == len(stored)


@pytest.mark.parametrize(
    ("keys", "named", "why"),
    [
        ({"capacity": 1}, "secondary_tiers[1].capacity", "unknown key"),
        ({"capacity_bytes": "lots"}, "secondary_tiers[1].capacity_bytes", ""),
        ({"paths": []}, "secondary_tiers[1].paths", "at least one directory"),
        ({"direct_io": "sometimes"}, "secondary_tiers[1].direct_io", "required"),
        ({"region_huge_pages": "always"}, "secondary_tiers[1].region_huge_pages", "never"),
    ],
)
def test_a_bad_tier_config_raises_a_clear_error_naming_the_key(tmp_path, keys, named, why):
    import kvtier
    import vllm_side

    entry = tier_entry(tmp_path)
    entry.update(keys)
    if "capacity" in keys:
        del entry["capacity_bytes"]
    # kvtier is the second tier: the error names its own position.
    extra = extra_config(vllm_side.scripted_tier_entry(), entry)
    with pytest.raises(ValueError) as err:
        Engine(extra)
    assert isinstance(err.value, kvtier.ConfigError)
    message = str(err.value)
    assert named in message and why in message, message


@pytest.mark.parametrize("mode", ["never", "auto"])
def test_region_huge_pages_chooses_how_vllms_region_is_moved(tmp_path, engines, mode):
    # A 4 MiB region (1024 rows), so that two 2 MiB pages of vLLM's /dev/shm file can be
    # collapsed; `never` keeps vLLM's 4 KiB pages, and the bytes go through either way.
    # kvtier holds every chunk of the test (the first ones must not be evicted there too).
    entry = tier_entry(tmp_path, region_huge_pages=mode, capacity_bytes=2048 * ROW)
    extra = extra_config(entry, cpu_bytes_to_use=1024 * ROW)
    e = open_engine(engines, extra)
    req = e.request()
    keys = [key(i) for i in range(4)]
    e.store(keys, req)
    e.settle()
    e.finish(req)
    evicted = fill_primary_with_others(e, 100, 1024)
    assert set(keys) <= set(evicted)
    req = e.request()
    outcome = e.promote(keys, req)
    assert all(last is LookupResult.HIT for _, last in outcome.values()), outcome
    rows = e.load(keys, req)
    assert all(rows[k] == payload(k) for k in keys)
    e.finish(req)
    share = e.manager.get_stats().data["data"]["vllm:kvtier_g3_region_huge_pages"][
        ("1:KvtierTier",)
    ]
    if mode == "never":
        assert share == 0
    elif share == 0:
        pytest.skip("MADV_COLLAPSE gave no 2 MiB page here (see the tier's log for why)")
    else:
        assert 0 < share <= 1


def test_a_path_without_o_direct_is_refused_naming_path_and_filesystem(tmp_path):
    import kvtier

    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "-o", "rw", "ramfs", str(mnt)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount ramfs (a filesystem without O_DIRECT): {mounted.stderr}")
    try:
        with pytest.raises(kvtier.PathError) as err:
            Engine(extra_config(tier_entry(mnt, direct_io="required")))
        assert isinstance(err.value, OSError) and err.value.filename is not None
        message = str(err.value)
        assert str(mnt) in message and "ramfs" in message and "O_DIRECT" in message, message
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_flipped_byte_on_disk_fails_the_load_of_that_key_only(tmp_path, engines):
    extra = extra_config(tier_entry(tmp_path))
    e = open_engine(engines, extra)
    good, bad = key(1), key(2)
    req = e.request()
    e.store([good, bad], req)
    e.settle()
    e.finish(req)
    e.shutdown()

    # Find the bad key's row in the slab by its bytes (not through kvtier) and flip one bit.
    slabs = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 16 * ROW]
    assert len(slabs) == 1, slabs
    data = slabs[0].read_bytes()
    at = data.find(payload(bad))
    assert at > 0 and data.find(payload(good)) > 0
    with open(slabs[0], "r+b") as f:
        f.seek(at + ROW // 2)
        f.write(bytes([data[at + ROW // 2] ^ 0x01]))

    e2 = open_engine(engines, extra)
    req = e2.request()
    outcome = e2.promote([good, bad], req)  # one promotion job with both keys
    assert outcome[good] == (LookupResult.HIT_PENDING, LookupResult.HIT)
    assert outcome[bad][0] is LookupResult.HIT_PENDING
    assert outcome[bad][1] is LookupResult.MISS, "the corrupt chunk must not be offered again"
    assert e2.load([good], req)[good] == payload(good)
    values = e2.manager.get_stats().data["data"]
    label = ("1:KvtierTier",)
    assert values["vllm:kv_offload_tiering_promotion_job_failures"][label] == 1
    assert values["vllm:kv_offload_tiering_read_bytes"][label] == ROW  # the good key only
    assert values["vllm:kvtier_g3_checksum_failures"][label] == 1


def test_the_namespace_follows_vllms_digest_and_refuses_another_model(tmp_path, engines):
    import kvtier
    from kvtier import _native
    from kvtier.vllm import spec_fields
    from vllm.v1.kv_offload.file_mapper import FileMapper

    # vLLM's own FileMapper digest, for many configurations, equals the one kvtier computes.
    cases = [
        dict(),
        dict(tp=2),
        dict(tp=4, agnostic=True),
        dict(tp=2, canonical=True, agnostic=True),
        dict(canonical=True, kv_cache_layout="LBHNC"),
        dict(canonical=True, kv_cache_layout="LHBNC", agnostic=True),
        dict(model="org/other", kv_cache_layout=None),
    ]
    for case in cases:
        spec = SimpleNamespace(config=offloading_config({}, **case), blocks_per_chunk=1)
        mapper = FileMapper.from_offloading_spec(
            root_dir="/r", offloading_spec=spec, blocks_per_file=1, parallel_agnostic=True
        )
        vllm_digest = mapper.base_path.rsplit("_", 1)[1]
        ours, _, _ = _native.namespace_of(json.dumps(spec_fields(spec, ROW)))
        assert ours == vllm_digest, case

    extra = extra_config(tier_entry(tmp_path))
    e = open_engine(engines, extra, model="org/model-a")
    assert len(e.tier().namespace) == 64
    written = e.tier().namespace
    e.shutdown()
    other = SimpleNamespace(config=offloading_config({}, model="org/model-b"), blocks_per_chunk=1)
    _, expected, _ = _native.namespace_of(json.dumps(spec_fields(other, ROW)))
    with pytest.raises(kvtier.ConfigError) as err:
        Engine(extra, model="org/model-b")
    message = str(err.value)
    assert expected in message and written in message, message


def test_a_canonical_tier_written_at_one_tp_size_is_read_at_another(tmp_path, engines):
    extra = extra_config(tier_entry(tmp_path))
    keys = [key(i) for i in range(3)]
    e = open_engine(engines, extra, tp=1, canonical=True, agnostic=True)
    req = e.request()
    e.store(keys, req)
    e.settle()
    e.finish(req)
    e.shutdown()
    e2 = open_engine(engines, extra, tp=2, canonical=True, agnostic=True)
    req = e2.request()
    outcome = e2.promote(keys, req)
    assert all(last is LookupResult.HIT for _, last in outcome.values()), outcome
    rows = e2.load(keys, req)
    assert all(rows[k] == payload(k) for k in keys)
    # The direct layout is per topology: the same directory at TP 2 is another namespace.
    e2.shutdown()
    import kvtier

    with pytest.raises(kvtier.ConfigError):
        Engine(extra, tp=2)


def test_events_metrics_and_config_info_go_through_vllms_frontend(tmp_path, engines):
    import functools

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )
    from vllm.v1.kv_offload.base import Medium

    extra = extra_config(tier_entry(tmp_path, enable_kv_events=True))
    e = open_engine(engines, extra, events=True)
    req = e.request()
    keys = [key(i) for i in range(3)]
    e.store(keys, req)
    e.settle()
    events = [ev for ev in e.manager.take_events() if ev.medium is Medium.STORAGE]
    assert [k for ev in events for k in ev.keys] == keys
    assert all(ev.ownership == "1:KvtierTier" and ev.removal_expected for ev in events)

    # vLLM's Prometheus frontend asserts that every reported metric was declared with its
    # labels; it builds the declarations from the spec (our classmethods) like the API server.
    registry = prometheus_client.CollectorRegistry()
    types = {
        cls: functools.partial(cls, registry=registry)
        for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
    )
    prom = OffloadPromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    stats = e.manager.get_stats()
    stats.set_info(e.manager.config_info())
    prom.observe(stats.data, 0)
    stored = registry.get_sample_value(
        "vllm:kvtier_g3_keys_stored_total", {"engine": "0", "tier": "1:KvtierTier"}
    )
    assert stored == len(keys)
    info = dict(e.manager.config_info()[1])
    assert info["tier"] == "1:KvtierTier" and info["kvtier_slot_bytes"] == str(ROW)
    assert info["kvtier_namespace"] == e.tier().namespace
    # Counters report increments: a second get_stats with nothing new adds nothing.
    again = e.manager.get_stats()
    if again is not None:
        assert "vllm:kvtier_g3_keys_stored" not in again.data["data"]


def test_reset_cache_drains_kvtier_and_every_job_is_reported(tmp_path, engines):
    e = open_engine(engines, extra_config(tier_entry(tmp_path)))
    req = e.request()
    e.store([key(i) for i in range(6)], req)
    # Jobs are in flight; vLLM's reset drains every tier and asserts that none is left.
    e.manager.reset_cache()
    e.manager.on_reset_flushed()
    assert not e.tier().has_pending_work()


def test_touch_through_vllms_manager_keeps_a_chunk_in_kvtier(tmp_path, engines):
    """vLLM's manager forwards ``touch`` to every tier: a touched chunk becomes kvtier's most
    recently used, so the next store into the full tier evicts the next oldest instead."""
    e = open_engine(engines, extra_config(tier_entry(tmp_path, capacity_bytes=4 * ROW)))
    tier = e.tier()
    keys = [key(i) for i in range(5)]
    for k in keys[:4]:  # one job each, in order: keys[0] is kvtier's least recently used
        req = e.request()
        e.store([k], req)
        e.settle()
        e.finish(req)
    req = e.request()
    e.manager.touch([keys[0]], req)
    e.store([keys[4]], req)  # kvtier is full: one chunk goes
    e.settle()
    e.finish(req)
    # Asked only now: a lookup refreshes recency too.
    answers = {i: tier.lookup(k, req) for i, k in enumerate(keys)}
    assert answers[0] is LookupResult.HIT, f"the touched chunk was evicted: {answers}"
    assert answers[1] is LookupResult.MISS, f"the next oldest should have gone: {answers}"
    assert all(answers[i] is LookupResult.HIT for i in (2, 3, 4)), answers


class _Ticker:
    """A Python thread that counts while it holds the GIL, sleeping (GIL released) 0.2 ms
    between counts. With the interpreter's switch interval at 100 s the thread that holds the
    GIL is never made to give it up, so the count moves during a call on another thread only
    if that call released the GIL."""

    def __init__(self):
        import threading

        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import time

        while not self._stop.is_set():
            self.count += 1
            time.sleep(0.0002)

    def __enter__(self):
        self._interval = sys.getswitchinterval()
        self._thread.start()
        sys.setswitchinterval(100.0)
        return self

    def __exit__(self, *exc):
        sys.setswitchinterval(self._interval)
        self._stop.set()
        self._thread.join()

    def ran_during(self, call) -> bool:
        before = self.count
        call()
        return self.count != before


def test_calls_that_wait_release_the_gil(tmp_path, engines, monkeypatch):
    """Opening the tier (slab files, index recovery), drain_jobs and shutdown wait for kvtier's
    disk and threads; the rest of the Python process keeps running meanwhile."""
    from kvtier import _native

    opened = []  # per tier opened: whether the ticker ran while the constructor waited
    real_tier = _native.Tier

    def tier_and_ticks(*args):  # the native constructor KvtierTier calls, observed
        made = []
        opened.append(ticker.ran_during(lambda: made.append(real_tier(*args))))
        return made[0]

    monkeypatch.setattr(_native, "Tier", tier_and_ticks)
    released = {"open": False, "drain_jobs": False, "shutdown": False}
    with _Ticker() as ticker:
        # Each wait is milliseconds of fsync and thread hand-offs; a call that holds the GIL
        # never lets the ticker move, so a few tries tell the two apart.
        for attempt in range(20):
            path = tmp_path / str(attempt)
            path.mkdir()
            e = open_engine(engines, extra_config(tier_entry(path)))
            released["open"] |= opened[-1]
            native = e.tier()._tier
            req = e.request()
            e.store([key(1000 * attempt + i) for i in range(8)], req)  # cascades: jobs queued
            released["drain_jobs"] |= ticker.ran_during(native.drain_jobs)
            e.settle()
            e.finish(req)
            released["shutdown"] |= ticker.ran_during(native.shutdown)
            e.shutdown()
            if all(released.values()):
                break
    assert all(released.values()), f"held the GIL while waiting: {released}"


def test_importing_kvtier_vllm_is_cheap_and_starts_nothing():
    probe = r"""
import json, os, sys, threading
fds = sorted(os.listdir("/proc/self/fd")); tasks = sorted(os.listdir("/proc/self/task"))
import kvtier.vllm
print(json.dumps({
    "vllm": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
    "native": "kvtier._native" in sys.modules,
    "fds": fds == sorted(os.listdir("/proc/self/fd")),
    "threads": tasks == sorted(os.listdir("/proc/self/task")),
}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items()})
    report = json.loads(out.stdout)
    assert report == {"vllm": [], "native": False, "fds": True, "threads": True}, report


def test_vllms_factory_resolves_the_class_by_module_path():
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cls = SecondaryTierFactory.get_tier_class({"type": "KvtierTier", "module_path": "kvtier.vllm"})
    assert issubclass(cls, SecondaryTierManager)
    assert cls.cache_hit_source == CacheHitSource.DISK
    assert cls.tolerates_off_thread_polling is False
    keys = cls.config_info_keys({})
    assert "tier" not in keys and keys


def test_docs_vllm_md_describes_every_metric_the_tier_reports():
    from kvtier import _native

    docs = (HERE.parents[1] / "docs" / "vllm.md").read_text()
    missing = [n for n, *_ in _native.metric_descriptors() if f"`vllm:kvtier_{n}`" not in docs]
    assert not missing, f"docs/vllm.md does not describe {missing}"
    assert all(f"`{k}`" in docs for k in _native.config_info_keys())
