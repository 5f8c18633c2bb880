"""kvtier's ``fs`` tier against vLLM 0.33.0's own ``fs`` tier on one ``root_dir``.

vLLM's side is its real ``FileSystemTierManager`` (built by vLLM's own spec and factory from
a ``secondary_tiers`` entry, over vLLM's CPU primary) and its real ``FileMapper``; the paths,
``config.json`` and the files themselves come from vLLM's code, never from a copy of its rules.
kvtier's side is the ``kvtier-replay fs`` driver (``cli/src/bin/kvtier_replay/fs.rs``) running
kvtier's ``FsTier`` on the same directory. Checked:

* the file path of every key (random 16- and 32-byte block hashes, group ids up to 2^32 - 1),
  the folder and ``config.json`` byte for byte;
* vLLM stores, kvtier loads the same bytes (counted as unverified: vLLM writes no CRC);
* kvtier stores, vLLM's lookup says HIT and its load brings back the same bytes;
* a flipped byte in a file kvtier stored fails that key only in kvtier, while vLLM (which
  checks no CRC) would load it.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

import harness
import vllm_side
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import ScheduleEndContext, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

STRIDE = vllm_side.ROW_STRIDE
SEED = 1414


@pytest.fixture
def vllm_fs_tier(tmp_path):
    """vLLM's spec and manager with one ``fs`` tier on ``tmp_path``; yields the tier. The
    manager is shut down at the end, also when the test fails: that shuts the tier down and
    removes vLLM's ``/dev/shm`` region, which nothing else removes."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * STRIDE,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
    }
    _, manager = vllm_side.tiering_manager(extra)
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, FileSystemTierManager)
        assert tier.block_size_bytes == STRIDE
        yield tier
    finally:
        manager.shutdown()


def random_keys(rng, n):
    keys = []
    for i in range(n):
        hash_len = 32 if i % 2 == 0 else 16  # sha256 and xxhash-128 block hashes
        group = rng.choice([0, 1, 7, rng.randrange(2**32)])
        keys.append(make_offload_key(rng.randbytes(hash_len), group))
    return keys


def rows_for(rng, n):
    return [rng.randbytes(STRIDE) for _ in range(n)]


def kvtier(root_dir, fields, steps):
    (result,) = harness.replay(
        "fs",
        {"scenarios": [{"root_dir": str(root_dir), "fields": fields, "row_stride": STRIDE,
                        "steps": steps}]},
    )["results"]
    assert "error" not in result, result
    return result["steps"]


def wait_jobs(tier, ids, timeout=30.0):
    done = {}
    deadline = time.time() + timeout
    while set(done) != set(ids):
        for r in tier.get_finished_jobs():
            done[r.job_id] = r
        assert time.time() < deadline, f"vLLM's fs tier did not report {set(ids) - set(done)}"
        time.sleep(0.002)
    return done


def vllm_rows(tier):
    return tier._primary_kv_view.cast("B")


def test_paths_folder_and_config_json_are_vllms(tmp_path, vllm_fs_tier):
    rng = random.Random(SEED)
    tier = vllm_fs_tier
    fields = tier.file_mapper.get_run_config()
    keys = random_keys(rng, 200)
    (paths,) = kvtier(tmp_path, fields, [{"op": "paths", "keys": [k.hex() for k in keys]}])
    for key, path in zip(keys, paths["paths"]):
        assert path == tier.file_mapper.get_file_name(key), key.hex()
    assert paths["base_path"] == tier.file_mapper.base_path
    assert paths["data_dir"] == tier.file_mapper.base_path + "_r0"
    # vLLM wrote config.json when its tier started; kvtier accepted the folder (it refuses one
    # whose fields differ) and would write exactly the same bytes.
    with open(tier.file_mapper.get_config_file_path(), encoding="utf-8") as f:
        assert f.read() == paths["config_json"]


def test_vllm_stores_kvtier_loads(tmp_path, vllm_fs_tier):
    rng = random.Random(SEED + 1)
    tier = vllm_fs_tier
    keys = random_keys(rng, 24)
    rows = rows_for(rng, len(keys))
    view = vllm_rows(tier)
    for c, row in enumerate(rows):
        view[c * STRIDE:(c + 1) * STRIDE] = row
    req = ReqContext(req_id="store")
    tier.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.arange(len(keys), dtype=np.int32),
                                  is_promotion=False, req_context=req))
    assert wait_jobs(tier, [1])[1].success
    for key in keys:
        assert os.path.exists(tier.file_mapper.get_file_name(key))
    fields = tier.file_mapper.get_run_config()
    lookup, load = kvtier(tmp_path, fields, [
        {"op": "lookup", "keys": [k.hex() for k in keys]},
        {"op": "load", "keys": [k.hex() for k in keys]},
    ])
    assert lookup["answers"] == ["hit"] * len(keys)
    assert load["error"] is None, load
    for key, want, got in zip(keys, rows, load["rows"]):
        assert got is not None and bytes.fromhex(got) == want, key.hex()
    assert (load["verified"], load["unverified"]) == (0, len(keys))


def test_kvtier_stores_vllm_loads(tmp_path, vllm_fs_tier):
    rng = random.Random(SEED + 2)
    tier = vllm_fs_tier
    fields = tier.file_mapper.get_run_config()
    keys = random_keys(rng, 24)
    rows = rows_for(rng, len(keys))
    (store,) = kvtier(tmp_path, fields, [
        {"op": "store", "keys": [k.hex() for k in keys], "rows": [r.hex() for r in rows]},
    ])
    assert store["success"], store
    req = ReqContext(req_id="load")
    for key in keys:
        # vLLM's async lookup: RETRY until its background check answered.
        deadline = time.time() + 30
        while (answer := tier.lookup(key, req)) == LookupResult.RETRY:
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))
            assert time.time() < deadline
            time.sleep(0.002)
        assert answer == LookupResult.HIT, key.hex()
    view = vllm_rows(tier)
    view[:len(keys) * STRIDE] = bytes(len(keys) * STRIDE)
    tier.submit_load(TransferJob(job_id=2, keys=keys, chunk_ids=np.arange(len(keys), dtype=np.int32),
                                 is_promotion=True, req_context=req))
    assert wait_jobs(tier, [2])[2].success
    for c, (key, want) in enumerate(zip(keys, rows)):
        assert bytes(view[c * STRIDE:(c + 1) * STRIDE]) == want, key.hex()
    tier.on_request_finished(req)


def test_a_flipped_byte_fails_the_key_in_kvtier_only(tmp_path, vllm_fs_tier):
    rng = random.Random(SEED + 3)
    tier = vllm_fs_tier
    fields = tier.file_mapper.get_run_config()
    keys = random_keys(rng, 4)
    rows = rows_for(rng, len(keys))
    kvtier(tmp_path, fields, [
        {"op": "store", "keys": [k.hex() for k in keys], "rows": [r.hex() for r in rows]},
    ])
    path = tier.file_mapper.get_file_name(keys[1])
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    (load,) = kvtier(tmp_path, fields, [{"op": "load", "keys": [k.hex() for k in keys]}])
    assert load["rows"][1] is None and "CRC32" in load["error"], load
    for i in (0, 2, 3):
        assert bytes.fromhex(load["rows"][i]) == rows[i]
    assert load["verified"] == 3
