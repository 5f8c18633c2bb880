#!/usr/bin/env bash
# Starts a GlusterFS volume for the fs tier's shared-file-system tests (tests/fs_shared.rs):
# glusterd on this host, a two-brick replicated volume (bricks on this host, created with
# `force`), mounted twice with the FUSE client, so that two processes reach one folder
# through two mounts as two hosts would. Idempotent: what already runs is reused.
#
#   tests/gluster/setup.sh            # installs the packages if needed (apt), then mounts
#   KVTIER_GLUSTER_NO_INSTALL=1 ...   # do not install; fail if glusterd is missing
#
# Exit 0: both mounts work (prints `KVTIER_GLUSTER_MOUNTS=A:B`). Exit 2: GlusterFS cannot run
# here (not root, no FUSE, no packages, glusterd or the mount failed); the reason is printed
# and the GlusterFS tests skip. Undo with tests/gluster/teardown.sh.
set -uo pipefail

VOLUME="${KVTIER_GLUSTER_VOLUME:-kvtier-fs-test}"
BRICKS="${KVTIER_GLUSTER_BRICKS:-/var/tmp/kvtier-gluster}"
MOUNT_A="${KVTIER_GLUSTER_MOUNT_A:-/mnt/kvtier-gl-a}"
MOUNT_B="${KVTIER_GLUSTER_MOUNT_B:-/mnt/kvtier-gl-b}"
PIDFILE=/run/kvtier-glusterd.pid
LOG=/var/log/kvtier-glusterd.log

unavailable() {
    echo "gluster setup: GlusterFS unavailable here: $*" >&2
    exit 2
}

[ "$(id -u)" = 0 ] || unavailable "needs root (glusterd and FUSE mounts)"
[ -c /dev/fuse ] || unavailable "/dev/fuse is missing (no FUSE in this sandbox)"
grep -qw fuse /proc/filesystems || unavailable "the kernel has no fuse filesystem"

if ! command -v glusterd >/dev/null || ! command -v mount.glusterfs >/dev/null; then
    [ -z "${KVTIER_GLUSTER_NO_INSTALL:-}" ] || unavailable "glusterd or mount.glusterfs is not installed"
    command -v apt-get >/dev/null || unavailable "no glusterd and no apt-get to install it"
    echo "gluster setup: installing glusterfs-server glusterfs-client" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        glusterfs-server glusterfs-client) >/dev/null 2>&1 \
        || unavailable "apt-get install glusterfs-server glusterfs-client failed"
fi

# glusterd: reuse a running one, else start ours (it daemonizes).
if ! pgrep -x glusterd >/dev/null; then
    glusterd -p "$PIDFILE" --log-file="$LOG" || unavailable "glusterd did not start (see $LOG)"
fi
for _ in $(seq 50); do
    timeout 10 gluster --mode=script pool list >/dev/null 2>&1 && break
    sleep 0.2
done
timeout 10 gluster --mode=script pool list >/dev/null 2>&1 || unavailable "glusterd does not answer (see $LOG)"

# The bricks' host must resolve to one of this host's addresses (gluster refuses localhost).
HOST="$(hostname)"
if ! getent hosts "$HOST" >/dev/null; then
    HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
    [ -n "$HOST" ] || unavailable "this host has no resolvable name or address for its bricks"
fi

if ! timeout 30 gluster --mode=script volume info "$VOLUME" >/dev/null 2>&1; then
    mkdir -p "$BRICKS/brick1" "$BRICKS/brick2"
    timeout 60 gluster --mode=script volume create "$VOLUME" replica 2 \
        "$HOST:$BRICKS/brick1" "$HOST:$BRICKS/brick2" force >/dev/null \
        || unavailable "gluster volume create failed"
fi
if ! timeout 30 gluster --mode=script volume info "$VOLUME" | grep -q '^Status: Started'; then
    timeout 60 gluster --mode=script volume start "$VOLUME" >/dev/null \
        || unavailable "gluster volume start failed"
fi

for m in "$MOUNT_A" "$MOUNT_B"; do
    mkdir -p "$m"
    if ! awk -v m="$m" '$2 == m && $3 == "fuse.glusterfs" {found=1} END {exit !found}' /proc/mounts; then
        timeout 60 mount -t glusterfs "$HOST:/$VOLUME" "$m" \
            || unavailable "mount -t glusterfs $HOST:/$VOLUME $m failed"
    fi
done

# Both mounts see one volume: a file written through A reads back through B.
probe="kvtier-setup-probe-$$"
echo "$probe" > "$MOUNT_A/$probe" || unavailable "cannot write to $MOUNT_A"
got=""
for _ in $(seq 50); do
    got="$(cat "$MOUNT_B/$probe" 2>/dev/null)"
    [ "$got" = "$probe" ] && break
    sleep 0.1
done
rm -f "$MOUNT_A/$probe"
[ "$got" = "$probe" ] || unavailable "a file written through $MOUNT_A did not appear through $MOUNT_B"

echo "KVTIER_GLUSTER_MOUNTS=$MOUNT_A:$MOUNT_B"
