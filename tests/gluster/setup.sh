#!/usr/bin/env bash
# Starts a GlusterFS volume for the fs tier's shared-file-system tests (tests/fs_shared.rs):
# glusterd on this host, a two-brick replicated volume (bricks on this host, created with
# `force`), mounted twice with the FUSE client, so that two processes reach one folder
# through two mounts as two hosts would. Idempotent: what already runs is reused; what a
# killed earlier run left behind (a mount whose client died, a volume whose bricks are gone)
# is repaired.
#
#   tests/gluster/setup.sh            # installs the packages if needed (apt), then mounts
#   KVTIER_GLUSTER_NO_INSTALL=1 ...   # do not install; fail if glusterd is missing
#
# Disk: the bricks live on a small tmpfs (KVTIER_GLUSTER_BRICK_MB, default 96 MiB of memory,
# used only as files are written; no disk at all) where tmpfs keeps user extended attributes
# (Linux >= 6.6), else (or with KVTIER_GLUSTER_BRICK_MB=0, e.g. for a benchmark volume) in a
# directory on disk when at least KVTIER_GLUSTER_MIN_FREE_MB (default 256) MiB are free there. The packages (~50 MB installed) are installed only with
# as much free under /usr and /var; downloaded packages are removed. Logs at ERROR only.
#
# Exit 0: both mounts work (prints `KVTIER_GLUSTER_MOUNTS=A:B`). Exit 2: GlusterFS cannot run
# here (not root, no FUSE, no packages, too little space, glusterd or the mount failed); the
# reason is printed and the GlusterFS tests skip. Undo with tests/gluster/teardown.sh.
set -uo pipefail

VOLUME="${KVTIER_GLUSTER_VOLUME:-kvtier-fs-test}"
BRICKS="${KVTIER_GLUSTER_BRICKS:-/var/tmp/kvtier-gluster}"
MOUNT_A="${KVTIER_GLUSTER_MOUNT_A:-/mnt/kvtier-gl-a}"
MOUNT_B="${KVTIER_GLUSTER_MOUNT_B:-/mnt/kvtier-gl-b}"
BRICK_MB="${KVTIER_GLUSTER_BRICK_MB:-96}"
MIN_FREE_MB="${KVTIER_GLUSTER_MIN_FREE_MB:-256}"
PIDFILE=/run/kvtier-glusterd.pid
LOG=/var/log/kvtier-glusterd.log

unavailable() {
    echo "gluster setup: GlusterFS unavailable here: $*" >&2
    exit 2
}
note() { echo "gluster setup: $*" >&2; }

# MiB available to unprivileged writers on the file system holding $1 (its nearest existing
# ancestor).
free_mb() {
    local p="$1"
    while [ ! -e "$p" ]; do p="$(dirname "$p")"; done
    df -Pm "$p" 2>/dev/null | awk 'NR == 2 {print $4}'
}

is_mounted() { # is_mounted PATH [FSTYPE]
    awk -v m="$1" -v t="${2:-}" '$2 == m && (t == "" || $3 == t) {f = 1} END {exit !f}' /proc/mounts
}

[ "$(id -u)" = 0 ] || unavailable "needs root (glusterd and FUSE mounts)"
[ -c /dev/fuse ] || unavailable "/dev/fuse is missing (no FUSE in this sandbox)"
grep -qw fuse /proc/filesystems || unavailable "the kernel has no fuse filesystem"

if ! command -v glusterd >/dev/null || ! command -v mount.glusterfs >/dev/null; then
    [ -z "${KVTIER_GLUSTER_NO_INSTALL:-}" ] || unavailable "glusterd or mount.glusterfs is not installed"
    command -v apt-get >/dev/null || unavailable "no glusterd and no apt-get to install it"
    for d in /usr /var/cache/apt; do
        f="$(free_mb "$d")"
        [ "${f:-0}" -ge "$MIN_FREE_MB" ] \
            || unavailable "only ${f:-0} MiB free for $d; installing GlusterFS (~50 MB) needs $MIN_FREE_MB"
    done
    note "installing glusterfs-server glusterfs-client"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends glusterfs-server glusterfs-client attr) >/dev/null 2>&1 \
        || unavailable "apt-get install glusterfs-server glusterfs-client failed"
    apt-get clean >/dev/null 2>&1
fi

# glusterd: reuse a running one, else start ours (it daemonizes). One that is just exiting (a
# teardown) is waited for, then replaced.
deadline=$((SECONDS + 60))
until timeout 5 gluster --mode=script pool list >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || unavailable "glusterd does not answer (see $LOG)"
    if ! pgrep -x glusterd >/dev/null; then
        glusterd -p "$PIDFILE" --log-file="$LOG" --log-level=ERROR \
            || unavailable "glusterd did not start (see $LOG)"
    fi
    sleep 0.2
done

# The bricks' host must resolve to one of this host's addresses (gluster refuses localhost).
HOST="$(hostname)"
if ! getent hosts "$HOST" >/dev/null; then
    HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
    [ -n "$HOST" ] || unavailable "this host has no resolvable name or address for its bricks"
fi

# A volume whose bricks do not run (a reboot emptied their tmpfs, a teardown removed them) is
# test data: drop it and make a new one.
bricks_online() {
    [ -d "$BRICKS/brick1" ] && [ -d "$BRICKS/brick2" ] || return 1
    [ "$(timeout 30 gluster --mode=script volume status "$VOLUME" 2>/dev/null \
        | awk '$1 == "Brick" && $(NF - 1) == "Y"' | wc -l)" = 2 ]
}
if timeout 30 gluster --mode=script volume info "$VOLUME" >/dev/null 2>&1; then
    if ! bricks_online; then
        timeout 60 gluster --mode=script volume start "$VOLUME" force >/dev/null 2>&1
        if ! bricks_online; then
            note "volume $VOLUME has bricks that do not run; making it again"
            for m in "$MOUNT_A" "$MOUNT_B"; do
                is_mounted "$m" && { umount "$m" 2>/dev/null || umount -l "$m"; }
            done
            timeout 60 gluster --mode=script volume stop "$VOLUME" force >/dev/null 2>&1
            timeout 60 gluster --mode=script volume delete "$VOLUME" >/dev/null 2>&1 \
                || unavailable "cannot delete the broken volume $VOLUME"
        fi
    fi
fi

if ! timeout 30 gluster --mode=script volume info "$VOLUME" >/dev/null 2>&1; then
    # Bricks on a small tmpfs when it keeps user xattrs (the fs tier's CRC records pass
    # through to the bricks); else on disk, when there is room.
    mkdir -p "$BRICKS" || unavailable "cannot create $BRICKS"
    if [ "$BRICK_MB" != 0 ] && ! is_mounted "$BRICKS" tmpfs; then
        mount -t tmpfs -o "size=${BRICK_MB}m,mode=0755" kvtier-gluster-bricks "$BRICKS" 2>/dev/null
    fi
    if is_mounted "$BRICKS" tmpfs; then
        probe="$BRICKS/.xattr-probe"
        if ! { : > "$probe" && setfattr -n user.kvtier.probe -v 1 "$probe"; } 2>/dev/null; then
            rm -f "$probe"
            umount "$BRICKS"
            note "tmpfs here keeps no user xattrs (Linux < 6.6); bricks go on disk under $BRICKS"
        fi
        rm -f "$probe"
    fi
    if ! is_mounted "$BRICKS" tmpfs; then
        f="$(free_mb "$BRICKS")"
        [ "${f:-0}" -ge "$MIN_FREE_MB" ] \
            || unavailable "only ${f:-0} MiB free for the bricks under $BRICKS (needs $MIN_FREE_MB)"
    fi
    # Fresh brick folders: gluster refuses one that belonged to a deleted volume.
    rm -rf "$BRICKS/brick1" "$BRICKS/brick2"
    mkdir -p "$BRICKS/brick1" "$BRICKS/brick2"
    timeout 60 gluster --mode=script volume create "$VOLUME" replica 2 \
        "$HOST:$BRICKS/brick1" "$HOST:$BRICKS/brick2" force >/dev/null \
        || unavailable "gluster volume create failed"
    for opt in diagnostics.brick-log-level diagnostics.client-log-level; do
        timeout 30 gluster --mode=script volume set "$VOLUME" "$opt" ERROR >/dev/null 2>&1
    done
fi
if ! timeout 30 gluster --mode=script volume info "$VOLUME" | grep -q '^Status: Started'; then
    timeout 60 gluster --mode=script volume start "$VOLUME" >/dev/null \
        || unavailable "gluster volume start failed"
fi

for m in "$MOUNT_A" "$MOUNT_B"; do
    # A mount whose client process died answers ENOTCONN: unmount it and mount again.
    if is_mounted "$m" && ! timeout 10 stat -f "$m" >/dev/null 2>&1; then
        note "$m does not answer (its client died); mounting it again"
        umount "$m" 2>/dev/null || umount -l "$m"
    fi
    mkdir -p "$m" || unavailable "cannot create the mount point $m"
    if ! is_mounted "$m" fuse.glusterfs; then
        timeout 60 mount -t glusterfs -o log-level=ERROR "$HOST:/$VOLUME" "$m" \
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
