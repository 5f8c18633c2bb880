#!/usr/bin/env bash
# Issue 29's figures: kvtier on the memory a vLLM 0.33 deployment really hands over (its
# /dev/shm region, pinned in 4 KiB pages by cudaHostRegister before kvtier adopts it), against
# kvtier's own region and against the same region on a huge-page tmpfs (the host fix).
# docs/performance.md ("The region vLLM really hands over") explains each part.
#
#   benches/pinned-region.sh [OUT_DIR]          (default OUT_DIR: target/pinned-region)
#
# Environment (defaults take about 8-10 minutes on the development VM, as root):
#   BYTES=2GiB       per bench run (2 MiB rows, the whole stack: store, evict, load, verify)
#   ROUNDS=3         bench rounds, regions alternating, medians and spread
#   SIZE=256MiB      per side of each fio-compare pass in the row-size sweep
#   PAIRS=3          fio-compare rounds per point (more are taken while the spread is > 10 %)
#   ROWS=64KiB,256KiB,1MiB,2MiB,8MiB,16MiB   the sweep's row sizes
#   DEPTH=32         the sweep's depth
#   DIR=             where slabs go (default: the system temp dir)
#
# Needs: root (the vllm-pinned-huge region mounts a private huge=within_size tmpfs unless
# /dev/shm already is one; fio's best reserves hugetlb pages), fio (apt-get install fio).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/pinned-region}
BYTES=${BYTES:-2GiB}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-256MiB}
PAIRS=${PAIRS:-3}
ROWS=${ROWS:-64KiB,256KiB,1MiB,2MiB,8MiB,16MiB}
DEPTH=${DEPTH:-32}
PATH_ARGS=()
if [ -n "${DIR:-}" ]; then PATH_ARGS=(--path "$DIR"); fi
mkdir -p "$OUT"
cargo build --release --quiet
K=target/release/kvtier
export KVTIER_LOG=${KVTIER_LOG:-warn}

echo "== kvtier version (does this host's /dev/shm give vLLM's region 2 MiB pages?)"
$K version | tee "$OUT/version.txt"

echo "== 1. bench, 2 MiB rows: own vs vllm-pinned (staged) vs vllm-pinned-huge (host fix)"
$K bench "${PATH_ARGS[@]}" --bytes "$BYTES" --rounds "$ROUNDS" \
    --region own --region vllm-pinned --region vllm-pinned-huge 2>"$OUT/bench.log" \
    | tee "$OUT/bench.txt"

echo "== 2. the same pinned region without staging (KVTIER_STAGING=never: what 0.1.0 did)"
KVTIER_STAGING=never $K bench "${PATH_ARGS[@]}" --bytes "$BYTES" --rounds "$ROUNDS" \
    --region own --region vllm-pinned 2>"$OUT/bench-unstaged.log" \
    | tee "$OUT/bench-unstaged.txt"

echo "== 3. row-size sweep at depth $DEPTH, store and load, against fio's best"
for side in own vllm-pinned vllm-pinned:never; do
    region=${side%%:*}
    staging=auto
    if [ "$side" != "$region" ]; then staging=${side#*:}; fi
    name="sweep-$region-staging-$staging"
    KVTIER_STAGING=$staging $K fio-compare "${PATH_ARGS[@]}" --size "$SIZE" --pairs "$PAIRS" \
        --iodepth "$DEPTH" --depths "$DEPTH" --region "$region" --row-sizes "$ROWS" \
        --plot "$OUT/$name.svg" 2>"$OUT/$name.log" | tee "$OUT/$name.txt"
done
echo "figures in $OUT"
