"""kvtier as SGLang 0.5.23's HiCache storage backend, against SGLang's own code and, as the
reference, SGLang's built-in ``file`` backend (harness: ``sglang_side.py``, which runs SGLang
in processes of its own; docs/sglang.md).

The expectations come from the bytes the tests write into the host pool, never from kvtier:
every page is filled with its own random bytes through SGLang's ``set_from_flat_data_page``
and compared, after the round trip, through SGLang's ``get_data_page``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sglang_src():
    env = os.environ.get("KVTIER_SGLANG_SRC")
    if env:
        return env
    import fetch_sglang

    try:
        return str(fetch_sglang.ensure())
    except fetch_sglang.Unavailable as e:
        pytest.skip(f"SGLang {fetch_sglang.load_pin()['version']} not cached and not downloadable: {e}")


def side(src, scenario, **doc):
    """Runs one scenario of sglang_side.py in a new Python process; its JSON answer."""
    doc["src"] = src
    p = subprocess.run(
        [sys.executable, str(HERE / "sglang_side.py"), scenario],
        input=json.dumps(doc), capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, f"sglang_side.py {scenario} failed:\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


CASES = [
    {"kind": "mha", "layout": "page_first", "page_size": 4},
    {"kind": "mha", "layout": "page_first_direct", "page_size": 4},
    {"kind": "mha", "layout": "layer_first", "page_size": 4},
    {"kind": "mla", "layout": "page_first", "page_size": 8},
    {"kind": "mla", "layout": "page_first_direct", "page_size": 8},
    {"kind": "mla", "layout": "layer_first", "page_size": 8},
]
#: G3 slots per page and bytes per slot SGLang's get_page_buffer_meta implies for the stand-in
#: pools (4 layers; 2 heads of 256 fp16 and 4 tokens a page for MHA, a 256-wide fp16 latent
#: and 8 tokens a page for MLA): K and V halves of a page in page_first*, one piece per layer (and K/V) in layer_first.
PIECES = {
    ("mha", "page_first"): (2, 4 * 4 * 2 * 256 * 2),
    ("mha", "page_first_direct"): (2, 4 * 4 * 2 * 256 * 2),
    ("mha", "layer_first"): (8, 4 * 2 * 256 * 2),
    ("mla", "page_first"): (1, 8 * 4 * 256 * 2),
    ("mla", "page_first_direct"): (1, 8 * 4 * 256 * 2),
    ("mla", "layer_first"): (4, 8 * 256 * 2),
}


def test_round_trips_in_every_layout_match_the_file_backend(sglang_src, tmp_path):
    rows = side(sglang_src, "roundtrip", dir=str(tmp_path), cases=CASES)
    for row in rows:
        case = (row["case"]["kind"], row["case"]["layout"])
        kv, flat, ref = row["kvtier"], row["kvtier-flat"], row["file"]
        for name, r in (("kvtier", kv), ("kvtier-flat", flat), ("file", ref)):
            assert r["stored"], (case, name)
            # Keys 0-3 and 5 stored: the existing prefix is 4, and from key 3 it is 1 (key 4
            # was never stored), as SGLang's prefix rule says.
            assert (r["prefix"], r["prefix_from_3"]) == (4, 1), (case, name, r)
            assert r["loaded"] == 4, (case, name)
            # Pages 0-3 came back into pages 4-7 byte for byte; pages 0-3 stayed wiped.
            assert r["got"][4:] == r["orig"][:4], (case, name)
            assert len(set(r["got"][:4])) == 1 and r["got"][0] not in r["orig"], (case, name)
        assert kv["got"] == ref["got"] == flat["got"], case
        for r in (kv, flat):
            assert (r["pieces"], r["piece_bytes"]) == PIECES[case]
            assert r["stats_type"] == "StorageMetrics"
            assert r["stats"] == {"prefetch_pgs": [4], "backup_pgs": [4, 1]}
            assert r["cleared"] is True and r["prefix_after_clear"] == 0, case
        # The flat-page path borrowed bounce pages from the pool and gave them all back.
        assert flat["free_pages_after"] == kv["free_pages_after"] == 4


def _flip(path: Path, snippet: bytes, count: int = 1) -> int:
    """Flips one bit inside the only place of ``path`` that holds ``snippet``."""
    data = path.read_bytes()
    at = data.find(snippet)
    assert at >= 0 and data.find(snippet, at + 1) < 0, path
    with open(path, "r+b") as f:
        f.seek(at + 7)
        f.write(bytes([data[at + 7] ^ 0x10]))
    return at


def test_restart_second_process_and_a_flipped_byte(sglang_src, tmp_path):
    results = {}
    for which in ("kvtier", "file"):
        d = tmp_path / which
        first = side(sglang_src, "store_pages", dir=str(d), which=which)
        assert first["stored"]
        # Reopened by another process: every stored page is there, byte for byte.
        again = side(sglang_src, "load_pages", dir=str(d), which=which)
        assert again["pid"] != first["pid"]
        assert again["prefix"] == 3 and again["per_page"] == [True] * 3, (which, again)
        assert again["got"] == first["orig"], which
        # One bit of page 1 flipped on disk (found by its bytes, not through kvtier).
        files = [p for p in d.rglob("*") if p.is_file() and p.stat().st_size > 8192]
        holders = [p for p in files if bytes.fromhex(first["snippet"]) in p.read_bytes()]
        assert len(holders) == 1, (which, files)
        _flip(holders[0], bytes.fromhex(first["snippet"]))
        results[which] = (first, side(sglang_src, "load_pages", dir=str(d), which=which))
    first, kv = results["kvtier"]
    # kvtier: page 1 fails its CRC and is never handed over; pages 0 and 2 load; page 1 is a
    # miss afterwards (the prefix stops before it).
    assert kv["prefix"] == 3
    assert kv["per_page"] == [True, False, True], kv
    assert kv["got"][0] == first["orig"][0] and kv["got"][2] == first["orig"][2]
    assert kv["got"][1] != first["orig"][1]
    assert kv["prefix_after"] == 1
    assert kv["checksum_failures"] == 1
    # SGLang's file backend (no checksum) hands the flipped page over as good.
    first_f, ref = results["file"]
    assert ref["per_page"] == [True, True, True]
    assert ref["got"][1] != first_f["orig"][1]


def test_refusals_name_the_key_the_layout_and_both_namespaces(sglang_src, tmp_path):
    out = side(sglang_src, "refusals", dir=str(tmp_path))
    assert out["model_a"] is None
    msg = out["model_b"]
    assert msg.startswith("ConfigError") and "another model or rank layout" in msg, msg
    assert "'org/model-a'" in msg and "'org/model-b'" in msg, msg
    msg = out["tp_size_2"]
    assert "tp_size 1" in msg and "tp_size 2" in msg, msg
    # Another layout of the same model and rank is another page format: refused too.
    assert "'page_first'" in out["layout_first"] and "'layer_first'" in out["layout_first"]
    assert "extra_config.capacity" in out["misspelt_key"] and "capacity_bytes" in out["misspelt_key"]
    assert "extra_config.capacity_bytes" in out["bad_capacity"], out["bad_capacity"]
    assert "page_first" in out["small_pieces"] and "4096" in out["small_pieces"], out["small_pieces"]
    assert "MLA model at TP 2" in out["mla_tp2"]
    assert "extra_config.service_socket_path" in out["mla_tp2"], out["mla_tp2"]
    # A client of the node service takes no nvme keys (the service's configuration has them),
    # and needs the pool's file descriptor (SGLang's shm allocator).
    assert "extra_config.capacity_bytes" in out["client_nvme_key"], out["client_nvme_key"]
    assert '"allocator": "shm"' in out["client_no_shm"], out["client_no_shm"]
    # Rank 1 of TP 2 gets a directory of its own next to rank 0's.
    assert out["tp1_rank1_dir"] is None
    assert out["dirs"] == ["tp0", "tp1"]


def client_extra(socket) -> dict:
    return {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": True, "allocator": "shm", "service_socket_path": str(socket)}


def start_serve(tmp_path, namespace, slot_bytes):
    """``kvtier serve`` (the binary) as the node service for engines presenting
    ``namespace`` with slots of ``slot_bytes``; the process, once its socket accepts."""
    import socket as sk
    import time

    kvtier = os.environ.get("KVTIER_BIN")
    if not kvtier:
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    sock = tmp_path / "kvtier.sock"
    slabs = tmp_path / "slabs"
    slabs.mkdir()
    cfg = tmp_path / "service.json"
    cfg.write_text(json.dumps({
        "cpu_bytes_to_use": "1GiB",
        "service": {"socket_path": str(sock)},
        "secondary_tiers": [{"type": "nvme", "paths": [str(slabs)], "capacity_bytes": "8MiB",
                             "direct_io": "auto", "fsync": "never"}],
    }))
    proc = subprocess.Popen(
        [kvtier, "serve", "--config", str(cfg), "--namespace", namespace, "--slot-bytes",
         str(slot_bytes), "--metrics-addr", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvtier serve exited: {proc.stderr.read()}"
        try:
            with sk.socket(sk.AF_UNIX) as c:
                c.connect(str(sock))
            return proc, sock
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("kvtier serve's socket never accepted")


def stop_serve(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_mla_at_tp2_shares_pages_across_ranks_through_the_node_service(sglang_src, tmp_path):
    """SGLang 0.5.23 stores an MLA page from TP rank 0 only (its controller's backup_skip)
    and every TP rank loads it, under a key without the TP rank (its file backend's suffix).
    kvtier's ranks, each a process of its own, do the same through one node service."""
    mla = dict(kind="mla", tp_size=2)
    # Without a service the rank says which namespace and slot size a service needs.
    probe = side(sglang_src, "tp_rank", which="kvtier", tp_rank=0, seed=1,
                 extra=client_extra(tmp_path / "kvtier.sock"), **mla)
    import re

    m = re.search(r"--namespace ([0-9a-f]{64}) --slot-bytes (\d+)", probe["error"])
    assert m, probe
    proc, sock = start_serve(tmp_path, m.group(1), int(m.group(2)))
    try:
        extra = client_extra(sock)
        r0 = side(sglang_src, "tp_rank", which="kvtier", tp_rank=0, seed=1, extra=extra, **mla)
        r1 = side(sglang_src, "tp_rank", which="kvtier", tp_rank=1, seed=500, extra=extra, **mla)
        # A non-MLA model's rank presents another namespace: the service refuses it.
        mha = side(sglang_src, "tp_rank", which="kvtier", kind="mha", tp_size=2, tp_rank=1,
                   seed=9, extra=extra)
    finally:
        stop_serve(proc)
    assert r0["pid"] != r1["pid"]
    assert r0["client"] and r1["client"] and r0["namespace"] == r1["namespace"] == m.group(1)
    # SGLang's own rule: rank 0 writes, rank 1 does not.
    assert (r0["backup_skip"], r1["backup_skip"]) == (False, True)
    assert r0["stored"] is True and r0["prefix"] == 4 and r0["loaded"] == 4
    assert r0["got"] == r0["orig"]
    # Rank 1, in another process, finds rank 0's four pages and loads them byte for byte
    # (not its own pages, which it filled with other bytes).
    assert r1["prefix"] == 4 and r1["loaded"] == 4, r1
    assert r1["got"] == r0["orig"] and r1["orig"] != r0["orig"]
    # Called to store anyway, rank 1 writes nothing (as SGLang's hf3fs backend: reported
    # stored, rank 0 stores): the keys it was given are not in the pool.
    assert r1["stored_anyway"] == [True] * 4 and r1["prefix_stored_anyway"] == 0
    # One rank does not empty the pool every engine shares.
    assert r0["cleared"] is False and r1["cleared"] is False
    assert "error" in mha and "digest" in mha["error"] and "--namespace" in mha["error"], mha
    # SGLang's file backend, the reference: the same sharing.
    f0 = side(sglang_src, "tp_rank", which="file", tp_rank=0, seed=1, dir=str(tmp_path / "f"), **mla)
    f1 = side(sglang_src, "tp_rank", which="file", tp_rank=1, seed=500, dir=str(tmp_path / "f"), **mla)
    assert (f0["backup_skip"], f1["backup_skip"]) == (False, True)
    assert (f1["prefix"], f1["loaded"]) == (r1["prefix"], r1["loaded"]) == (4, 4)
    assert f1["got"] == f0["orig"]


def test_a_non_mla_model_at_tp2_keeps_ranks_apart(sglang_src, tmp_path):
    """MHA KV differs per TP rank: rank 1 must not see rank 0's pages (SGLang's file backend
    suffixes its keys with the TP rank)."""
    for which in ("kvtier", "file"):
        d = tmp_path / which
        doc = dict(which=which, kind="mha", tp_size=2, dir=str(d),
                   extra={**side_extra([str(d)])})
        r0 = side(sglang_src, "tp_rank", tp_rank=0, seed=1, **doc)
        r1 = side(sglang_src, "tp_rank", tp_rank=1, seed=500, store=False, **doc)
        assert (r0["backup_skip"], r1["backup_skip"]) == (False, False), which
        assert r0["stored"] is True and r0["prefix"] == 4 and r0["got"] == r0["orig"], which
        assert r1["prefix"] == 0 and r1["loaded"] == 0, (which, r1)
    assert sorted(p.name for p in (tmp_path / "kvtier").iterdir()) == ["tp0", "tp1"]


def side_extra(paths) -> dict:
    return {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": True, "allocator": "shm", "paths": paths, "capacity_bytes": "8MiB",
            "direct_io": "auto", "fsync": "never", "region_huge_pages": "never"}


def test_waiting_calls_let_other_python_threads_run(sglang_src, tmp_path):
    out = side(sglang_src, "gil", dir=str(tmp_path))
    assert out["stored"] == 64
    # 64 pages of 256 KiB with fsync: milliseconds in kvtier, during which the other thread
    # counts (with the GIL held it could not count at all).
    assert out["ticks_during"] > 1000, out


def test_prefetch_and_backup_threads_at_once_each_get_their_own_pages(sglang_src, tmp_path):
    out = side(sglang_src, "two_threads", dir=str(tmp_path))
    assert out["first"] == [True] * 32
    assert out["store"] == [[True] * 4] * 8 and out["load"] == [[True] * 4] * 8, out
    assert out["loaded_equal"]
    assert out["prefix"] == 64


def test_importing_kvtier_sglang_starts_nothing():
    code = (
        "import sys, threading; import kvtier.sglang; "
        "assert 'sglang' not in sys.modules and 'kvtier._native' not in sys.modules; "
        "assert threading.active_count() == 1; print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr
