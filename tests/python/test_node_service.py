"""Two vLLM 0.33.0 manager processes share one G3 pool through kvtier's node service.

The service is ``kvtier-replay node-serve`` (``kvtier::node``, the same service ``kvtier serve``
runs, given the engines' digest directly); the engines are vLLM's own spec, factory, primary
and ``TieringOffloadingManager`` with ``kvtier.vllm.KvtierTier`` in client mode
(``service_socket_path``). Rank A (this process) stores; rank B (a second process,
``kvtier_engine.py``) looks the keys up, promotes them through the service into its own
``/dev/shm`` region and compares every byte with what A wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import harness
from kvtier_engine import (
    ROW,
    Engine,
    extra_config,
    key,
    kill_hanging_child,
    offloading_config,
    promote_in_another_process,
    start_hanging_child,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def client_entry(socket) -> dict:
    return {
        "type": "KvtierTier",
        "module_path": "kvtier.vllm",
        "locality": "LOCAL",
        "service_socket_path": str(socket),
    }


def engines_digest(extra) -> str:
    """The namespace digest vLLM engines of ``extra`` present (vLLM's spec, kvtier's rule)."""
    from kvtier import _native
    from kvtier.vllm import spec_fields

    spec = TieringOffloadingSpec(offloading_config(json.loads(json.dumps(extra))))
    return _native.namespace_of(json.dumps(spec_fields(spec, ROW)))[1]


def launch(doc) -> subprocess.Popen:
    """``kvtier-replay node-serve`` on ``doc``, once its socket listens."""
    proc = subprocess.Popen(
        [os.environ["KVTIER_REPLAY"], "node-serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    proc.stdin.write(json.dumps(doc))
    proc.stdin.close()
    ready = proc.stdout.readline()
    assert json.loads(ready) == {"ready": True}, ready
    return proc


def start_service(tmp_path, hold_file=None, **service_keys) -> dict:
    """Starts a node service on ``tmp_path/kvtier.sock`` for the engines of ``extra``
    (``service_keys`` join its ``service`` section; with ``hold_file`` it holds every job after
    its G3 I/O while that file exists, the test hook ``kvtier::node::start_holding_jobs``); its
    state, with the process."""
    replay = os.environ.get("KVTIER_REPLAY")
    if not replay:
        pytest.skip("KVTIER_REPLAY is not set (run through cli/tests/python_suite.rs)")
    socket = tmp_path / "kvtier.sock"
    extra = extra_config(client_entry(socket))
    slabs = tmp_path / "slabs"
    slabs.mkdir()
    doc = {
        "config": {
            "cpu_bytes_to_use": 8 * ROW,
            "service": {"socket_path": str(socket), **service_keys},
            "secondary_tiers": [
                {"type": "nvme", "paths": [str(slabs)], "capacity_bytes": 64 * ROW,
                 "direct_io": "auto"}
            ],
        },
        "row_stride": ROW,
        "digest": engines_digest(extra),
        "hold_file": None if hold_file is None else str(hold_file),
    }
    return {"socket": socket, "extra": extra, "proc": launch(doc), "doc": doc}


def end_service(state) -> None:
    proc = state["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture
def service(tmp_path):
    """A running node service on ``tmp_path/kvtier.sock`` for the engines of ``extra``."""
    state = start_service(tmp_path)
    yield state
    end_service(state)


def stop(service) -> dict:
    proc = service["proc"]
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    return json.loads(out.strip().splitlines()[-1])["status"]


def service_status(socket) -> dict:
    """``kvtier service status --json`` of the service at ``socket``."""
    out = subprocess.run(
        [os.environ["KVTIER_BIN"], "service", "status", "--socket", str(socket), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(out.stdout)


def wait_until_no_engine(socket, deadline_s: float = 60.0) -> None:
    """Waits until the service has seen every engine go (a disconnect is handled on the
    service's own thread, after the engine's shutdown has returned)."""
    import time

    kvtier_bin = os.environ.get("KVTIER_BIN")
    if not kvtier_bin:
        return
    deadline = time.monotonic() + deadline_s
    while True:
        out = subprocess.run(
            [kvtier_bin, "service", "status", "--socket", str(socket), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        if json.loads(out.stdout)["engines"] == []:
            return
        assert time.monotonic() < deadline, f"engines still connected: {out.stdout}"
        time.sleep(0.05)


def test_two_vllm_processes_share_one_g3_pool_through_the_node_service(service):
    extra = service["extra"]
    a = Engine(extra)
    try:
        keys = [key(i) for i in range(6)]
        a.store_settled(keys)
        # The chunks are in the service's pool: a lookup through A's manager finds them
        # in the primary first, so ask the service through the tier (RETRY, then the verdict).
        t = a.tier()
        assert t.namespace == engines_digest(extra)
        report = promote_in_another_process(extra, keys)
        # Rank B's manager asked its tier, which asked the service without blocking (RETRY
        # until the verdict came); the first answer past RETRY is vLLM's HIT_PENDING (its
        # promotion started), then HIT; the rows it loaded are the bytes rank A wrote.
        assert set(report["first"].values()) <= {"HIT", "HIT_PENDING"}, report
        assert set(report["last"].values()) == {"HIT"}, report
        assert all(report["equal"].values()) and len(report["equal"]) == len(keys), report
        assert report["namespace"] == t.namespace
    finally:
        a.shutdown()
    wait_until_no_engine(service["socket"])
    status = stop(service)
    assert status["tier"]["used_slots"] == len(keys), status
    assert status["engines"] == [], status


def test_an_engine_of_another_model_is_refused_with_both_digests(service):
    import kvtier

    extra = service["extra"]
    with pytest.raises(kvtier.ConfigError) as e:
        Engine(extra, model="kvtier/another-model")
    msg = str(e.value)
    assert "compatibility digest mismatch" in msg, msg
    assert engines_digest(extra) in msg, msg


def test_a_client_mode_tier_refuses_nvme_keys_naming_them(service):
    import kvtier

    entry = client_entry(service["socket"])
    entry["paths"] = ["/tmp"]
    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[0\]\.paths"):
        Engine(extra_config(entry))


def wait_until_reconnected(engine, deadline_s: float = 60.0) -> None:
    """Steps ``engine`` until its tier is connected again (it reconnects by itself; the new
    connection is taken in on the tier's next call)."""
    import time

    deadline = time.monotonic() + deadline_s
    req = engine.request()
    while not engine.tier().ready:
        assert time.monotonic() < deadline, "the tier did not reconnect within 60 s"
        engine.settle()
        engine.tier().lookup(key(999_999), req)  # any call of the tier takes it in
        time.sleep(0.01)
    engine.finish(req)


def tier_lookup_settled(engine, k, req, deadline_s: float = 60.0):
    """The kvtier tier's own verdict (not the manager's: the primary may hold the key)."""
    import time

    deadline = time.monotonic() + deadline_s
    while True:
        r = engine.tier().lookup(k, req)
        if r is not LookupResult.RETRY:
            return r
        assert time.monotonic() < deadline, "lookup still RETRY after 60 s"
        time.sleep(0.001)


def test_the_service_killed_under_load_and_restarted_engines_reconnect_by_themselves(service):
    extra = service["extra"]
    a = Engine(extra)
    try:
        committed = [key(i) for i in range(6)]
        a.store_settled(committed)
        # Under load: A's manager hands new cascades to kvtier and the service dies with them.
        in_flight = [key(100 + i) for i in range(6)]
        req = a.request()
        a.store(in_flight, req)
        a.step_end()
        service["proc"].kill()
        service["proc"].wait()
        a.settle()  # every job is reported (failed or done), none hangs
        a.finish(req)
        # While the service is away the tier answers MISS, and jobs fail without waiting.
        assert tier_lookup_settled(a, committed[0], req) is LookupResult.MISS
        assert not a.tier().ready
        service["proc"] = launch(service["doc"])
        wait_until_reconnected(a)
        stats = {n: v for n, _, _, v in a.tier()._tier.metrics()}
        assert stats["node_client_connection_losses"] == 1, stats
        assert stats["node_client_reconnects"] == 1, stats
        assert stats["node_client_connected"] == 1, stats
        # What was committed before the kill loads with A's bytes through the restarted
        # service; what was in flight is either there with A's bytes or a MISS, never wrong.
        req = a.request()
        assert tier_lookup_settled(a, committed[0], req) is LookupResult.HIT
        report = promote_in_another_process(extra, committed + in_flight)
        hits = [k for k, v in report["last"].items() if v == "HIT"]
        assert {k.hex() for k in committed} <= set(hits), report
        assert all(report["equal"].values()) and len(report["equal"]) == len(hits), report
        # A stores again through its new connection, and another engine loads it.
        after = [key(200 + i) for i in range(4)]
        a.store(after, req)
        a.settle()
        a.finish(req)
        report = promote_in_another_process(extra, after)
        assert set(report["last"].values()) == {"HIT"}, report
        assert all(report["equal"].values()) and len(report["equal"]) == len(after), report
    finally:
        a.shutdown()


def mapped_by(pid: int, paths) -> set:
    """The ones of ``paths`` (files) that process ``pid`` maps now."""
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    return {p for p in paths if str(p) in maps}


@pytest.mark.parametrize("hang", ["store", "promote"])
def test_a_vllm_engine_killed_mid_job_leaves_the_service_consistent(tmp_path, hang):
    """The kill lands while the service holds the job in flight: its G3 I/O done, not yet
    committed or reported (the service's test hook, ``hold_file``, shown in its status); whatever the row size, the job cannot have finished before the kill."""
    if not os.environ.get("KVTIER_BIN"):
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    hold = tmp_path / "hold-jobs"
    service = start_service(tmp_path, hold_file=hold)
    try:
        _killed_mid_job(service, hang, hold)
    finally:
        end_service(service)


def _killed_mid_job(service, hang, hold) -> None:
    extra, socket = service["extra"], service["socket"]
    stored = [key(i) for i in range(6)]
    a = Engine(extra)
    try:
        a.store_settled(stored)
    finally:
        a.shutdown()
    # Another vLLM engine process submits its jobs; the service holds one of them in flight.
    # A store first completes half its keys (a job reported done), then the held job has the
    # rest; a promotion's one load job is held.
    keys = stored if hang == "promote" else [key(50 + i) for i in range(6)]
    child = start_hanging_child(extra, keys, hang, hold_file=hold)
    try:
        deadline = time.monotonic() + 60
        while True:
            status = service_status(socket)
            if status["test_hold"]["held_jobs"] == 1:
                break
            assert time.monotonic() < deadline, f"no job held: {status}"
            time.sleep(0.01)
        [engine] = [e for e in status["engines"] if e["pid"] == child.pid]
        # Queued behind the held job: none for the store; the promotion's other jobs (vLLM's
        # manager submits one load job per chunk).
        queued = engine["jobs_in_flight"] - 1
        if hang == "store":
            assert queued == 0, engine
            assert engine["stores"] == 1 and len(child.completed) == 3, (engine, child.completed)
        else:
            assert queued == len(keys) - 1 and engine["loads"] == 0, engine
            assert child.completed == [], child.completed
        assert status["tier"]["active_transfers"] == 1, status
        region = harness.region_files(pid=child.pid)
        assert region and mapped_by(service["proc"].pid, region) == region, region
        cancelled_before = status["cancelled_jobs"]
    finally:
        kill_hanging_child(child)
    wait_until_no_engine(socket)
    # The service let go of everything of the killed engine: the held job ended (a store
    # abandoned, its reserved slots released; a load completed, its pins released), the
    # region unmapped.
    status = service_status(socket)
    assert status["test_hold"]["held_jobs"] == 0, status
    # Cancelled: the queued jobs, and the held store (a load in flight is completed).
    cancelled = queued + (1 if hang == "store" else 0)
    assert status["cancelled_jobs"] - cancelled_before == cancelled, status
    assert status["tier"]["active_transfers"] == 0, status
    assert mapped_by(service["proc"].pid, region) == set(), region
    hold.unlink()
    # The killed engine's restart (a new process of the same configuration) loads everything
    # committed with the bytes it was stored with: A's keys, and the killed engine's keys
    # of the job reported done; the held store's keys are a MISS, never other bytes.
    # (One promotion per key set: vLLM's primary holds 8 rows.)
    hits = set()
    for wanted in (stored, keys) if hang == "store" else (stored,):
        report = promote_in_another_process(extra, wanted)
        found = {k for k, v in report["last"].items() if v == "HIT"}
        assert all(report["equal"].values()) and len(report["equal"]) == len(found), report
        hits |= found
    expected = stored + (child.completed if hang == "store" else [])
    assert hits == {k.hex() for k in expected}, (hits, expected)
    # Nothing of the killed engine is left at the service, and no slot is taken but the
    # committed ones.
    wait_until_no_engine(socket)
    status = stop(service)
    assert status["engines"] == [], status
    assert status["tier"]["used_slots"] == len(hits), status
    assert status["tier"]["active_transfers"] == 0, status
