"""vLLM 0.33.0's own fs-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py`` from the
0.33.0 source distribution, fetched and cached by ``fetch_vllm.ensure_sdist_tests``, never
committed) run against ``kvtier.vllm.KvtierTier``.

The file is loaded unchanged; in its namespace only these names are replaced:

* ``FileSystemTierManager`` -> :class:`FsKeysAdapter`, a ``KvtierTier`` subclass that only maps
  the fs tier's constructor keys: ``root_dir`` -> ``paths``, plus ``capacity_bytes``
  (:data:`CAPACITY`); ``n_read_threads`` / ``n_write_threads`` (the fs tier's thread pool)
  are dropped. The factory's ``"fs"`` type builds the same adapter (the factory test goes
  through vLLM's ``SecondaryTierFactory``).
* ``torch`` -> ``numpy_torch`` (real bytes, see that module): the suite's ``torch`` stub holds
  no data.
* ``lookup_and_wait`` -> :func:`lookup_and_wait`: vLLM's helper waits on the fs tier's private
  probe queue (``tier._lookup_manager._pending_results``); this one asks again until no
  answer is RETRY (kvtier answers from its index; RETRY only while it recovers), for up to
  30 s (vLLM's 1 s is for its probe thread; a loaded machine may take longer to recover even
  an empty index), then returns the answers as vLLM's does.

Tests that look at the fs tier's own files, its private fields or its I/O functions are
skipped, each with its reason (:data:`SKIPS`); every other case must pass.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

import fetch_vllm
import numpy_torch

#: Capacity the adapter gives each tier (the tests' regions are at most 32 rows of 2 MiB).
CAPACITY = "256MiB"

#: vLLM's test -> why it does not apply to kvtier.
SKIPS = {
    "test_store_creates_file_and_lookup_succeeds": "checks the fs tier's per-key file",
    "test_store_accepts_block_published_by_another_writer":
        "injects a race into the fs tier's own file publishing (io.os.replace)",
    "test_store_then_load_roundtrip": "checks the fs tier's per-key files after the load",
    "test_shutdown_discards_pending_tasks": "inspects the fs tier's private thread pool",
    "test_store_load_data_integrity": "checks the fs tier's per-key files after the store",
    "test_store_load_roundtrip_without_o_direct":
        "patches the fs tier's O_DIRECT probe and reads its private _use_o_direct",
    "test_wait_idle_blocks_until_tasks_complete":
        "tests the fs tier's own thread pool (DualQueueThreadPool), no tier",
    "test_batch_lookup_c_extension": "tests the fs tier's C extension, no tier",
    "test_failed_load_corrects_verdict_and_removes_corrupt_file":
        "truncates the fs tier's per-key file and reads its private lookup manager",
    "test_failed_load_after_abort_does_not_break_newer_probe":
        "removes the fs tier's per-key file and waits on its private lookup manager",
    "test_batched_partial_load_failure_keeps_loaded_blocks":
        "corrupts the fs tier's per-key file and reads its private lookup manager",
    "test_batched_load_first_block_fails_marks_whole_batch":
        "corrupts the fs tier's per-key file",
    "test_transient_load_failure_leaves_file": "replaces the fs tier's per-key file by a symlink loop",
    "test_mixed_job_results_emit_event_only_for_successful_job":
        "injects failures through the fs tier's own I/O function (batch_store_block)",
    "test_partially_failed_store_emits_no_event":
        "injects failures through the fs tier's own I/O function and reads _store_job_keys",
    "test_events_disabled_by_default": "reads the fs tier's fields events and _store_job_keys",
    "test_events_require_global_kv_events_flag":
        "reads the fs tier's fields events and _store_job_keys (the rule itself: "
        "test_kvtier_vllm_contract.py::test_tier_events_need_the_tier_flag_and_the_global_flag)",
    "test_fs_tier_cross_tp_round_trip": "compares the fs tier's file_mapper paths",
}


def _load_vllm_tests():
    if os.environ.get("KVTIER_REQUIRE_PYTHON_TESTS") == "1":
        root = fetch_vllm.ensure_sdist_tests()
    else:
        try:
            root = fetch_vllm.ensure_sdist_tests()
        except fetch_vllm.Unavailable as e:
            pytest.skip(f"vLLM 0.33.0's sdist is not cached and not downloadable: {e}",
                        allow_module_level=True)
    path = root / "tests" / "v1" / "kv_offload" / "tiering" / "test_fs_tier.py"
    spec = importlib.util.spec_from_file_location("vllm_test_fs_tier", path)
    module = importlib.util.module_from_spec(spec)
    # vLLM's modules load first, with the suite's torch stub (they keep it).
    for name in ("vllm.v1.kv_offload.tiering.fs.manager", "vllm.v1.kv_offload.tiering.factory",
                 "vllm.v1.kv_offload.tiering.manager", "vllm.v1.kv_offload.config"):
        importlib.import_module(name)
    # The module's `import torch` gets the data-bearing numpy torch; vLLM keeps its stub.
    saved = sys.modules.get("torch")
    sys.modules["torch"] = numpy_torch
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules["torch"] = saved
    return module


vllm_tests = _load_vllm_tests()


def _adapter_class():
    import kvtier.vllm

    base = kvtier.vllm.KvtierTier

    class FsKeysAdapter(base):
        """``KvtierTier`` built from the fs tier's constructor keys (module docs)."""

        def __init__(self, offloading_spec, primary_kv_view, tier_type, root_dir,
                     n_read_threads=None, n_write_threads=None, **rest):
            super().__init__(offloading_spec, primary_kv_view, tier_type,
                             paths=[root_dir], capacity_bytes=CAPACITY, **rest)

    return FsKeysAdapter


FsKeysAdapter = _adapter_class()


def lookup_and_wait(tier, keys, ctx=vllm_tests._CTX, timeout=30.0):
    """vLLM's helper without its wait on the fs tier's private probe queue (module docs)."""
    for k in keys:
        tier.lookup(k, ctx)
    tier.on_schedule_end(vllm_tests.ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + timeout
    results = [tier.lookup(k, ctx) for k in keys]
    while vllm_tests.LookupResult.RETRY in results and time.monotonic() < deadline:
        time.sleep(0.01)
        results = [tier.lookup(k, ctx) for k in keys]
    return results


vllm_tests.FileSystemTierManager = FsKeysAdapter
vllm_tests.lookup_and_wait = lookup_and_wait


@pytest.fixture(autouse=True)
def _fs_type_builds_the_adapter(monkeypatch):
    """vLLM's factory resolves ``"type": "fs"`` to the adapter (so to kvtier)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    monkeypatch.setitem(SecondaryTierFactory._registry, "fs", lambda: FsKeysAdapter)


# vLLM's fixtures and tests, collected from this module (skips marked).
fs_tier = vllm_tests.fs_tier
fs_tier_with_events = vllm_tests.fs_tier_with_events
_COLLECTED = []
for _name in dir(vllm_tests):
    if not _name.startswith("test_"):
        continue
    _fn = getattr(vllm_tests, _name)
    if _name in SKIPS:
        _fn = pytest.mark.skip(reason=f"fs-tier specific: {SKIPS[_name]}")(_fn)
    globals()[_name] = _fn
    _COLLECTED.append(_name)


def test_every_skip_names_a_test_of_vllm():
    """A skip list entry that names no test of vLLM's file would hide nothing; catch typos
    (and tests renamed in another vLLM release)."""
    assert not set(SKIPS) - set(_COLLECTED)
