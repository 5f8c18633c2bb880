"""``kvtier replay`` (kvtier's own manager) against vLLM 0.33.0's own manager on the same trace.

A generated trace (conversations that share system prompts and grow turn by turn, one-off
requests; deterministic) is replayed twice: by the ``kvtier`` binary, and through vLLM's
``TieringOffloadingManager`` with ``KvtierTier`` (``vllm_trace_replay.py``), with the same
primary and tier sizes. The blocks served by the primary, served by the tier, recomputed and
refused must be the same: vLLM's manager decides what reaches the tier (lookups of the blocks
its primary missed, cascades of computed blocks), kvtier's manager claims the same semantics,
and the admission policy runs inside the tier in both. vLLM's own ``fs`` tier (unbounded, it
never evicts) must serve what kvtier serves with a tier that holds every block.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

import harness
from vllm_trace_replay import read_trace, replay


def write_trace(path, seed: int = 7, n: int = 160) -> None:
    rng = random.Random(seed)
    prompts = [list(range(1000 * p, 1000 * p + rng.randint(2, 6))) for p in range(4)]
    next_id = 100_000
    convs: list[list[int]] = []
    lines = []
    for i in range(n):
        roll = rng.random()
        if convs and roll < 0.5:
            c = rng.choice(convs)  # the next turn: the whole history and a new message
        else:
            c = list(rng.choice(prompts))
            if roll < 0.8:
                convs.append(c)
        grow = rng.randint(1, 4)
        c.extend(range(next_id, next_id + grow))
        next_id += grow
        tokens = 512 * len(c) + rng.choice([0, 100])  # sometimes a partial last block
        ids = c + ([next_id] if tokens % 512 else [])
        next_id += 1
        lines.append(json.dumps({"timestamp": 10 * i, "input_length": tokens,
                                 "output_length": 10, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def kvtier_replay(trace, tmp_path, primary: int, tier: int, admission: str) -> dict:
    out = subprocess.run(
        [harness.kvtier_bin(), "replay", "--trace", str(trace), "--bytes-per-block", "4KiB",
         "--primary", f"{primary}%", "--tier-capacity", f"{tier}%", "--admission", admission,
         "--path", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


FIELDS = ("block_references", "served_primary", "served_tier", "recomputed", "stores_refused")


@pytest.mark.parametrize(("tier", "admission"), [(25, "all"), (25, "tinylfu"), (60, "tinylfu")])
def test_kvtier_replay_counts_match_vllms_manager(tmp_path, tier, admission):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    blocks = read_trace(trace, None)
    unique = len({b for r in blocks for b in r})
    ours = kvtier_replay(trace, tmp_path, 10, tier, admission)
    (tmp_path / "vllm").mkdir()
    theirs = replay("kvtier", admission, blocks, unique, tmp_path / "vllm",
                    primary_pct=10, tier_pct=tier)
    assert {f: ours[f] for f in FIELDS} == {f: theirs[f] for f in FIELDS}
    assert ours["served_tier"] > 0, "the trace must exercise the tier"
    if admission == "tinylfu":
        assert ours["rejected_blocks"] > 0, "the trace must exercise the policy"


def test_vllm_fs_tier_serves_what_an_unbounded_kvtier_tier_serves(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    blocks = read_trace(trace, None)
    unique = len({b for r in blocks for b in r})
    ours = kvtier_replay(trace, tmp_path, 10, 100, "all")
    (tmp_path / "fs").mkdir()
    fs = replay("fs", None, blocks, unique, tmp_path / "fs", primary_pct=10, tier_pct=100)
    assert {f: ours[f] for f in FIELDS} == {f: fs[f] for f in FIELDS}
