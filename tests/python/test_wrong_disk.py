"""The wrong disk through the Python package (issue 28 item 7; ``docs/g3.md``, "The wrong
disk"): ``KvtierTier`` created on a mounted filesystem refuses, once that filesystem is
unmounted, to open the bare mount point (naming the path and both filesystems) and creates
nothing there; with ``"on_wrong_filesystem": "degraded"`` vLLM's manager runs with the tier
serving nothing and ``vllm:kvtier_g3_wrong_filesystem`` saying why.

Needs root (to mount a tmpfs on the tier's path); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from kvtier_engine import Engine, extra_config, tier_entry


def _mount_tmpfs(mnt) -> None:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on the tier's path: {done.stderr.strip()}")


def test_an_unmounted_tier_filesystem_is_refused_not_replaced(tmp_path, monkeypatch):
    import kvtier

    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem on the tier's path needs root")
    # kvtier's filesystem records for this test only (read when a tier opens).
    monkeypatch.setenv("KVTIER_STATE_DIR", str(tmp_path / "state"))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _mount_tmpfs(mnt)
    try:
        e = Engine(extra_config(tier_entry(mnt, direct_io="auto")))
        e.shutdown()
        assert (mnt / "kvtier-g3.slab").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    assert not any(mnt.iterdir())

    with pytest.raises(Exception) as err:
        Engine(extra_config(tier_entry(mnt, direct_io="auto")))
    assert isinstance(err.value, (kvtier.ConfigError, OSError)), repr(err.value)
    message = str(err.value)
    assert str(mnt) in message, message
    assert "was created on tmpfs (" in message, message
    assert "is on tmpfs" not in message, message
    assert "Mount it" in message, message
    assert not any(mnt.iterdir()), f"created {list(mnt.iterdir())} on the wrong disk"

    e = Engine(extra_config(tier_entry(mnt, direct_io="auto", on_wrong_filesystem="degraded")))
    try:
        series = e.manager.get_stats().data["data"]["vllm:kvtier_g3_wrong_filesystem"]
        assert list(series.values()) == [1], series
    finally:
        e.shutdown()
    assert not any(mnt.iterdir()), f"created {list(mnt.iterdir())} on the wrong disk"
