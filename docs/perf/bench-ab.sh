#!/bin/bash
# kvtier bench on several primary regions, each run in its own process, the order rotating
# every round; around each run it reads the block device's counters to give the average
# request size (a row split into several requests shows as smaller requests) and notes the
# load average. The figures in docs/performance.md come from:
#   ROUNDS=10 REGIONS="own vllm" BYTES=2GiB docs/perf/bench-ab.sh
#   ROUNDS=5 REGIONS="own vllm vllm-4k" BYTES=1GiB docs/perf/bench-ab.sh
# Environment: KVTIER (the binary, default: kvtier on PATH), DEV (the block device under the
# temp dir, default vda), OUT (results folder), ROUNDS, REGIONS, BYTES.
set -u
K=${KVTIER:-kvtier}
DEV=${DEV:-vda}
ROUNDS=${ROUNDS:-5}
OUT=${OUT:-kvtier-bench-ab}
BYTES=${BYTES:-1GiB}
read -r -a regions <<< "${REGIONS:-own vllm vllm-4k}"
n=${#regions[@]}
mkdir -p "$OUT"
for ((r = 0; r < ROUNDS; r++)); do
  for ((k = 0; k < n; k++)); do
    reg=${regions[$(((k + r) % n))]}
    read -r -a s0 < "/sys/block/$DEV/stat"
    la0=$(cut -d' ' -f1 /proc/loadavg)
    "$K" bench --bytes "$BYTES" --region "$reg" --json > "$OUT/r$r-$reg.json"
    rc=$?
    read -r -a s1 < "/sys/block/$DEV/stat"
    la1=$(cut -d' ' -f1 /proc/loadavg)
    reads=$((s1[0] - s0[0])); rsec=$((s1[2] - s0[2]))
    writes=$((s1[4] - s0[4])); wsec=$((s1[6] - s0[6]))
    echo "$r $reg rc=$rc load=$la0/$la1 reads=$reads read_kib_per_req=$((reads > 0 ? rsec / 2 / reads : 0)) writes=$writes write_kib_per_req=$((writes > 0 ? wsec / 2 / writes : 0))" >> "$OUT/disk.txt"
  done
done
echo "results: $OUT (one JSON report per run, disk.txt)"
