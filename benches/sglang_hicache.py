#!/usr/bin/env python3
"""kvtier's SGLang HiCache backend against SGLang's own ``file`` backend, on the same disk.

Both backends are built by SGLang 0.5.23's ``StorageBackendFactory`` and driven through the
HiCache controller's own page functions (``_page_set_zero_copy`` / ``_page_get_zero_copy`` for
kvtier, ``_generic_page_set`` / ``_generic_page_get`` for ``file``, as SGLang picks them), over
one host pool in real shared memory (``tests/python/sglang_side.py``: SGLang's MHA host-pool
methods, ``page_first``, Llama-3.1-8B's KV geometry at TP 1 by default: 32 layers, 8 KV heads
of 128, fp16). Each round stores ``--pages`` pages with ``batch_set`` calls of 128 pages
(SGLang's ``STORAGE_BATCH_SIZE``) into an empty directory, then loads them back; the sides
alternate, the first side alternating too. Before the ``file`` backend's loads its files are
dropped from the page cache (``posix_fadvise(DONTNEED)``), since kvtier reads with
``O_DIRECT``. kvtier runs with ``fsync = never`` like the ``file`` backend (which never syncs).
Every loaded page is compared with what was stored.

Run from the repository root with the test harness's venv (``pip install ./python`` in
release mode, ``pip install -r tests/python/requirements.txt``)::

    python benches/sglang_hicache.py --dir /mnt/nvme0/bench --pages 512 --rounds 5

Prints medians and min-max of pages/s and GB/s per side and phase, and the JSON of every run
with ``--json``. Memory: the host pool (``--pages`` + 1 pages, 8 MiB each by default) and, for
the ``file`` backend, one flat copy of a page at a time; disk: twice the stored pages for
kvtier's preallocated slab.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import fetch_sglang  # noqa: E402
import sglang_side  # noqa: E402


def one_round(src, side, directory, args):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    pool = sglang_side.HostPool(
        src, "mha", "page_first", args.page_size, page_num=args.pages + 1,
        layer_num=args.layers, head_num=args.heads, head_dim=args.head_dim,
    )
    for p in range(args.pages):
        pool.fill(p, seed=p + 1)
    digests = [hashlib.sha256(pool.page_bytes(p)).digest() for p in range(args.pages)]
    if side == "kvtier":
        # As in a server: kvtier's own 2 MiB-page mapping of the pool where it can.
        extra = sglang_side.kvtier_extra(
            [directory], capacity_bytes=str(args.capacity), fsync="never", region_huge_pages="auto"
        )
        b = sglang_side.backend(src, "dynamic", extra, pool)
        ctl = sglang_side.Controller(src, b, pool, zero_copy=True)
    else:
        b = sglang_side.backend(src, "file", {"file_storage_path": directory}, pool)
        ctl = sglang_side.Controller(src, b, pool, zero_copy=False)
    keys = [sglang_side.page_key(i, directory) for i in range(args.pages)]
    batches = [range(i, min(i + 128, args.pages)) for i in range(0, args.pages, 128)]
    t0 = time.perf_counter()
    for r in batches:
        assert ctl.set(keys[r.start:r.stop], list(r)), f"{side}: store failed"
    t_set = time.perf_counter() - t0
    pool.zero()
    if side == "file":
        for f in Path(directory).rglob("*.bin"):
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    t0 = time.perf_counter()
    for r in batches:
        got = ctl.get(keys[r.start:r.stop], list(r))
        assert got == len(r), f"{side}: loaded {got} of {len(r)} pages"
    t_get = time.perf_counter() - t0
    bad = [p for p in range(args.pages) if hashlib.sha256(pool.page_bytes(p)).digest() != digests[p]]
    assert not bad, f"{side}: pages {bad[:5]} differ"
    if side == "kvtier":
        b.close()
    page_bytes = len(pool.page_bytes(0))
    shutil.rmtree(directory, ignore_errors=True)
    return {"side": side, "set_s": t_set, "get_s": t_get, "pages": args.pages, "page_bytes": page_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    src = str(fetch_sglang.ensure())
    sglang_side.setup(src)
    sglang_side.install_storage_metrics(src)
    page = 2 * args.page_size * args.layers * args.heads * args.head_dim * 2
    args.capacity = page * args.pages * 2
    runs = []
    for i in range(args.rounds):
        order = ("kvtier", "file") if i % 2 == 0 else ("file", "kvtier")
        for side in order:
            runs.append(one_round(src, side, os.path.join(args.dir, f"kvtier-bench-{side}"), args))
    print(f"{args.pages} pages of {page / 2**20:.1f} MiB (page_first, {args.layers} layers, "
          f"{args.heads} KV heads x {args.head_dim}, fp16, {args.page_size} tokens), "
          f"{args.rounds} rounds, median [min-max]")
    for phase in ("set", "get"):
        for side in ("kvtier", "file"):
            secs = [r[f"{phase}_s"] for r in runs if r["side"] == side]
            pps = sorted(args.pages / s for s in secs)
            gbs = sorted(args.pages * page / s / 1e9 for s in secs)
            print(f"  batch_{phase:3} {side:6}: {statistics.median(pps):9.1f} pages/s "
                  f"[{pps[0]:.1f}-{pps[-1]:.1f}]  {statistics.median(gbs):6.2f} GB/s "
                  f"[{gbs[0]:.2f}-{gbs[-1]:.2f}]")
    if args.json:
        print(json.dumps(runs))


if __name__ == "__main__":
    main()
