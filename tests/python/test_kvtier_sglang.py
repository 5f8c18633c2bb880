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
    # Rank 1 of TP 2 gets a directory of its own next to rank 0's.
    assert out["tp1_rank1_dir"] is None
    assert out["dirs"] == ["tp0", "tp1"]


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
