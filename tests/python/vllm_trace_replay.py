"""A Mooncake-format KV-cache trace replayed through vLLM 0.33.0's own tiering manager
(:class:`kvtier_engine.Engine`), playing vLLM's scheduler exactly as ``kvtier replay`` plays it
for kvtier's manager: per request, lookups in order until the first miss (RETRY asked again
each step), the step end that submits promotions, steps until they are done, every served
block loaded and its bytes compared with what was stored, the rest "computed" (written into
the rows vLLM hands out) and stored, steps until the cascades are done.

Used by ``benches/vllm_replay.py`` (whole traces) and ``test_replay_vs_vllm.py`` (kvtier's
replay against vLLM's manager on the same trace).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from kvtier_engine import ROW, Engine, extra_config, payload, tier_entry
from vllm.v1.kv_offload.base import LookupResult

TOKENS_PER_BLOCK = 512
MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def key(block: int, seed: int = 1) -> bytes:
    """The key ``kvtier replay --seed 1`` gives trace block ``block`` (``block_key`` in
    ``cli/src/replay/driver.rs``): a 32-byte hash and group 0, vLLM's key shape. The same
    bytes on both sides, so that the admission sketch (a hash of the key) sees the same
    collisions and the two replays count the same."""
    le = lambda v: (v & MASK).to_bytes(8, "little")  # noqa: E731
    return le(seed) + le(block) + le(_mix(seed ^ block)) + le(_mix(block + 1)) + bytes(4)


def read_trace(path: Path, limit: int | None) -> list[list[int]]:
    """Each request's full blocks (vLLM stores and looks up only full blocks)."""
    out = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(r["hash_ids"][: r["input_length"] // TOKENS_PER_BLOCK])
            if limit and len(out) >= limit:
                break
    return out


def proc_io() -> tuple[int, int]:
    """Bytes this process caused to be written to and read from storage (/proc/self/io)."""
    f = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(f["write_bytes"]), int(f["read_bytes"])


def lookup(engine: Engine, k: bytes, req) -> LookupResult:
    deadline = time.monotonic() + 60
    while True:
        r = engine.manager.lookup(k, req)
        if r is not LookupResult.RETRY:
            return r
        if time.monotonic() > deadline:
            raise SystemExit("a lookup still answers RETRY after 60 s")
        engine.step_end()
        time.sleep(0.0005)


def run_request(engine: Engine, blocks: list[int], c: dict) -> None:
    req = engine.request()
    keys = [key(b) for b in blocks]
    looked = 0
    primary_hits = 0
    for k in keys:
        r = lookup(engine, k, req)
        if r is LookupResult.MISS:
            break
        if r is LookupResult.HIT and looked == primary_hits:
            primary_hits += 1
        looked += 1
    engine.step_end([req.req_id])
    engine.settle()
    primary = engine.manager.primary_tier
    served = 0
    for k in keys[:looked]:
        if primary.lookup(k, req) is not LookupResult.HIT:
            break
        served += 1
    if served:
        rows = engine.load(keys[:served], req)
        for k in keys[:served]:
            if rows[k] != payload(k):
                raise SystemExit(f"block {k.hex()} was served with bytes that differ")
        c["bytes_verified"] += served * ROW
    c["served_primary"] += min(served, primary_hits)
    c["served_tier"] += max(0, served - primary_hits)
    c["recomputed"] += len(keys) - served
    c["block_references"] += len(keys)
    if served < len(keys):
        store(engine, keys[served:], req, c)
    engine.settle()
    engine.finish(req)


def store(engine: Engine, keys: list, req, c: dict) -> None:
    """prepare_store, the "GPU" writes each new row, complete_store (which cascades); a
    store the primary cannot make room for is counted, as ``kvtier replay`` counts it."""
    out = engine.manager.prepare_store(keys, req)
    if out is None:
        c["stores_refused"] += len(keys)
        return
    for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        engine.write_row(int(cid), payload(k))
    if out.keys_to_store:
        engine.manager.complete_store(out.keys_to_store, req, success=True)


def admission_counts(engine: Engine) -> dict:
    """The KvtierTier's admission counters (``g3_admission_blocks{outcome}``)."""
    out = {}
    for name, _kind, labels, value in engine.tier()._tier.metrics():
        if name == "g3_admission_blocks":
            out[f"{dict(labels)['outcome']}_blocks"] = int(value)
    return out


def replay(kind: str, admission: str | None, trace, unique: int, root: Path, *,
           primary_pct: float, tier_pct: float, progress: bool = False) -> dict:
    path = root / f"{kind}-{admission}"
    path.mkdir()
    primary_rows = max(1, math.ceil(primary_pct / 100 * unique))
    if kind == "kvtier":
        slots = max(1, math.ceil(tier_pct / 100 * unique))
        entry = tier_entry(path, capacity_bytes=slots * ROW, admission=admission)
    else:
        slots = None
        entry = {"type": "fs", "root_dir": str(path)}
    engine = Engine(extra_config(entry, cpu_bytes_to_use=primary_rows * ROW))
    c = dict.fromkeys(("block_references", "served_primary", "served_tier", "recomputed",
                       "bytes_verified", "stores_refused"), 0)
    w0, r0 = proc_io()
    t0 = time.monotonic()
    try:
        for i, blocks in enumerate(trace):
            run_request(engine, blocks, c)
            if progress and i % 200 == 0:
                print(f"{kind}/{admission}: {i}/{len(trace)}", file=sys.stderr)
        gate = admission_counts(engine) if kind == "kvtier" else {}
    finally:
        engine.shutdown()
    w1, r1 = proc_io()
    name = f"KvtierTier, admission {admission}" if kind == "kvtier" else "fs tier (vLLM's own)"
    return {
        "key": f"vllm-{kind}" + (f"-{admission}" if admission else ""),
        "tier": name,
        "capacity_pct": tier_pct if slots else None,
        "tier_blocks": slots,
        "primary_blocks": primary_rows,
        **c,
        **gate,
        "tier_hit_ratio": c["served_tier"] / max(1, c["block_references"]),
        "prefill_tokens_saved_tier": c["served_tier"] * TOKENS_PER_BLOCK,
        "bytes_written": w1 - w0,
        "bytes_read": r1 - r0,
        "wall_s": time.monotonic() - t0,
    }


