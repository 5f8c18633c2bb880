"""A vLLM 0.33.0 engine that shrinks its region file while the node service has it registered.

The service (``kvtier-replay node-serve``, a process of its own) maps each engine's
``/dev/shm/vllm_offload_<engine_id>.mmap`` region; a CPU access to a page past a shrunk file's
end is ``SIGBUS``, which used to kill the service and with it every engine's work. Engine A
(vLLM's own spec, factory, primary and manager in this process, kvtier in client mode) stores,
then truncates its region file; its later store fails, its session ends, the service stays up,
and another vLLM process loads what A stored before, byte for byte. ``STATUS``
(``kvtier service status --json``, the binary) names the lost region.

This process writes A's rows only before the truncation: after it, a CPU access to A's own
mapping would be ``SIGBUS`` here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

import harness
from kvtier_engine import Engine, key, promote_in_another_process
from test_node_service import end_service, start_service


def service_status(socket) -> dict:
    """``kvtier service status --json`` of the service at ``socket`` (the kvtier binary)."""
    kvtier_bin = os.environ.get("KVTIER_BIN")
    if not kvtier_bin:
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    out = subprocess.run(
        [kvtier_bin, "service", "status", "--socket", str(socket), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(out.stdout)


def region_of_this_process():
    """The one vLLM region file of this process's engine."""
    regions = [p for p in harness.region_files(pid=os.getpid()) if p.name.endswith(".mmap")]
    assert len(regions) == 1, regions
    return regions[0]


def client_stats(engine) -> dict:
    return {n: v for n, _, _, v in engine.tier()._tier.metrics()}


def store_before_the_shrink(engine):
    """Engine A stores four keys (their rows written, the store settled); the keys, A's region
    file and its size."""
    before = [key(i) for i in range(4)]
    engine.store_settled(before)
    region = region_of_this_process()
    return before, region, region.stat().st_size


def store_without_writing(engine, keys, req) -> None:
    """A store through vLLM's manager whose rows are not written here (the region file lost
    them; writing them would be ``SIGBUS`` in this process)."""
    out = engine.manager.prepare_store(keys, req)
    assert out is not None, "the primary refused the store"
    engine.manager.complete_store(out.keys_to_store, req, success=True)


def assert_lost(status, region, size_before, seen) -> None:
    assert status["regions_lost"] == 1, status
    lost = status["last_region_lost"]
    assert lost["path"] == str(region), lost
    assert lost["pid"] == os.getpid(), lost
    assert lost["found_bytes"] == 0, lost
    assert 0 < lost["expected_bytes"] <= size_before, lost
    assert f"seen {seen}" in lost["error"], lost


def assert_only_before_loads(extra, before, after) -> None:
    """Another vLLM process finds every key of ``before`` (A's bytes) and none of ``after``."""
    report = promote_in_another_process(extra, before + after)
    hits = {k for k, v in report["last"].items() if v == "HIT"}
    assert hits == {k.hex() for k in before}, report
    assert all(report["equal"].values()) and len(report["equal"]) == len(before), report


def test_a_vllm_engine_that_shrinks_its_region_fails_its_store_and_the_service_stays_up(
    tmp_path,
):
    service = start_service(tmp_path)
    try:
        extra = service["extra"]
        a = Engine(extra)
        try:
            before, region, size_before = store_before_the_shrink(a)
            os.truncate(region, 0)
            after = [key(100 + i) for i in range(4)]
            req = a.request()
            store_without_writing(a, after, req)
            a.settle()  # the job is reported (failed), none hangs
            a.finish(req)
            assert client_stats(a)["node_client_failed_jobs"] >= 1
            assert service["proc"].poll() is None, "the service died"
            status = service_status(service["socket"])
            assert_lost(status, region, size_before, "before the job")
            assert status["tier"]["used_slots"] == len(before), status
            assert_only_before_loads(extra, before, after)
        finally:
            a.shutdown()
    finally:
        end_service(service)


def test_a_region_shrunk_while_the_service_holds_its_store_commits_nothing(tmp_path):
    """The shrink lands after the store's G3 writes, before the commit (the service's test
    hook, ``hold_file``, holds the job there): with io_uring's registered buffers those
    writes succeed from pages the file no longer holds; the store must fail and commit
    nothing."""
    hold = tmp_path / "hold-jobs"
    service = start_service(tmp_path, hold_file=hold)
    try:
        extra = service["extra"]
        a = Engine(extra)
        try:
            before, region, size_before = store_before_the_shrink(a)
            hold.touch()
            after = [key(100 + i) for i in range(4)]
            req = a.request()
            a.store(after, req)  # rows written now, before the shrink
            a.step_end()  # the manager hands the job to the tier at the step's end
            deadline = time.monotonic() + 60
            while service_status(service["socket"])["test_hold"]["held_jobs"] != 1:
                assert time.monotonic() < deadline, "the service never held the store"
                time.sleep(0.01)
            os.truncate(region, 0)
            hold.unlink()
            a.settle()
            a.finish(req)
            assert service["proc"].poll() is None, "the service died"
            status = service_status(service["socket"])
            assert status["tier"]["used_slots"] == len(before), status
            assert_only_before_loads(extra, before, after)
            assert_lost(status, region, size_before, "after the transfer")
        finally:
            a.shutdown()
    finally:
        hold.unlink(missing_ok=True)
        end_service(service)
