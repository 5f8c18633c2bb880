#!/usr/bin/env bash
# GPUDirect Storage device check: run on a machine with an NVIDIA GPU, the CUDA driver and
# cuFile (libcufile.so or libcufile.so.0). Device machines have no network, so the binary is
# built elsewhere (no CUDA needed: cudarc loads the libraries at run time) and carried over:
#
#   here:    cargo build --release --features gds      # target/release/kvtier
#   there:   gds/device-check.sh [DIR] [BYTES]         # DIR: a directory on the NVMe to test
#
# It prints what the machine has (driver, cuFile, nvidia-fs, GPU), then runs
# `kvtier bench --gds`: chunks in GPU memory stored by GDS and loaded by the CPU path and by
# GDS, stored by the CPU path from the same GPU buffers and loaded by both, every byte compared
# and every row CRC-checked by the tier; one table of GB/s. Exit status: non-zero on any
# mismatch or failure. Paste the table into docs/gds.md with the date and the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KVTIER_BIN:-target/release/kvtier}
DIR=${1:-${TMPDIR:-/tmp}}
BYTES=${2:-1GiB}

if [ ! -x "$BIN" ]; then
  echo "device-check: $BIN not found; build it with: cargo build --release --features gds" >&2
  exit 2
fi
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  || echo "nvidia-smi: not available"
cat /proc/driver/nvidia-fs/version 2>/dev/null || echo "nvidia-fs: not loaded (cuFile compatibility mode at best)"
ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libcufile\.so' || echo "ldconfig: no libcuda/libcufile listed"
df -hT "$DIR" | tail -1
echo "== kvtier version"
"$BIN" version
echo "== kvtier bench --gds (1 of 2)"
"$BIN" bench --gds --path "$DIR" --bytes "$BYTES"
echo "== kvtier bench --gds (2 of 2, more in flight)"
"$BIN" bench --gds --path "$DIR" --bytes "$BYTES" --max-bytes-in-flight 256MiB
echo "device-check: all bytes verified"
