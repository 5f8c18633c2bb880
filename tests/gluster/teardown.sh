#!/usr/bin/env bash
# Undoes tests/gluster/setup.sh: unmounts both mounts, stops and deletes the test volume,
# stops the glusterd that setup.sh started (if it did) and removes the bricks. Do not run it
# while tests use the volume (CI never does: other runs on the machine may share it).
set -uo pipefail

VOLUME="${KVTIER_GLUSTER_VOLUME:-kvtier-fs-test}"
BRICKS="${KVTIER_GLUSTER_BRICKS:-/var/tmp/kvtier-gluster}"
MOUNT_A="${KVTIER_GLUSTER_MOUNT_A:-/mnt/kvtier-gl-a}"
MOUNT_B="${KVTIER_GLUSTER_MOUNT_B:-/mnt/kvtier-gl-b}"
PIDFILE=/run/kvtier-glusterd.pid

for m in "$MOUNT_A" "$MOUNT_B"; do
    if awk -v m="$m" '$2 == m {found=1} END {exit !found}' /proc/mounts; then
        umount "$m" || umount -l "$m"
    fi
done
if command -v gluster >/dev/null && timeout 30 gluster --mode=script volume info "$VOLUME" >/dev/null 2>&1; then
    timeout 60 gluster --mode=script volume stop "$VOLUME" force >/dev/null 2>&1
    timeout 60 gluster --mode=script volume delete "$VOLUME" >/dev/null 2>&1
fi
if [ -f "$PIDFILE" ]; then
    kill "$(cat "$PIDFILE")" 2>/dev/null
    rm -f "$PIDFILE"
fi
rm -rf "$BRICKS"
echo "gluster teardown: done"
