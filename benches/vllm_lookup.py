"""Scheduler-side cost of a secondary-tier lookup under vLLM 0.33.0: kvtier vs vLLM's fs tier.

A benchmark run by hand (never a test). It builds vLLM's own TieringOffloadingSpec and manager
twice, once with ``kvtier.vllm.KvtierTier`` and once with vLLM's ``fs`` tier
(``FileSystemTierManager``), on directories under ``--dir`` (default: the system temp dir),
stores the same chunks through both (vLLM's cascade), and then times, on the calling thread:

* ``tier.lookup(key, req)`` for stored keys (HIT) and for absent keys (MISS), the call vLLM's
  manager makes on the scheduler thread for every chunk the primary misses. vLLM's fs tier
  answers RETRY the first time it sees a key and probes the file system on a background
  thread; its figure below is the steady state, once its verdict cache holds the key (the
  first ask of each key is timed separately);
* ``manager.lookup(key, req)`` for absent keys: the whole scheduler-side path (primary lookup,
  metrics, the tier).

Each figure is the median over ``--rounds`` rounds of the mean of ``--keys`` calls, with the two
tiers alternating round by round (the machine is shared and noisy). Run it with the package
built in release mode:

    target/tmp/python-venv/bin/pip install ./python    # release build of kvtier._native
    target/tmp/python-venv/bin/python benches/vllm_lookup.py

(after one ``cargo test``, which set up that venv and the vLLM 0.33.0 sources).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
import conftest  # noqa: E402,F401  (vLLM's sources and the stand-ins for its heavy imports)
from kvtier_engine import Engine, extra_config, key, tier_entry  # noqa: E402

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402


def build(kind: str, root: Path, n_keys: int) -> Engine:
    path = root / kind
    path.mkdir()
    if kind == "kvtier":
        entry = tier_entry(path, capacity_bytes=4 * n_keys * 4096)
    else:
        entry = {"type": "fs", "root_dir": str(path), "n_read_threads": 4, "n_write_threads": 4}
    engine = Engine(extra_config(entry, cpu_bytes_to_use=8 * 4096))
    stored = [key(i) for i in range(n_keys)]
    for start in range(0, n_keys, 4):
        req = engine.request()
        engine.store(stored[start : start + 4], req)
        engine.settle()
        engine.finish(req)
    return engine


def per_call_ns(fn, keys, req) -> float:
    t0 = time.perf_counter_ns()
    for k in keys:
        fn(k, req)
    return (time.perf_counter_ns() - t0) / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtier-lookup-", dir=args.dir) as tmp:
        engines = {}
        try:
            for kind in ("kvtier", "fs"):
                engines[kind] = build(kind, Path(tmp), args.keys)
            measure(engines, args)
        finally:
            for e in engines.values():
                e.shutdown()


def measure(engines: dict, args) -> None:
    hits = [key(i) for i in range(args.keys)]
    misses = [key(10_000_000 + i) for i in range(args.keys)]
    results: dict[tuple[str, str], list[float]] = {}
    first_ask: dict[str, float] = {}
    for kind, e in engines.items():
        tier, req = e.tier(), e.request()
        # Warm up; the fs tier's first ask of each key is RETRY and queues a probe.
        fresh = [key(20_000_000 + i) for i in range(args.keys)]
        first_ask[kind] = per_call_ns(tier.lookup, fresh, req)
        for _ in range(200):
            answers = [tier.lookup(k, req) for k in hits + misses]  # ask every key
            e.step_end()
            if LookupResult.RETRY not in answers:
                break
            time.sleep(0.01)
        lost = sum(tier.lookup(k, req) is not LookupResult.HIT for k in hits)
        if lost:  # a store failed (a full disk, say): the figures would compare other work
            raise SystemExit(
                f"{kind}: {lost} of {len(hits)} stored keys do not answer HIT; see the tier's "
                f"log above and the free space under {args.dir}"
            )
        assert all(tier.lookup(k, req) is LookupResult.MISS for k in misses), kind
        e._bench_req = req
    for _ in range(args.rounds):
        for kind, e in engines.items():
            tier, req = e.tier(), e._bench_req
            for what, keys, fn in (
                ("tier.lookup HIT", hits, tier.lookup),
                ("tier.lookup MISS", misses, tier.lookup),
                ("manager.lookup MISS", misses, e.manager.lookup),
            ):
                results.setdefault((kind, what), []).append(per_call_ns(fn, keys, req))
    print(f"{args.keys} keys, {args.rounds} rounds, median of per-round means (ns per call)")
    print(f"{'':24}{'kvtier':>12}{'vLLM fs':>12}")
    for what in ("tier.lookup HIT", "tier.lookup MISS", "manager.lookup MISS"):
        row = [statistics.median(results[(k, what)]) for k in ("kvtier", "fs")]
        print(f"{what:24}{row[0]:>12.0f}{row[1]:>12.0f}")
    print(f"{'first ask of a key':24}{first_ask['kvtier']:>12.0f}{first_ask['fs']:>12.0f}"
          "   (fs: RETRY + probe queued)")


if __name__ == "__main__":
    main()
