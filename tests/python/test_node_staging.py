"""The node service's DRAM staging pool and hint-driven prefetch, through vLLM 0.33.0's own
request and hint objects (``ReqContext``, ``KvHintsEnvelope``, ``KvHintAction``) and its
``TieringOffloadingManager`` over ``kvtier.vllm.KvtierTier`` in client mode.

Rank A stores through its manager; rank B's request carries kvtier's prefetch action
(``docs/node-service.md``) and one action of another type. vLLM's manager hands the request
to the tier (``on_new_request``), the service stages the chunks from G3 in DRAM, and B's first
lookup of each key already answers a hit (no RETRY round trip), its promotion is served from
the pool (the service's counters) with A's bytes, and finishing the request discards the
staged chunks B did not load. Inventory events reach vLLM with the medium that holds the
chunk: CPU for the pool, STORAGE for G3.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from kvtier_engine import ROW, Engine, extra_config, key, payload
from test_node_service import end_service, start_service
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext

STAGING_SLOTS = 16


@pytest.fixture
def service(tmp_path):
    """A node service with a DRAM staging pool of ``STAGING_SLOTS`` slots."""
    kvtier_bin = os.environ.get("KVTIER_BIN")
    if not kvtier_bin:
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    state = start_service(tmp_path, dram_bytes=STAGING_SLOTS * ROW)
    state["bin"] = kvtier_bin
    # The engines that ask for events (events=True) get them: the tier opts in too.
    state["extra"]["secondary_tiers"][0]["enable_kv_events"] = True
    yield state
    end_service(state)


def status(service) -> dict:
    out = subprocess.run(
        [service["bin"], "service", "status", "--socket", str(service["socket"]), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(out.stdout)


def staging(service) -> dict:
    return status(service)["staging"]


def wait_staging(service, what, cond, timeout_s=60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = staging(service)
        if cond(st):
            return st
        assert time.monotonic() < deadline, f"{what}: {st}"
        time.sleep(0.02)


def test_a_hint_in_vllms_request_stages_the_chunks_and_the_lookup_hits_at_once(service):
    extra = service["extra"]
    a = Engine(extra)
    b = Engine(extra, events=True)
    try:
        # vLLM asks its tiers for events every step; the first ask subscribes B at the service.
        deadline = time.monotonic() + 60
        while status(service)["event_subscribers"] < 1:
            assert time.monotonic() < deadline, "B never subscribed to events"
            list(b.manager.take_events())
            time.sleep(0.02)
        keys = [key(100 + i) for i in range(6)]
        a.store_settled(keys)

        # Without a hint, B's first lookup has to ask the service: RETRY.
        plain = b.request()
        assert b.manager.lookup(key(100), plain) is LookupResult.RETRY
        b.finish(plain)

        hints = KvHintsEnvelope(
            protocol_version="1",
            message_id="orchestrator-1",
            actions=[
                KvHintAction(
                    action_id="prefetch-1",
                    action_type="kvtier.prefetch",
                    action_version="1",
                    payload={"keys": [k.hex() for k in keys[1:5]]},
                ),
                KvHintAction(
                    action_id="route-1",
                    action_type="router.affinity",
                    action_version="1",
                    payload={"worker": 2},
                ),
            ],
        )
        req = ReqContext(req_id="hinted-request", kv_hints=hints)
        b.manager.on_new_request(req)
        wait_staging(service, "the hinted chunks staged", lambda st: st["prefetched"] == 4)
        tier = b.tier()
        # The verdicts came with the hint's answer (sent before the reads, so long before the
        # chunks were staged): the first lookup is past RETRY.
        first = b.manager.lookup(keys[1], req)
        lookups = {k: b.manager.lookup(k, req) for k in keys[2:3]}
        assert first in (LookupResult.HIT, LookupResult.HIT_PENDING), first
        assert set(lookups.values()) <= {LookupResult.HIT, LookupResult.HIT_PENDING}, lookups
        b.step_end()
        b.settle()
        rows = b.load(keys[1:3], req)
        assert rows == {k: payload(k) for k in keys[1:3]}
        st = staging(service)
        assert st["hits"] == 2 and st["g3_loads"] == 0, st
        metrics = {n: v for n, _, _, v in tier._tier.metrics()}
        assert metrics["node_hint_actions_ignored"] == 1, metrics
        assert metrics["node_hint_actions_applied"] == 1, metrics
        assert metrics["node_hint_lookups"] >= 1, metrics

        # Finishing the request (vLLM's manager tells the tier) discards keys 3 and 4.
        b.finish(req)
        b.settle()
        st = wait_staging(service, "unused chunks discarded", lambda st: st["discarded"] == 2)
        assert st["held_slots"] == 0, st

        # vLLM's manager passes on the tier's events with the medium that holds each chunk.
        seen = {}
        deadline = time.monotonic() + 60
        while not ({Medium.CPU, Medium.STORAGE} <= set(seen)):
            assert time.monotonic() < deadline, seen
            for e in b.manager.take_events():
                # vLLM's own CPU primary reports too (ownership None); the tier's carry its label.
                if e.ownership == tier._label:
                    seen.setdefault(e.medium, []).append(e)
            b.step_end()
            time.sleep(0.01)
        staged = {k for e in seen[Medium.CPU] if not e.removed for k in e.keys}
        assert set(keys[1:5]) <= staged, seen[Medium.CPU]
        discarded = {k for e in seen[Medium.CPU] if e.removed for k in e.keys}
        assert discarded == set(keys[3:5]), seen[Medium.CPU]
        stored = {k for e in seen[Medium.STORAGE] if not e.removed for k in e.keys}
        assert set(keys) <= stored, seen[Medium.STORAGE]
    finally:
        a.shutdown()
        b.shutdown()


def storage_stores(events) -> set:
    """Keys of the STORAGE ``stored`` events among ``events`` (a secondary tier's: vLLM's own
    CPU primary reports CPU with no ownership)."""
    return {
        k for e in events if e.medium is Medium.STORAGE and not e.removed for k in e.keys
    }


def drain_events(engine, until=lambda events: True, timeout_s=60.0) -> list:
    """The manager's events over engine steps until ``until(events)`` holds, then ten steps
    more (what else would come)."""
    out = []
    deadline = time.monotonic() + timeout_s
    while not until(out):
        assert time.monotonic() < deadline, f"events so far: {out}"
        out.extend(engine.manager.take_events())
        engine.step_end()
        time.sleep(0.005)
    for _ in range(10):
        out.extend(engine.manager.take_events())
        engine.step_end()
        time.sleep(0.005)
    return out


def test_events_begin_at_the_consumers_first_ask_as_with_vllms_own_fs_tier(service, tmp_path):
    """vLLM 0.33 announces no initial inventory: its ``fs`` tier, opened over a directory
    that holds chunks (the restart of an engine), finds them (lookups HIT) and emits no event
    for them; it reports only what it stores from then on. kvtier's service does the same for
    an engine that connects (and first asks for events) after chunks are in G3."""
    fs_root = tmp_path / "fs"
    fs_root.mkdir()
    fs_extra = extra_config({"type": "fs", "root_dir": str(fs_root), "enable_kv_events": True})
    old = [key(300 + i) for i in range(3)]
    new = key(399)

    def restart_finds_old_and_reports_only_new(make_engine, before_lookups=lambda e: None):
        engine = make_engine()
        try:
            before_lookups(engine)
            req = engine.request()
            found = {k: engine.lookup_settled(k, req) for k in old}
            assert set(found.values()) <= {LookupResult.HIT, LookupResult.HIT_PENDING}, found
            engine.step_end()
            engine.settle()
            engine.store([new], req)
            engine.settle()
            engine.finish(req)
            engine.settle()
            events = drain_events(engine, lambda ev: new in storage_stores(ev))
            return storage_stores(events)
        finally:
            engine.shutdown()

    # vLLM's fs tier: one engine stores (and reports it), a new one over the same directory.
    first = Engine(fs_extra, events=True)
    try:
        first.store_settled(old)
        assert set(old) <= storage_stores(
            drain_events(first, lambda ev: set(old) <= storage_stores(ev))
        )
    finally:
        first.shutdown()
    vllm_seen = restart_finds_old_and_reports_only_new(lambda: Engine(fs_extra, events=True))
    assert vllm_seen == {new}, vllm_seen

    # kvtier's service: C asks for events from the start, A stores, and C is told; B
    # connects afterwards, asks for events first, and is told only of its own store.
    extra = service["extra"]

    def subscribe(engine, subscribers):
        deadline = time.monotonic() + 60
        while status(service)["event_subscribers"] < subscribers:
            assert time.monotonic() < deadline, "the engine never subscribed to events"
            list(engine.manager.take_events())
            time.sleep(0.02)

    c = Engine(extra, events=True)
    try:
        subscribe(c, 1)
        a = Engine(extra)
        try:
            a.store_settled(old)
        finally:
            a.shutdown()
        assert set(old) <= storage_stores(
            drain_events(c, lambda ev: set(old) <= storage_stores(ev))
        )
        kvtier_seen = restart_finds_old_and_reports_only_new(
            lambda: Engine(extra, events=True), lambda b: subscribe(b, 2)
        )
    finally:
        c.shutdown()
    assert kvtier_seen == vllm_seen == {new}, kvtier_seen


def test_vllms_touch_reaches_the_services_g3(service):
    """vLLM's manager forwards ``touch`` to every tier; kvtier's client-mode tier passes it
    to the service, which refreshes the keys in G3's LRU (counted in its status)."""
    extra = service["extra"]
    a = Engine(extra)
    try:
        keys = [key(500 + i) for i in range(3)]
        req = a.request()
        a.store(keys, req)
        a.settle()
        before = staging(service)["g3_touches"]
        a.manager.touch(keys, req)
        a.finish(req)
        wait_staging(
            service, "vLLM's touch counted", lambda st: st["g3_touches"] == before + len(keys)
        )
    finally:
        a.shutdown()
