#!/usr/bin/env bash
# Builds the Debian root the systemd tests boot with systemd-nspawn (tests/node.rs
# `systemd_unit`): systemd as PID 1, python3 for the Proxmox test doubles, util-linux for
# their loop devices, procps for the unit's /bin/kill, libguestfs (guestfish, supermin, QEMU)
# for guest network recovery in its confined unit (the appliance's kernel and modules are the
# machine's own, bound in by the test). Kept at $1 between runs; built once (about 3½ minutes)
# into a temporary directory and moved into place, so a cut build is never used.
set -euo pipefail
root=$1
[ -x "$root/usr/lib/systemd/systemd" ] && [ -x "$root/usr/bin/guestfish" ] && exit 0
rm -rf "$root.partial"
mkdir -p "$(dirname "$root")"
mmdebstrap --variant=minbase --include=systemd,systemd-sysv,dbus,python3,util-linux,procps,libguestfs-tools,qemu-system-x86 \
  bookworm "$root.partial" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
rm -rf "$root"
mv "$root.partial" "$root"
