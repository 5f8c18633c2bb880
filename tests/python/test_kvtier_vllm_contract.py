"""``KvtierTier`` at the edges of vLLM 0.33's tier contract (issue 28): the buffers it takes,
jobs it cannot run, the Python exception of each kvtier error, and per-tier KV events.

What vLLM's own tiers do is the reference: its base class reads only ``strides[0]`` of the
view; its fs tier reports an impossible job failed through ``get_finished_jobs`` (its own test
``test_out_of_bounds_block_id_smoke``, run against kvtier by ``test_vllm_fs_tier.py``), raises
an ``OSError`` for an unusable path and emits events only when its ``enable_kv_events`` and
the global flag are both on.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier_engine import ROW, Engine, extra_config, key, offloading_config, tier_entry
from vllm.v1.kv_offload.base import Medium, OffloadingKVEventsConfig, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob


def spec(events: bool = False):
    return SimpleNamespace(
        config=offloading_config({}),
        blocks_per_chunk=1,
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=events, self_describing_kv_events=False
        ),
    )


def tier_over(view, path, **keys):
    from kvtier.vllm import KvtierTier

    return KvtierTier(spec(keys.pop("events", False)), view, "KvtierTier",
                      paths=[str(path)], capacity_bytes=64 * ROW, **keys)


def page_aligned(rows, cols, dtype=np.uint8):
    """A zeroed (rows, cols) array in its own anonymous mapping (kvtier's O_DIRECT transfers
    need page-aligned rows, as vLLM's region is)."""
    import mmap

    n = rows * cols * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, n), dtype=dtype).reshape(rows, cols)


def job(job_id, keys, chunk_ids, promotion=False):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.asarray(chunk_ids),
                       is_promotion=promotion, req_context=ReqContext(req_id="r"))


def finished(tier, n, timeout_s=30.0):
    import time

    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += list(tier.get_finished_jobs())
        time.sleep(0.002)
    return {r.job_id: r for r in out}


def test_any_writable_c_contiguous_2d_view_is_taken_with_its_row_stride(tmp_path):
    import kvtier

    rows = page_aligned(8, ROW // 4, np.float32)
    rows[3] = np.arange(ROW // 4, dtype=np.float32)
    t = tier_over(memoryview(rows), tmp_path)
    try:
        assert t.block_size_bytes == ROW
        t.submit_store(job(1, [key(1)], [3]))
        t.drain_jobs()
        assert finished(t, 1)[1].success
        t.submit_load(job(2, [key(1)], [5], promotion=True))
        t.drain_jobs()
        assert finished(t, 1)[2].success
        assert np.array_equal(rows[5], rows[3])  # the same bytes, float32 or not
    finally:
        t.shutdown()
    # Refused, naming why: what kvtier cannot move whole rows in.
    read_only = np.zeros((8, ROW), dtype=np.uint8)
    read_only.flags.writeable = False
    cases = [
        (memoryview(read_only), "read-only"),
        (memoryview(np.zeros((8, 2 * ROW), dtype=np.uint8)[:, ::2]), "not C-contiguous"),
        (memoryview(np.zeros(8 * ROW, dtype=np.uint8)), "1 dimensions"),
    ]
    for view, why in cases:
        with pytest.raises(kvtier.ConfigError, match=why):
            tier_over(view, tmp_path / "refused")


def test_a_job_kvtier_cannot_run_is_a_failed_job_never_an_exception(tmp_path):
    rows = page_aligned(8, ROW)
    t = tier_over(memoryview(rows), tmp_path)
    try:
        t.submit_store(job(1, [key(1)], [8]))                    # past the region
        t.submit_load(job(2, [key(1)], [-1], promotion=True))    # negative
        t.submit_store(job(3, [key(1), key(2)], [0]))            # keys and rows differ
        t.submit_store(job(4, [key(1)], [1.0]))                  # not an integer
        t.submit_store(job(5, [key(1)], [2**32 + 1]))            # would wrap to row 1 as int32
        t.submit_store(job(6, [key(7), key(7)], [0, 1]))         # the same key twice
        t.submit_load(job(7, [key(9)], [2], promotion=True))     # not held
        assert t.has_pending_work()
        t.drain_jobs()
        got = finished(t, 7)
        assert {i: r.success for i, r in got.items()} == {
            1: False, 2: False, 3: False, 4: False, 5: False, 6: True, 7: False
        }
        assert not rows.any(), "no row written by a job that could not run"
    finally:
        t.shutdown()
    # After shutdown: reported failed too, once.
    t.submit_store(job(8, [key(1)], [0]))
    t.submit_load(job(9, [key(1)], [0], promotion=True))
    assert t.has_pending_work()
    got = {r.job_id: r.success for r in t.get_finished_jobs()}
    assert got == {8: False, 9: False}
    assert list(t.get_finished_jobs()) == [] and not t.has_pending_work()


def test_a_path_problem_is_an_oserror_and_a_value_problem_a_valueerror(tmp_path):
    import errno

    import kvtier

    rows = memoryview(page_aligned(8, ROW))
    with pytest.raises(OSError) as err:
        tier_over(rows, "/dev/null/invalid_path")
    assert isinstance(err.value, kvtier.PathError) and not isinstance(err.value, ValueError)
    assert "/dev/null/invalid_path" in str(err.value)
    assert err.value.filename and err.value.filename.startswith("/dev/null")
    assert err.value.errno == errno.ENOTDIR, err.value.errno
    with pytest.raises(ValueError) as err:
        tier_over(rows, tmp_path, io_engine="fast")
    assert isinstance(err.value, kvtier.ConfigError) and not isinstance(err.value, OSError)
    assert "secondary_tiers[0].io_engine" in str(err.value)


def test_docs_name_the_python_exception_of_every_error_kind():
    from kvtier import _native

    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    table = dict(re.findall(r"^\| `([a-z_]+)` \| `kvtier\.(\w+)`", docs, re.M))
    assert table == dict(_native.error_classes())


@pytest.mark.parametrize("tier_flag", [False, True])
@pytest.mark.parametrize("global_flag", [False, True])
def test_tier_events_need_the_tier_flag_and_the_global_flag(tmp_path, tier_flag, global_flag):
    e = Engine(extra_config(tier_entry(tmp_path, enable_kv_events=tier_flag)),
               events=global_flag)
    try:
        e.store_settled([key(1), key(2)])
        stored = [ev for ev in e.manager.take_events()
                  if ev.medium is Medium.STORAGE and not ev.removed]
        if tier_flag and global_flag:
            assert [k for ev in stored for k in ev.keys] == [key(1), key(2)]
        else:
            assert stored == []
    finally:
        e.shutdown()


def test_enable_kv_events_must_be_a_boolean(tmp_path):
    import kvtier

    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[0\]\.enable_kv_events"):
        Engine(extra_config(tier_entry(tmp_path, enable_kv_events="yes")), events=True)
