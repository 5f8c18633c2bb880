"""Tier hit ratio and NVMe bytes written against tier capacity, per admission policy.

Runs ``kvtier replay --json`` on one trace for every (tier capacity, admission policy) pair,
prints the Markdown tables of ``docs/workloads.md``, writes every report to ``--out`` (JSON)
and draws the plot (``--svg``). Rows measured through vLLM's own manager
(``benches/vllm_replay.py --json``) can be added with ``--vllm FILE``; they are drawn beside
kvtier's. Counts only (served blocks, bytes): they do not depend on the machine's speed, so
the default ``--fsync never`` changes nothing but the wall time.

    cargo build --release
    python3 benches/workloads.py --kvtier target/release/kvtier \\
        --trace ../shared/traces/mooncake-synthetic.jsonl \\
        --out docs/workloads/synthetic.json --svg docs/workloads/synthetic.svg

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Policy name -> (--admission, --tier-eviction).
POLICY_FLAGS = {"all": ("all", "lru"), "arc": ("all", "arc"), "tinylfu": ("tinylfu", "lru"),
                "tinylfu-arc": ("tinylfu", "arc")}
POLICIES = tuple(POLICY_FLAGS)
LABELS = {"all": "admit-all LRU", "arc": "admit-all ARC", "tinylfu": "TinyLFU admission (LRU)",
          "tinylfu-arc": "TinyLFU admission (ARC)"}
COLORS = {"all": "#1f77b4", "arc": "#17becf", "tinylfu": "#d62728", "tinylfu-arc": "#8c564b",
          "vllm-fs": "#2ca02c",
          "vllm-kvtier-all": "#9467bd", "vllm-kvtier-tinylfu": "#ff7f0e"}


def replay(args, capacity: int, policy: str) -> dict:
    cmd = [args.kvtier, "replay", "--trace", str(args.trace), "--json",
           "--bytes-per-block", args.bytes_per_block, "--primary", args.primary,
           "--tier-capacity", f"{capacity}%", "--admission", POLICY_FLAGS[policy][0],
           "--tier-eviction", POLICY_FLAGS[policy][1], "--fsync", args.fsync]
    if args.path:
        cmd += ["--path", str(args.path)]
    print("+", " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"kvtier replay failed ({out.returncode}):\n{out.stderr}")
    r = json.loads(out.stdout)
    r["capacity_pct"] = capacity
    r["policy"] = policy
    return r


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def tables(rows: list[dict]) -> str:
    by = {(r["capacity_pct"], r["policy"]): r for r in rows}
    caps = sorted({r["capacity_pct"] for r in rows})
    lines = ["| tier capacity | policy | tier hit ratio | tokens from tier | vs LRU | "
             "NVMe written (MiB) | vs LRU | NVMe read (MiB) | write amp. | rejected |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def delta(r: dict, base: dict | None, k: str) -> str:
        if base is None or not base[k]:
            return "-"
        return f"{100 * (r[k] / base[k] - 1):+.1f} %"

    for c in caps:
        base = by.get((c, "all"))
        for p in POLICIES:
            r = by.get((c, p))
            if r is None:
                continue
            wa = r["write_amplification"]
            lines.append(
                f"| {c} % ({r['tier_blocks']:,} blocks) | {LABELS[p]} | "
                f"{100 * r['tier_hit_ratio']:.1f} % | {r['prefill_tokens_saved_tier']:,} | "
                f"{delta(r, base, 'prefill_tokens_saved_tier')} | "
                f"{mib(r['nvme_bytes_written'])} | {delta(r, base, 'nvme_bytes_written')} | "
                f"{mib(r['nvme_bytes_read'])} | {'-' if wa is None else f'{wa:.2f}'} | "
                f"{r['rejected_blocks']:,} |")
    return "\n".join(lines)


def vllm_table(vllm: list[dict]) -> str:
    lines = ["| vLLM 0.33 manager with | tier capacity | tier hit ratio | tokens from tier | "
             "storage written (MiB) | storage read (MiB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for v in vllm:
        cap = f"{v['capacity_pct']:g} % ({v['tier_blocks']:,} blocks)" if v.get("capacity_pct") \
            else "unbounded"
        lines.append(f"| {v['tier']} | {cap} | {100 * v['tier_hit_ratio']:.1f} % | "
                     f"{v['prefill_tokens_saved_tier']:,} | {mib(v['bytes_written'])} | "
                     f"{mib(v['bytes_read'])} |")
    return "\n".join(lines)


def as_row(v: dict) -> dict:
    """A row of benches/vllm_replay.py in kvtier replay's names (4 KiB blocks)."""
    return {"tier_hit_ratio": v["tier_hit_ratio"], "nvme_bytes_written": v["bytes_written"],
            "bytes_per_block": 4096}


def svg(rows: list[dict], vllm: list[dict], title: str) -> str:
    """Two panels: tier hit ratio (%) and NVMe MiB written, against tier capacity (%)."""
    w, h, pad_l, pad_b, pad_t = 420, 300, 60, 45, 35
    caps = sorted({r["capacity_pct"] for r in rows})
    series = {p: sorted((r for r in rows if r["policy"] == p), key=lambda r: r["capacity_pct"])
              for p in POLICIES if any(r["policy"] == p for r in rows)}
    # Writes in blocks (bytes written / bytes per block), so that vLLM's rows (4 KiB blocks,
    # its process's storage writes) and kvtier replay's (--bytes-per-block) compare.
    panels = [("tier hit ratio (% of block references)", lambda r: 100 * r["tier_hit_ratio"]),
              ("NVMe writes (bytes written / bytes per block)",
               lambda r: r["nvme_bytes_written"] / r["bytes_per_block"])]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w + 40}" height="{h + 85}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{w + 20}" y="16" text-anchor="middle" font-size="13">{title}</text>']
    for i, (name, f) in enumerate(panels):
        x0 = 20 + i * (w + 20)
        vals = [f(r) for s in series.values() for r in s]
        vals += [f(as_row(v)) for v in vllm]
        top = max(vals + [1e-9]) * 1.1
        px = lambda c: x0 + pad_l + (c / 100) * (w - pad_l - 10)  # noqa: E731
        py = lambda v: pad_t + (1 - v / top) * (h - pad_t - pad_b) + 20  # noqa: E731
        out.append(f'<text x="{x0 + w / 2}" y="{pad_t + 10}" text-anchor="middle">{name}</text>')
        out.append(f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(100)}" y2="{py(0)}" stroke="#000"/>')
        out.append(f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(0)}" y2="{py(top)}" stroke="#000"/>')
        for k in range(5):
            v = top * k / 4
            out.append(f'<text x="{px(0) - 4}" y="{py(v) + 4}" text-anchor="end">{v:,.0f}</text>')
        for c in caps:
            out.append(f'<text x="{px(c)}" y="{py(0) + 14}" text-anchor="middle">{c} %</text>')
        out.append(f'<text x="{x0 + w / 2}" y="{py(0) + 30}" text-anchor="middle">'
                   'tier capacity (% of unique blocks)</text>')
        for p, s in series.items():
            pts = " ".join(f"{px(r['capacity_pct']):.1f},{py(f(r)):.1f}" for r in s)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{COLORS[p]}" '
                       'stroke-width="2"/>')
            for r in s:
                out.append(f'<circle cx="{px(r["capacity_pct"]):.1f}" cy="{py(f(r)):.1f}" r="3" '
                           f'fill="{COLORS[p]}"/>')
        for v in vllm:
            c = v.get("capacity_pct") or 100
            val = f(as_row(v))
            color = COLORS.get(v["key"], "#2ca02c")
            out.append(f'<rect x="{px(c) - 4:.1f}" y="{py(val) - 4:.1f}" width="8" height="8" '
                       f'fill="none" stroke="{color}" stroke-width="2"/>')
    legend = [(LABELS[p], COLORS[p], "line") for p in series]
    legend += [(f"vLLM manager, {v['tier']}", COLORS.get(v["key"], "#2ca02c"), "box") for v in vllm]
    for j, (name, color, kind) in enumerate(legend):
        x = 40 + (j % 3) * 280
        y = h + 45 + 16 * (j // 3)
        if kind == "line":
            out.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{color}" '
                       'stroke-width="2"/>')
        else:
            out.append(f'<rect x="{x + 6}" y="{y - 4}" width="8" height="8" fill="none" '
                       f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{x + 26}" y="{y + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvtier", default="target/release/kvtier")
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--capacities", default="10,25,50,100")
    ap.add_argument("--primary", default="5%")
    ap.add_argument("--bytes-per-block", default="16KiB")
    ap.add_argument("--fsync", default="never")
    ap.add_argument("--path", type=Path)
    ap.add_argument("--vllm", type=Path, help="rows from benches/vllm_replay.py --json")
    ap.add_argument("--out", type=Path, help="write every report here (JSON)")
    ap.add_argument("--svg", type=Path, help="write the plot here")
    ap.add_argument("--from-json", type=Path, help="redraw from an earlier --out, no replay")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"which to replay, of {', '.join(POLICIES)}")
    ap.add_argument("--keep", type=Path,
                    help="an earlier --out: its rows of policies not replayed now are kept")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
    else:
        run = args.policies.split(",")
        unknown = [p for p in run if p not in POLICY_FLAGS]
        if unknown:
            raise SystemExit(f"unknown policies {unknown}; expected some of {', '.join(POLICIES)}")
        rows = [r for r in json.loads(args.keep.read_text()) if r["policy"] not in run] \
            if args.keep else []
        rows += [replay(args, int(c), p) for c in args.capacities.split(",") for p in run]
        rows.sort(key=lambda r: (r["capacity_pct"], POLICIES.index(r["policy"])))
    vllm = json.loads(args.vllm.read_text()) if args.vllm else []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(tables(rows))
    if vllm:
        print()
        print(vllm_table(vllm))
    if args.svg:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(svg(rows, vllm, f"{args.trace.name if args.trace else ''}: "
                                f"primary {args.primary} of unique blocks"))


if __name__ == "__main__":
    main()
