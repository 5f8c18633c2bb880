#!/usr/bin/env bash
# Undoes tests/gluster/setup.sh: unmounts both mounts, stops and deletes the test volume,
# stops the glusterd that setup.sh started (if it did), removes the bricks and unmounts their
# tmpfs. Do not run it while tests use the volume (CI never does: other runs on the machine
# may share it).
set -uo pipefail

VOLUME="${KVTIER_GLUSTER_VOLUME:-kvtier-fs-test}"
BRICKS="${KVTIER_GLUSTER_BRICKS:-/var/tmp/kvtier-gluster}"
MOUNT_A="${KVTIER_GLUSTER_MOUNT_A:-/mnt/kvtier-gl-a}"
MOUNT_B="${KVTIER_GLUSTER_MOUNT_B:-/mnt/kvtier-gl-b}"
PIDFILE=/run/kvtier-glusterd.pid

is_mounted() { awk -v m="$1" '$2 == m {f = 1} END {exit !f}' /proc/mounts; }

for m in "$MOUNT_A" "$MOUNT_B"; do
    if is_mounted "$m"; then
        umount "$m" 2>/dev/null || umount -l "$m"
    fi
done
if command -v gluster >/dev/null && timeout 30 gluster --mode=script volume info "$VOLUME" >/dev/null 2>&1; then
    timeout 60 gluster --mode=script volume stop "$VOLUME" force >/dev/null 2>&1
    timeout 60 gluster --mode=script volume delete "$VOLUME" >/dev/null 2>&1
fi
if [ -f "$PIDFILE" ]; then
    pid="$(cat "$PIDFILE")"
    kill "$pid" 2>/dev/null
    # Wait for it to exit, so that a setup.sh right after starts a new one.
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    rm -f "$PIDFILE"
fi
rm -rf "$BRICKS/brick1" "$BRICKS/brick2"
if is_mounted "$BRICKS"; then
    umount "$BRICKS" 2>/dev/null || umount -l "$BRICKS"
fi
rmdir "$BRICKS" 2>/dev/null
echo "gluster teardown: done"
