"""A Mooncake-format KV-cache trace replayed through vLLM 0.33.0's own tiering manager.

What a vLLM user gets from each secondary tier on the same trace and disk: vLLM's
``TieringOffloadingManager`` (built by its own ``TieringOffloadingSpec``) with

* ``kvtier``: ``kvtier.vllm.KvtierTier`` (G3, O_DIRECT, CRC) at ``--tier-capacity`` of the
  trace's unique blocks, with ``admission`` ``all`` and ``tinylfu`` (the policy runs inside
  the tier: it sees only the lookups vLLM's manager sends it and the stores it cascades);
* ``fs``: vLLM's own ``fs`` tier (one file per chunk; it has no capacity and never evicts, so
  it is the unbounded, admit-everything reference).

The script plays vLLM's scheduler exactly as ``kvtier replay`` plays it for kvtier's manager:
per request, lookups in order until the first miss (RETRY asked again each step), the step
end that submits promotions, steps until they are done, every served block loaded and its
bytes compared with what was stored, the rest "computed" (written into the rows vLLM hands
out) and stored, steps until the cascades are done. Rows are 4 KiB (the harness's model).

    target/tmp/python-venv/bin/python benches/vllm_replay.py \\
        --trace ../shared/traces/mooncake-synthetic.jsonl --tier-capacity 25 --json out.json

(after one ``cargo test --test python_suite``, which set up that venv, the package and the
vLLM 0.33.0 sources). Counts do not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
import conftest  # noqa: E402,F401  (vLLM's sources and the stand-ins for its heavy imports)
from vllm_trace_replay import read_trace, replay  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--primary", type=float, default=5.0, help="%% of unique blocks")
    ap.add_argument("--tier-capacity", type=float, default=25.0, help="%% of unique blocks")
    ap.add_argument("--tiers", default="kvtier:all,kvtier:tinylfu,fs")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path, help="write the rows here (benches/workloads.py --vllm)")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    trace = read_trace(args.trace, args.limit)
    unique = len({b for r in trace for b in r})
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-replay-", dir=args.dir) as tmp:
        for spec in args.tiers.split(","):
            kind, _, admission = spec.partition(":")
            rows.append(replay(kind, admission or None, trace, unique, Path(tmp),
                               primary_pct=args.primary, tier_pct=args.tier_capacity,
                               progress=args.progress))
    for r in rows:
        print(f"{r['tier']:36} tier {r['served_tier']:>7} ({100 * r['tier_hit_ratio']:.1f} %)  "
              f"primary {r['served_primary']:>7}  recomputed {r['recomputed']:>7}  "
              f"written {r['bytes_written'] / 2**20:,.1f} MiB  read {r['bytes_read'] / 2**20:,.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
