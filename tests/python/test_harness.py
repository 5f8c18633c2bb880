"""The harness itself: vLLM's modules load from the cache, the stand-ins behave like torch."""

import importlib
import importlib.metadata
from pathlib import Path

import pytest

import harness
import kvtier_placeholders
import torch


def test_vllm_is_the_pinned_release(vllm_src):
    import vllm

    assert importlib.metadata.version("vllm") == "0.33.0"
    assert vllm.__version__ == "0.33.0"
    assert str(vllm.__file__).startswith(str(vllm_src))


@pytest.mark.parametrize(
    "module",
    [
        "vllm.v1.kv_cache_interface",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping",
        "vllm.v1.kv_offload.file_mapper",
        "vllm.v1.kv_offload.tiering.backpressure",
        "vllm.v1.kv_offload.tiering.factory",
        "vllm.v1.kv_offload.tiering.spec",
        "vllm.v1.kv_offload.tiering.manager",
        "vllm.v1.kv_offload.cpu.manager",
    ],
)
def test_scheduler_side_modules_import(module):
    importlib.import_module(module)


def test_metadata_torch_follows_torch_rules():
    raw = torch.zeros(64, dtype=torch.int8)
    assert raw.shape == (64,) and raw.stride() == (1,) and raw.element_size() == 1
    # view(dtype) to a wider type divides the last dimension and the other strides.
    v = torch.as_strided(raw, (2, 4, 8), (32, 8, 1), 0).view(torch.bfloat16)
    assert (tuple(v.shape), v.stride(), v.storage_offset()) == ((2, 4, 4), (16, 4, 1), 0)
    assert v[1].storage_offset() == 16 and v[1].shape == (4, 4)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 64"):
        torch.as_strided(raw, (2, 4, 8), (32, 8, 1), 1)
    with pytest.raises(RuntimeError, match="stride"):
        torch.as_strided(raw, (8, 2), (1, 8)).view(torch.float32)
    assert torch.tensor([], dtype=torch.float8_e4m3fn).element_size() == 1
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="no data"):
        raw.data_ptr()
    with pytest.raises(AttributeError, match="not modelled"):
        raw.to("cuda")


def test_frombuffer_tensors_share_the_buffer():
    buf = bytearray(64)
    t = torch.frombuffer(memoryview(buf), dtype=torch.int8).view(4, 16)
    arr = t.numpy()
    assert arr.shape == (4, 16) and arr.ctypes.data == t.data_ptr()
    arr[1, 2] = 7
    assert buf[18] == 7
    row = t[2]
    assert row.data_ptr() == t.data_ptr() + 32


def test_placeholders_refuse_to_be_values():
    p = kvtier_placeholders.Placeholder("pkg.fn")
    result = p(1)
    assert "pkg.fn" in kvtier_placeholders.CALLS
    with pytest.raises(TypeError, match=r"pkg\.fn\(\) has no value"):
        bool(result)
    with pytest.raises(TypeError):
        list(result)
    with pytest.raises(TypeError, match="has no value"):
        bool(result.attribute == 3)

    class Sub(p):  # import-time subclassing works
        pass

    assert Sub.__mro__[-1] is object


def test_switchable_clock_drives_vllm_time():
    import time

    from vllm.v1.kv_offload.tiering.base import TransferJob

    with harness.clock.manual(1000.0) as clock:
        assert time.monotonic() == 1000.0
        clock.advance(harness.TIME_QUANTUM_S)
        job = TransferJob(job_id=0, keys=[], chunk_ids=None, is_promotion=False, req_context=None)
        assert job.submit_time == 1000.0 + 1 / 512
    assert time.monotonic() != 1000.0 + 1 / 512


def test_region_files_are_the_regions_vllm_makes_for_this_runs_engines():
    """harness.region_files (what conftest's leak check looks at) finds the file vLLM's own
    SharedOffloadRegion creates for an engine id of this run, and only for this run."""
    import os

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    assert os.environ[harness.RUN_ID_ENV] == str(os.getpid()), "set by conftest for this run"
    before = harness.region_files()
    region = SharedOffloadRegion(
        engine_id=harness.engine_id("test"),
        num_chunks=2,
        rank=None,
        kv_bytes_per_chunk=4096,
        cpu_page_size=4096,
    )
    try:
        made = harness.region_files() - before
        assert made == {Path(region.mmap_path)}, (made, region.mmap_path)
        assert not harness.region_files(run=f"{os.getpid()}0") & made, "another run's files"
        assert harness.region_files(pid=os.getpid()) >= made
        assert not harness.region_files(pid=os.getpid() + 1) & made, "another process's files"
    finally:
        region.cleanup()
    assert not Path(region.mmap_path).exists()
    assert harness.region_files() == before
