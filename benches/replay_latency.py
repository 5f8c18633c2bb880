"""Timed figures of ``kvtier replay``: load latency (lookup to loaded, p50 / p99), device busy
time and wall time, admit-all against TinyLFU admission, on a quiet machine.

Runs ``--rounds`` rounds; each round replays the trace once per policy, the order alternating
round by round, with the tier's default durability (``fsync = always``) on ``--path`` (put it
on the NVMe device to measure). Prints, per policy, the median and the spread (min..max) over
the rounds. Counts are printed once (they are the same every round; the script checks).

    cargo build --release
    python3 benches/replay_latency.py --kvtier target/release/kvtier \\
        --trace ../shared/traces/mooncake-synthetic.jsonl --path /mnt/nvme0 --rounds 5

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

FIGURES = ("load_latency_p50_s", "load_latency_p99_s", "device_busy_s", "wall_s")
COUNTS = ("served_primary", "served_tier", "recomputed", "nvme_bytes_written")


def run(args, policy: str) -> dict:
    cmd = [args.kvtier, "replay", "--trace", args.trace, "--json", "--admission", policy,
           "--tier-capacity", args.tier_capacity, "--primary", args.primary,
           "--bytes-per-block", args.bytes_per_block, "--time-scale", str(args.time_scale)]
    if args.path:
        cmd += ["--path", args.path]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvtier", default="target/release/kvtier")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--path")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tier-capacity", default="25%")
    ap.add_argument("--primary", default="5%")
    ap.add_argument("--bytes-per-block", default="16KiB")
    ap.add_argument("--time-scale", type=float, default=0.0)
    args = ap.parse_args()
    policies = ["all", "tinylfu"]
    results: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for p in order:
            results[p].append(run(args, p))
            print(f"round {r + 1}/{args.rounds} {p} done", file=sys.stderr)
    for p, rs in results.items():
        counts = {c: rs[0][c] for c in COUNTS}
        if any({c: x[c] for c in COUNTS} != counts for x in rs):
            raise SystemExit(f"{p}: the counts differ between rounds: {[x[c] for x in rs for c in COUNTS]}")
        print(f"{p}: {counts}")
        for f in FIGURES:
            vals = [x[f] for x in rs if x[f] is not None]
            if not vals:
                print(f"  {f:20} n/a ({rs[0].get('device_busy_note')})")
                continue
            scale, unit = (1e3, "ms") if f.startswith("load") else (1.0, "s")
            print(f"  {f:20} median {statistics.median(vals) * scale:9.3f} {unit}  "
                  f"(min {min(vals) * scale:.3f}, max {max(vals) * scale:.3f}, n={len(vals)})")


if __name__ == "__main__":
    main()
