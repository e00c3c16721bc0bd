#!/usr/bin/env bash
# The lab: a simulated Proxmox VE node on this machine and real backup validations on it.
#
#   bash tests/lab/run.sh          (as root; or: sudo bash tests/lab/run.sh)
#
# Installs what is missing (Debian packages, one apt-get install), builds the two binaries and
# the guest disks (cached in target/lab-assets), then, in a network namespace of its own that
# holds the node's sandbox VNet bridge (no uplink, forwarding off): makes a fresh CA, keys,
# certificates and plan, enrolls and starts `certistack-connector` with the Proxmox test doubles
# (tests/doubles: PBS's map on real read-only loop devices, qm starting real QEMU, under KVM
# only where the lab's guest boots under it, else TCG),
# runs `certistack-ctl run` on the lab plan, verifies every signed report and tears everything
# down, checking that nothing is left: namespace, loop devices, processes, nft tables.
# The reports, their public key, the plan and the logs stay in target/lab/last/.
#
# The plan has four validations; three run at once, each on a sandbox VNet of its own:
#   lab-web-100         a guest that takes the address the lab gives it (network_recovery
#                       preserve); it must pass.
#   lab-prod-preserve   a Debian guest (ext4 root, ifupdown) whose own configuration puts its
#                       NIC on a production subnet with a gateway (192.168.77.10/24 via
#                       192.168.77.1), restored as it is: the guest boots and answers its agent,
#                       and every wire probe to the probe network must fail, unreachable.
#   lab-prod-rewrite    another backup of that guest (the same disk) with network_recovery
#                       rewrite and a guest address on its probe network: the node writes a
#                       sandbox profile into the overlay before boot (libguestfs); it must pass,
#                       and its report must show the recovery's evidence.
#   lab-stale           VM 102, whose only backup is two months old (max_age_hours 24): it
#                       must fail before any node is asked, saying how old the backup is.
# The backups' image files must hash the same after the run as before.
#
# Exit code: 0 when every validation ended as above, 1 when one did not, 2 when
# `certistack-ctl run` ended in error, unless the lab itself failed (70), or residue was found
# (71), or this is not run as root (77).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$(id -u)" != 0 ]; then
  echo "lab: needs root (loop devices, a network namespace, tap devices for QEMU); run it as root: sudo bash $0" >&2
  exit 77
fi
# Under sudo, build as the user who asked (their cargo, their target/ ownership); as root, as root.
as_builder() {
  if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
    sudo -u "$SUDO_USER" -H env "PATH=$(sudo -u "$SUDO_USER" -H bash -lc 'echo $PATH')" "$@"
  else
    "$@"
  fi
}
as_builder bash -c 'command -v cargo' >/dev/null 2>&1 || {
  echo "lab: cargo is missing; install Rust (https://rustup.rs) for ${SUDO_USER:-root} first" >&2
  exit 70
}

started=$(date +%s%N)
mark=$started
declare -a phases=()
phase_end() {
  local now
  now=$(date +%s%N)
  phases+=("$1 $(((now - mark) / 1000000))")
  mark=$now
}
say() { printf '\n== %s\n' "$*"; }

# ---- packages: one apt-get install, only when something is missing --------------------------
# The same script prepares a machine for the test suite and for CI.
say "tools"
bash "$root/tests/prepare-machine.sh" || { echo "lab: preparing this machine failed (tests/prepare-machine.sh)" >&2; exit 70; }

# ---- build ----------------------------------------------------------------------------------
say "build"
as_builder cargo build --quiet --locked --manifest-path "$root/Cargo.toml" --bin certistack-connector --bin certistack-ctl
bash "$root/tests/lab/build-assets.sh" "$root/target/lab-assets"
bin=$root/target/debug
assets=$root/target/lab-assets/current
# shellcheck disable=SC1091
. "$assets/layout"
phase_end build

# ---- set-up ---------------------------------------------------------------------------------
say "set-up"
mkdir -p "$root/target/lab"
# A lab run killed before its teardown (kill -9, a power cut of the terminal) leaves its
# namespace, connector, QEMU and loop devices; its work directory says what they are.
leftovers=()
for old in "$root"/target/lab/run.*; do
  [ -f "$old/lab.env" ] || continue
  owner=$(sed -n 's/^owner=//p' "$old/lab.env")
  if [ -n "$owner" ] && [ "$(cat "/proc/${owner%% *}/stat" 2>/dev/null | awk '{print $22}')" = "${owner#* }" ]; then
    echo "another lab run (pid ${owner%% *}) is using $old; leaving it alone"
    continue
  fi
  leftovers+=("$old")
done
work=$(mktemp -d "$root/target/lab/run.XXXXXX")
keep=$root/target/lab/last
ns=cslab$(head -c 3 /dev/urandom | od -An -tx1 | tr -d ' \n')
# The connector's own binary starts every confined appliance (`appliance-exec`, which seals the
# loop ioctls off before it runs guestfish), by the path it runs from. The unit hides /home,
# /root, /tmp and /var/tmp, where a checkout may well be, so the lab runs the connector from a
# copy under /var/lib, which the node's systemd sees at the same path (as a node's sees the
# package's /usr/bin).
launcher_dir() { printf '/var/lib/certistack-lab/%s' "${ns:?}"; }
node=$work/node
ctl=$work/ctl
daemon=""
# The node's systemd: a Debian root booted with systemd-nspawn beside the connector, where the
# appliance of guest network recovery runs in its confined unit (these machines' PID 1 is not
# systemd); its nspawn process.
container=""
port=7443
# The backups' times, relative to today as a nightly PBS job's are: last night's (what latest
# finds), the night before (named by its time), and one two months old (too old).
snapshot_time=$(date -u -d 'yesterday' +%Y-%m-%dT02:00:00Z)
prod_snapshot_before=$(date -u -d '2 days ago' +%Y-%m-%dT02:00:00Z)
stale_snapshot=$(date -u -d '60 days ago' +%Y-%m-%dT02:00:00Z)
marker=lab-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')
guest=10.77.1.10
# The production guest: restored as it is, and with network recovery. The three validations
# run at once, each on a sandbox VNet (and probe network) of its own.
preserve_vmid=9102
vnets="csv1 csv2 csv3"
preserve_guest=10.77.2.10
rewrite_guest=10.77.3.10
prod_marker=prod-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')
prod_address=192.168.77.10/24
prod_gateway=192.168.77.1
exec 3>&1
printf 'ns=%s\nowner=%s %s\n' "$ns" "$$" "$(awk '{print $22}' /proc/$$/stat)" >"$work/lab.env"

# Stops whatever is still running, detaches what is still attached and removes the namespace.
# Safe to run twice and after any failure; it only touches what this lab made (all of it lives
# below $work or in namespace $ns).
teardown() {
  set +e
  if [ -n "$daemon" ] && grep -qF -- "$node/connector.toml" "/proc/$daemon/cmdline" 2>/dev/null; then
    kill -TERM "$daemon"
    # A drained shutdown takes well under a second; a connector that hangs is killed.
    for _ in $(seq 1 50); do
      kill -0 "$daemon" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$daemon" 2>/dev/null
    wait "$daemon" 2>/dev/null
  fi
  daemon=""
  for conf in "$node"/etc/pve/qemu-server/*.conf; do
    [ -e "$conf" ] || continue
    ip netns exec "$ns" "$node/bin/qm" stop "$(basename "$conf" .conf)" >/dev/null 2>&1
    ip netns exec "$ns" "$node/bin/qm" destroy "$(basename "$conf" .conf)" >/dev/null 2>&1
  done
  for device in $(losetup -n -O NAME,BACK-FILE -l 2>/dev/null | awk -v w="$work/" 'index($2, w) == 1 {print $1}'); do
    "$node/bin/proxmox-backup-client" unmap "$device" >/dev/null 2>&1
    losetup -d "$device" 2>/dev/null
  done
  ip netns del "$ns" 2>/dev/null
  if [ -n "$container" ] && grep -qF -- "$work" "/proc/$container/cmdline" 2>/dev/null; then
    kill -TERM "$container"
    for _ in $(seq 1 100); do
      kill -0 "$container" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$container" 2>/dev/null
    wait "$container" 2>/dev/null
  fi
  container=""
  rm -rf "$(launcher_dir)"
  rmdir /var/lib/certistack-lab 2>/dev/null
  # Anything of this lab still running: the controller of a lab killed mid-run (its working
  # directory is in $work), a holder or QEMU the steps above could not stop.
  local pids
  pids=$(lab_pids)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  for _ in $(seq 1 20); do
    [ -z "$(lab_pids)" ] && break
    sleep 0.1
  done
  set -e
}

# Processes of this lab: programs the lab starts (the connector, the controller, the doubles'
# Python, QEMU) whose command line names $work or that run in it. An operator's shell, pager or
# editor looking at the work directory is not the lab's and is never killed.
lab_program() {
  # A binary rebuilt since it started reads as "<path> (deleted)".
  case "$(readlink "/proc/$1/exe" 2>/dev/null)" in
    "$bin"/certistack-connector | "$bin/certistack-connector (deleted)" | "$bin"/certistack-ctl | \
      "$(launcher_dir)"/certistack-connector | "$(launcher_dir)/certistack-connector (deleted)" | \
      "$bin/certistack-ctl (deleted)" | */python3* | */qemu-system-*) return 0 ;;
  esac
  return 1
}
lab_pids() {
  local pid found="" pattern
  # pgrep takes a regular expression: the path is matched literally.
  pattern=$(printf '%s/' "$work" | sed 's/[][\.*^$+?(){}|]/\\&/g')
  for pid in $(pgrep -f -- "$pattern" || true); do
    [ "$pid" != $$ ] && lab_program "$pid" && found+="$pid "
  done
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    case "$(readlink "/proc/$pid/cwd" 2>/dev/null)/" in
      "$work"/*) [ "$pid" != $$ ] && lab_program "$pid" && case " $found" in *" $pid "*) ;; *) found+="$pid " ;; esac ;;
    esac
  done
  printf '%s' "$found"
}

# What the lab left on the machine: must be nothing.
residue() {
  local found=""
  ip netns list | grep -qw "$ns" && found+=" namespace $ns;"
  local loops
  loops=$(losetup -n -O NAME,BACK-FILE -l 2>/dev/null | awk -v w="$work/" 'index($2, w) == 1 {print $1}')
  [ -n "$loops" ] && found+=" loop devices $(echo "$loops" | tr '\n' ' ');"
  local pids
  pids=$(lab_pids)
  [ -n "$pids" ] && found+=" processes $pids;"
  [ -e "/run/netns/$ns" ] && found+=" /run/netns/$ns;"
  [ -e "$(launcher_dir)" ] && found+=" $(launcher_dir);"
  local nspawn
  nspawn=$(pgrep -f -- "systemd-nspawn .*--bind=$work" 2>/dev/null | tr '\n' ' ' || true)
  [ -n "$nspawn" ] && found+=" the node's systemd container (systemd-nspawn $nspawn);"
  printf '%s' "$found"
}

# What the run left on the node before the lab removes anything by force: the connector's
# cleanup must have taken all of it away.
node_residue() {
  local found=""
  local tables
  tables=$(in_ns nft list tables 2>/dev/null | grep certistack_ | tr '\n' ' ' || true)
  [ -n "$tables" ] && found+=" nft tables $tables;"
  local addresses
  local vnet
  for vnet in $vnets; do
    addresses=$(in_ns ip -o -4 address show dev "$vnet" 2>/dev/null | awk '{print $4}' | tr '\n' ' ')
    [ -n "$addresses" ] && found+=" addresses on $vnet $addresses;"
  done
  local configs
  configs=$(ls "$node"/etc/pve/qemu-server/ 2>/dev/null | tr '\n' ' ')
  [ -n "$configs" ] && found+=" VM configs $configs;"
  local loops
  loops=$(losetup -n -O NAME,BACK-FILE -l 2>/dev/null | awk -v w="$work/" 'index($2, w) == 1 {print $1}' | tr '\n' ' ')
  [ -n "$loops" ] && found+=" loop devices $loops;"
  local pids
  pids=$(pgrep -f -- "$node/" | grep -vx "$daemon" | tr '\n' ' ' || true)
  [ -n "$pids" ] && found+=" processes $pids;"
  local units
  units=$(in_node_systemd systemctl list-units --all --plain --no-legend 'certistack-*' 2>/dev/null | awk '{print $1}' | tr '\n' ' ')
  [ -n "$units" ] && found+=" units of the node's systemd $units;"
  printf '%s' "$found"
}

# Keeps what explains a run (report, key, plan, logs) in target/lab/last, on every path.
keep_evidence() {
  rm -rf "$keep"
  mkdir -p "$keep"
  cp "$ctl/reports"/* "$ctl/state/report-signing.pub" "$ctl/lab.yaml" "$work/connector.log" \
    "$work/node-systemd.log" "$work/pbs-api.log" "$work/pve-api.log" "$work/plan-show.txt" \
    "$work/history.json" "$work/history-alarm.txt" "$work/webhook-requests.log" \
    "$work/smtp-messages.log" "$work/certistack.prom" "$work/webhook-signature.txt" "$keep/" 2>/dev/null || true
  cp "$node/calls.log" "$keep/doubles-calls.log" 2>/dev/null || true
}

# On any way out before the end (a failed step of the lab, an interrupt): keep the evidence,
# tear down, and say what, if anything, is left.
on_exit() {
  local code=$?
  if [ -n "${ns:-}" ]; then
    keep_evidence
    teardown
    local left
    left=$(residue)
    rm -rf "$work"
    if [ -n "$left" ]; then
      echo "lab: RESIDUE on this machine:$left" >&2
      code=71
    fi
    echo "lab: stopped early (exit $code); logs and any report in $keep" >&2
  fi
  exit "$code"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
trap 'echo "lab: failed at line $LINENO: $BASH_COMMAND" >&2; exit 70' ERR

# Leftovers of earlier lab runs go first, with the same teardown and the same residue check.
for old in "${leftovers[@]}"; do
  saved="$ns $work $node"
  ns=$(sed -n 's/^ns=//p' "$old/lab.env")
  daemon=$(sed -n 's/^daemon=//p' "$old/lab.env")
  container=$(sed -n 's/^container=//p' "$old/lab.env")
  work=$old
  node=$old/node
  teardown
  left=$(residue)
  if [ -n "$left" ]; then
    echo "lab: an earlier lab run left$left and it cannot be removed; remove it by hand, then re-run" >&2
    read -r ns work node <<<"$saved"
    exit 71
  fi
  rm -rf "$old"
  echo "removed what an earlier lab run killed before its teardown left: namespace $ns and everything in $old"
  read -r ns work node <<<"$saved"
done
daemon=""
container=""

ip netns add "$ns"
in_ns() { ip netns exec "$ns" "$@"; }
in_ns ip link set lo up
# The sandbox VNet as a Simple zone makes it: a bridge without ports, no address, no forwarding.
in_ns sysctl -qw net.ipv4.ip_forward=0
for vnet in $vnets; do
  in_ns ip link add "$vnet" type bridge
  in_ns sysctl -qw "net.ipv4.conf.$vnet.forwarding=0"
  in_ns ip link set "$vnet" up
done
echo "node namespace $ns, VNets $vnets (no uplink, forwarding off), work directory $work"

# The node: the doubles of proxmox-backup-client and qm, and one "PBS snapshot" whose disk
# is a lab guest disk carrying this run's marker.
mkdir -p "$node/bin" "$node/pbs/store1/vm/100/$snapshot_time" "$ctl"
install -m 0755 "$root/tests/doubles/proxmox-backup-client" "$root/tests/doubles/qm" "$node/bin/"
pbs_password=$(head -c 18 /dev/urandom | base64)
# The PBS and PVE APIs, as the controller asks them (tests/doubles/pbs-api, pve-api), serve
# HTTPS with certificates of a CA of the lab's own: the controller verifies the PVE API by that
# CA and pins the PBS API's certificate, as an operator's configuration does.
tls=$work/tls
mkdir -p "$tls/pbs" "$tls/pve" "$tls/webhook" "$tls/smtp"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$tls/ca.key" -out "$tls/ca.pem" -subj "/CN=CertiStack lab CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" 2>/dev/null
printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >"$tls/leaf.ext"
for api in pbs pve webhook smtp; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=localhost" \
    -keyout "$tls/$api/key.pem" -out "$tls/$api.csr" 2>/dev/null
  openssl x509 -req -days 2 -in "$tls/$api.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" \
    -CAcreateserial -extfile "$tls/leaf.ext" -out "$tls/$api/cert.pem" 2>/dev/null
done
fingerprint=$(openssl x509 -noout -fingerprint -sha256 -in "$tls/pbs/cert.pem" | cut -d= -f2)
# The qm double runs guests under KVM only where the lab's own guest (SeaBIOS, SYSLINUX, the lab
# kernel reaching its init) boots under it within 30 s, else TCG; the verdict is kept for this
# boot, QEMU binary and guest disk beside the guest assets. CERTISTACK_LAB_ACCEL=kvm|tcg decides
# instead. The connector's libguestfs appliance follows the same verdict.
lab_accel=${CERTISTACK_LAB_ACCEL:-auto}
case "$lab_accel" in
  auto | kvm | tcg) ;;
  *) echo "lab: CERTISTACK_LAB_ACCEL=$lab_accel: give kvm, tcg or leave it unset" >&2; exit 70 ;;
esac
printf '{"node": "pve1", "pbs_password": "%s", "pbs_fingerprint": "%s", "accel_cache": "%s", "accel_probe_disk": "%s", "accel": "%s", "udev_block_group": "disk"}\n' \
  "$pbs_password" "$fingerprint" "$root/target/lab-assets/qm-accel.json" "$assets/disk-probe.img" "$lab_accel" >"$node/double.json"
# With the PATH the connector gives the tools it runs: the same QEMU as the VMs' starts.
verdict=$(env PATH=/usr/sbin:/usr/bin:/sbin:/bin "$node/bin/qm" certistack-accel)
accel=$(printf '%s' "$verdict" | python3 -c 'import json, sys; print(json.load(sys.stdin)["accel"])')
accel_why=$(printf '%s' "$verdict" | python3 -c 'import json, sys; print(json.load(sys.stdin)["why"])')
if [ "$accel" = kvm ]; then appliance_accel=auto; else appliance_accel=tcg; fi
echo "accelerator: $accel ($accel_why); libguestfs appliance: $appliance_accel"

# The node's systemd, for guest network recovery's confined appliance unit (docs/systemd.md,
# "The appliance's confinement"): a Debian root with systemd and libguestfs (the systemd
# tests' own, built once into target/nspawn), booted beside the connector with this lab's
# work directory at the same path, the machine's kernel and modules for the appliance, and the
# package's sysusers.d file. The connector reaches it through process.systemd_run and
# process.systemctl, which enter it; QEMU, the doubles and everything else stay on this machine.
nspawn_root=$root/target/nspawn/systemd-root
bash "$root/tests/systemd/container-root.sh" "$nspawn_root" ||
  { echo "lab: the node's systemd root could not be made (see $nspawn_root.log)" >&2; exit 70; }
# The appliance supermin builds is kept between lab runs, as a node keeps it between recoveries.
mkdir -p "$root/target/nspawn/guestnet-cache"
mkdir -p "$(launcher_dir)"
install -m 0755 "$bin/certistack-connector" "$(launcher_dir)/certistack-connector"
nspawn_binds=(--bind="$work" --bind-ro="$(launcher_dir)" --bind-ro=/boot --bind-ro=/lib/modules:/usr/lib/modules
  --bind="$root/target/nspawn/guestnet-cache:/var/cache/certistack-appliance"
  --bind-ro="$root/packaging/certistack-connector.sysusers:/usr/lib/sysusers.d/certistack-connector.conf")
[ -e /dev/kvm ] && nspawn_binds+=(--bind=/dev/kvm)
systemd-nspawn -D "$nspawn_root" --volatile=overlay -b --register=no --keep-unit --console=passive \
  -M "$ns" "${nspawn_binds[@]}" </dev/null >"$work/node-systemd.log" 2>&1 &
container=$!
echo "container=$container" >>"$work/lab.env"
leader=""
for _ in $(seq 1 300); do
  for child in $(cat "/proc/$container/task/$container/children" 2>/dev/null); do
    [ "$(cat "/proc/$child/comm" 2>/dev/null)" = systemd ] && leader=$child
  done
  [ -n "$leader" ] && break
  sleep 0.1
done
[ -n "$leader" ] || { echo "lab: systemd-nspawn started no systemd (see $keep/node-systemd.log)" >&2; exit 70; }
in_node_systemd() { nsenter -t "$leader" -a -- "$@"; }
node_systemd=""
for _ in $(seq 1 300); do
  node_systemd=$(in_node_systemd systemctl is-system-running 2>/dev/null || true)
  case "$node_systemd" in running | degraded) break ;; esac
  sleep 0.1
done
case "$node_systemd" in
  running | degraded) ;;
  *) echo "lab: the node's systemd did not come up within 30 s ($node_systemd; see $keep/node-systemd.log)" >&2; exit 70 ;;
esac
# Its /dev is its own: the loop nodes, as udev leaves block devices (root:disk 0660); the
# appliance user, as the package's postinst makes it.
in_node_systemd sh -c 'for i in $(seq 0 511); do [ -e /dev/loop$i ] || mknod -m 0660 /dev/loop$i b 7 $i; chgrp disk /dev/loop$i; done'
in_node_systemd systemd-sysusers certistack-connector.conf
for tool in systemd-run systemctl; do
  printf '#!/bin/sh\n# The lab node'"'"'s systemd runs in a container: enter it.\nexec nsenter -t %s -a -- /usr/bin/%s "$@"\n' "$leader" "$tool" >"$node/bin/$tool"
  chmod 0755 "$node/bin/$tool"
done
appliance_uid=$(in_node_systemd getent passwd certistack-guestnet-1 | cut -d: -f3)
echo "the node's systemd: container $ns (pid $leader), appliance users certistack-guestnet-1 (uid $appliance_uid) to -4"
disk=$node/pbs/store1/vm/100/$snapshot_time/drive-scsi0.img
cp --sparse=always "$assets/disk-boot.img" "$disk"
printf 'certistack-lab-disk v1\nmarker=%s\naddress=%s/24\nagent=yes\n' "$marker" "$guest" |
  dd of="$disk" bs=512 seek=$((DATA_OFFSET / 512)) conv=notrunc status=none
# Every PVE VM backup carries the source VM's config; the sandbox mirrors its hardware.
cat >"$node/pbs/store1/vm/100/$snapshot_time/qemu-server.conf.blob" <<SOURCE
boot: order=scsi0;ide2;net0
cores: 1
ide2: none,media=cdrom
machine: q35
memory: 256
name: lab-web
net0: virtio=BC:24:11:0A:0B:0C,bridge=vmbr0,firewall=1
ostype: l26
scsi0: local-lvm:vm-100-disk-0,size=64M
scsihw: virtio-scsi-pci
SOURCE
body="certistack lab guest: marker $marker"
body_sha256=$(printf '%s\n' "$body" | sha256sum | cut -d' ' -f1)

# A second "PBS snapshot", of VM 101: the same boot partition, and as partition 2 the ext4 root
# filesystem of a Debian 12 guest with ifupdown (what libguestfs inspection recognises, and
# what the guest's /init boots: tests/lab/guest-init), whose own configuration puts its NIC on
# a production subnet with a gateway.
prod_disk=$node/pbs/store1/vm/101/$snapshot_time/drive-scsi0.img
# Its backup of the day before, the same disk: the node runs validations of one archive one
# after the other, and the two restores of this guest run at the same time.
prod_disk_before=$node/pbs/store1/vm/101/$prod_snapshot_before/drive-scsi0.img
mkdir -p "$(dirname "$prod_disk")" "$work/prod-root"
(
  cd "$work/prod-root"
  mkdir -p bin sbin usr/bin usr/sbin usr/lib var tmp root srv/certistack-lab \
    etc/network/interfaces.d etc/systemd/network
  # ifupdown's ifup, as the guest's disk carries it (busybox's, in this small guest).
  cp "$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v busybox)" bin/busybox
  ln -s ../bin/busybox sbin/ifup
  ln -s ../bin/busybox sbin/ifdown
  printf '/dev/sda2 / ext4 errors=remount-ro 0 1\n' >etc/fstab
  printf 'prod-web\n' >etc/hostname
  printf 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nVERSION="12 (bookworm)"\nVERSION_CODENAME=bookworm\nID=debian\n' >etc/os-release
  printf '12.8\n' >etc/debian_version
  # As Debian's installer writes it for a static address.
  printf 'source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\nallow-hotplug eth0\niface eth0 inet static\n    address %s\n    gateway %s\n' \
    "$prod_address" "$prod_gateway" >etc/network/interfaces
  printf 'certistack-lab-disk v1\nmarker=%s\nagent=yes\n' "$prod_marker" >srv/certistack-lab/disk
)
cp --sparse=always "$assets/disk-boot.img" "$prod_disk"
truncate -s "$DATA_SIZE" "$work/prod-root.ext4"
mkfs.ext4 -q -F -L prod-root -d "$work/prod-root" "$work/prod-root.ext4"
dd if="$work/prod-root.ext4" of="$prod_disk" bs=1M oflag=seek_bytes seek="$DATA_OFFSET" conv=notrunc,sparse status=none
rm -rf "$work/prod-root" "$work/prod-root.ext4"
mkdir -p "$(dirname "$prod_disk_before")"
cp --sparse=always "$prod_disk" "$prod_disk_before"
cat >"$node/pbs/store1/vm/101/$snapshot_time/qemu-server.conf.blob" <<SOURCE
boot: order=scsi0;ide2;net0
cores: 1
ide2: none,media=cdrom
machine: q35
memory: 256
name: prod-web
net0: virtio=BC:24:11:0A:0B:0D,bridge=vmbr0,firewall=1
ostype: l26
scsi0: local-lvm:vm-101-disk-0,size=64M
scsihw: virtio-scsi-pci
SOURCE
cp "$node/pbs/store1/vm/101/$snapshot_time/qemu-server.conf.blob" "$node/pbs/store1/vm/101/$prod_snapshot_before/"
prod_body="certistack lab guest: marker $prod_marker"
prod_body_sha256=$(printf '%s\n' "$prod_body" | sha256sum | cut -d' ' -f1)
# VM 102's only backup is two months old, far older than the nightly check allows: its
# validation fails before any node is asked, with a signed report saying how old it is.
mkdir -p "$node/pbs/store1/vm/102/$stale_snapshot"
cp --sparse=always "$disk" "$node/pbs/store1/vm/102/$stale_snapshot/drive-scsi0.img"
cp "$node/pbs/store1/vm/100/$snapshot_time/qemu-server.conf.blob" "$node/pbs/store1/vm/102/$stale_snapshot/"
# What the backups hold: no validation may change it.
backups_sha256=$(sha256sum "$disk" "$prod_disk" "$prod_disk_before")

# The packages a PVE 9 node has installed, as the node's prerequisite check (NodeChecks, which
# `certistack-ctl run` asks before it starts) reads them from dpkg's status file.
mkdir -p "$node/var/lib/dpkg"
printf 'Package: pve-manager\nStatus: install ok installed\nVersion: 9.0.6\n\nPackage: qemu-server\nStatus: install ok installed\nVersion: 9.0.18\n' \
  >"$node/var/lib/dpkg/status"

cat >"$node/connector.toml" <<CONF
node_name = "pve1"
listen = "127.0.0.1:$port"
[tls]
certificate = "$node/node.crt"
private_key = "$node/node.key"
controller_ca = "$node/ca.crt"
run_authority_public_key = "$node/run-authority.pub"
[paths]
state_dir = "$node/state"
overlay_root = "$node/overlays"
[tools]
proxmox_backup_client = "$node/bin/proxmox-backup-client"
qm = "$node/bin/qm"
[pve]
qemu_server_run_dir = "$node/var/run/qemu-server"
vm_config_dir = "$node/etc/pve/qemu-server"
pbs_loopdev_dir = "$node/run/pbs-loopdev"
pve_cluster_dir = "$node/var/lib/pve-cluster"
dpkg_status = "$node/var/lib/dpkg/status"
# The mount table of a PVE 9 node (cgroup v2): this machine's own may be hybrid.
mounts = "$root/tests/support/pve9/mounts"
# A bare-metal PVE 9 node with VT-x: what doctor judges of KVM is the simulated node's. Its KVM
# device is anything that opens read-write; the guests' accelerator is the qm double's verdict.
cpuinfo = "$root/tests/support/pve9/cpuinfo"
dmi_dir = "$root/tests/support/pve9/dmi"
kvm_device = "/dev/null"
# The node's accounts are its systemd's, which starts the appliance as its user.
passwd = "/proc/$leader/root/etc/passwd"
group = "/proc/$leader/root/etc/group"
[process]
systemd_run = "$node/bin/systemd-run"
systemctl = "$node/bin/systemctl"
[limits]
# The libguestfs appliance boots under TCG here, on a machine builds may share: one recovery
# measured 144 to 253 s at load averages of 8 to 13, and passed 300 s at 19.
guest_network_timeout_secs = 600
[guest_network]
# From the qm double's verdict: TCG where the lab's guest does not boot under this machine's KVM.
accelerator = "$appliance_accel"
# The appliance runs only in its confined unit, in the node's systemd.
confined = "always"
CONF

"$bin/certistack-ctl" ca init --state-dir "$ctl/state" >"$work/ca-init.txt"
fingerprint_ca=$(sed -n 's/^CA fingerprint: //p' "$work/ca-init.txt")
"$bin/certistack-connector" --config "$node/connector.toml" enroll --csr >"$work/node.csr"
"$bin/certistack-ctl" node sign --state-dir "$ctl/state" --node pve1 --csr "$work/node.csr" --out "$work/node-issued.crt" >/dev/null
"$bin/certistack-connector" --config "$node/connector.toml" enroll --install \
  --certificate "$work/node-issued.crt" --ca "$ctl/state/ca.crt" --ca-fingerprint "$fingerprint_ca" \
  --run-authority "$ctl/state/run-authority.pub" >/dev/null
echo "fresh CA, run-authority and report-signing keys in $ctl/state; node pve1 enrolled"

umask 077
printf '%s\n' "$pbs_password" >"$ctl/pbs-password"
umask 022
# The cluster as the PVE API shows it: VM 100 in pool web, VM 101 in pool prod, the node, the
# three VNets in a Simple zone with gateway-less subnets; a token that may audit all of it.
pve_secret=$(head -c 18 /dev/urandom | base64)
umask 077
printf '%s\n' "$pve_secret" >"$ctl/pve-token"
umask 022
python3 - "$ctl/pve-token" "$tls/pve/double.json" <<'PY'
import json, sys
token = "certistack@pve!ctl"
secret = open(sys.argv[1]).read().strip()
vnets = ["csv1", "csv2", "csv3"]
settings = {
    "tokens": {token: secret},
    "permissions": {token: {"/": {"Sys.Audit": 1, "VM.Audit": 1, "Pool.Audit": 1, "SDN.Audit": 1}}},
    "guests": [
        {"vmid": 100, "type": "qemu", "node": "pve1", "name": "lab-web", "pool": "web"},
        {"vmid": 101, "type": "qemu", "node": "pve1", "name": "prod-web", "pool": "prod"},
        {"vmid": 102, "type": "qemu", "node": "pve1", "name": "old-app"},
    ],
    "pools": ["web", "prod"],
    "sdn": {
        "zones": [{"zone": "cslab", "type": "simple"}],
        "vnets": [{"vnet": v, "zone": "cslab", "type": "vnet"} for v in vnets],
        "subnets": [{"subnet": "cslab-10.77.%d.0-24" % i, "cidr": "10.77.%d.0/24" % i,
                     "vnet": v, "zone": "cslab", "type": "subnet"}
                    for i, v in enumerate(vnets, start=1)],
    },
}
with open(sys.argv[2], "w") as f:
    json.dump(settings, f)
PY
# Both doubles listen inside the node's namespace, where the controller runs.
in_ns python3 "$root/tests/doubles/pbs-api" --root "$node" --tls-dir "$tls/pbs" >"$work/pbs-api.log" 2>&1 &
in_ns python3 "$root/tests/doubles/pve-api" --root "$tls/pve" >"$work/pve-api.log" 2>&1 &
for _ in $(seq 1 100); do
  [ -s "$tls/pbs/port" ] && [ -s "$tls/pve/port" ] && break
  sleep 0.1
done
[ -s "$tls/pbs/port" ] && [ -s "$tls/pve/port" ] ||
  { echo "lab: the API doubles did not start:" >&2; cat "$work/pbs-api.log" "$work/pve-api.log" >&2; exit 70; }
pbs_port=$(cat "$tls/pbs/port")
pve_port=$(cat "$tls/pve/port")
echo "API doubles: PBS on localhost:$pbs_port, PVE on localhost:$pve_port (inside $ns)"
# Who is told of the night: a webhook receiver and an SMTP server (STARTTLS, AUTH PLAIN), with
# certificates of the lab's CA, inside the namespace too (tests/doubles/webhook-receiver,
# smtp-receiver). The HMAC key and the mail password are the controller's, 0600.
openssl rand -hex 32 >"$ctl/webhook.key"
openssl rand -hex 16 >"$ctl/smtp-password"
chmod 0600 "$ctl/webhook.key" "$ctl/smtp-password"
cp "$ctl/smtp-password" "$tls/smtp/password"
in_ns python3 "$root/tests/doubles/webhook-receiver" --root "$tls/webhook" >"$work/webhook.log" 2>&1 &
in_ns python3 "$root/tests/doubles/smtp-receiver" --mode starttls --user certistack \
  --password-file "$tls/smtp/password" --root "$tls/smtp" >"$work/smtp.log" 2>&1 &
for _ in $(seq 1 100); do
  [ -s "$tls/webhook/port" ] && [ -s "$tls/smtp/port" ] && break
  sleep 0.1
done
[ -s "$tls/webhook/port" ] && [ -s "$tls/smtp/port" ] ||
  { echo "lab: the receivers did not start:" >&2; cat "$work/webhook.log" "$work/smtp.log" >&2; exit 70; }
webhook_port=$(cat "$tls/webhook/port")
smtp_port=$(cat "$tls/smtp/port")
mkdir -p "$ctl/metrics"
cat >"$ctl/controller.toml" <<CONF
state_dir = "$ctl/state"
reports_dir = "$ctl/reports"

[pve]
api_url = "https://localhost:$pve_port"
token_id = "certistack@pve!ctl"
token_secret_file = "pve-token"
ca_file = "$tls/ca.pem"
sandbox_vmid_range = "9101-9199"

[outputs]
metrics_textfile = "$ctl/metrics/certistack.prom"

[notify]
on = ["failure", "error"]

[notify.webhook]
url = "https://localhost:$webhook_port/hooks/certistack"
hmac_key_file = "webhook.key"
ca_file = "$tls/ca.pem"

[notify.smtp]
host = "localhost"
port = $smtp_port
security = "starttls"
user = "certistack"
password_file = "smtp-password"
from = "certistack@lab.example"
to = ["backup-team@lab.example"]
ca_file = "$tls/ca.pem"

[[nodes]]
name = "pve1"
address = "127.0.0.1"
port = $port
CONF
# The production guest's probes, to the address a guest on the validation's probe network has.
prod_probes() {
  cat <<PROBES
      - kind: tcp
        address: $1
        port: 22
        expect:
          banner_prefix: "CERTISTACK-LAB $prod_marker"
      - kind: http
        address: $1
        port: 80
        expect:
          http_path: /
          body_contains: "$prod_marker"
          body_sha256: "$prod_body_sha256"
PROBES
}
preserve_probes=$(prod_probes "$preserve_guest")
rewrite_probes=$(prod_probes "$rewrite_guest")
cat >"$ctl/lab.yaml" <<PLAN
# The lab plan, as an operator writes it: restore the newest backup of every VM of pool web
# (VM 100) into a sandbox VM on VNet csv1, boot it, and prove the guest serves what the backup
# holds; at the same time VM 101's, whose guest configures a production network of its own,
# twice: an older backup named by its time, as it is on csv2 (its probes cannot reach it), and
# the newest with network recovery on csv3 (they do). The controller finds the snapshots,
# archives and sizes in the PBS, the sandbox VMIDs in the range, and the node; each validation
# says its network_recovery mode: none relies on the default.
storage:
  server: localhost
  port: $pbs_port
  datastore: store1
  auth_id: certistack@pbs!restore
  fingerprint: "$fingerprint"
  pbs_password_file: pbs-password
validations:
  - name: lab-web
    node: auto
    select: {pool: web}
    snapshot: latest
    max_age_hours: 48
    sandbox:
      - {}
    network:
      lifecycle: preprovisioned
      vnet: csv1
      probe_source: 10.77.1.2/24
    probes:
      - kind: tcp
        address: $guest
        port: 22
        expect:
          banner_prefix: "CERTISTACK-LAB $marker"
      - kind: http
        address: $guest
        port: 80
        expect:
          http_path: /
          body_contains: "$marker"
          body_sha256: "$body_sha256"
    network_recovery:
      mode: preserve
    timeouts:
      run_seconds: 600
      guest_agent_seconds: 180
  - name: lab-prod-preserve
    node: pve1
    source_vmid: 101
    snapshot: "$prod_snapshot_before"
    archives: [drive-scsi0.img]
    sandbox:
      - vmid: $preserve_vmid
        cores: 1
        memory_mib: 256
    network:
      lifecycle: preprovisioned
      vnet: csv2
      probe_source: 10.77.2.2/24
    # Each probe is one attempt bounded by the node's limits.probe_timeout_secs.
    probes:
$preserve_probes
    network_recovery:
      mode: preserve
    timeouts:
      run_seconds: 600
      guest_agent_seconds: 180
  - name: lab-prod-rewrite
    node: auto
    source_vmid: 101
    snapshot: latest
    max_age_hours: 48
    sandbox:
      - {}
    network:
      lifecycle: preprovisioned
      vnet: csv3
      probe_source: 10.77.3.2/24
    probes:
$rewrite_probes
    network_recovery:
      mode: rewrite
      guest_address: $rewrite_guest/24
    timeouts:
      # One libguestfs appliance boot under TCG (bounded by the node's 600 s) comes on top of
      # the guest's.
      run_seconds: 1200
      guest_agent_seconds: 180
  # VM 102's newest backup is older than a day allows: the validation fails, no node asked.
  - name: lab-stale
    node: auto
    source_vmid: 102
    snapshot: latest
    max_age_hours: 24
    sandbox:
      - {}
    network:
      lifecycle: preprovisioned
      vnet: csv1
      probe_source: 10.77.1.2/24
    network_recovery:
      mode: preserve
PLAN

# Started directly (not through a shell function) so that $! is the daemon itself, in a session
# of its own: a Ctrl-C at the terminal reaches certistack-ctl, which cleans up through the
# connector, and not the connector itself.
setsid ip netns exec "$ns" "$(launcher_dir)/certistack-connector" --config "$node/connector.toml" 2>"$work/connector.log" &
daemon=$!
echo "daemon=$daemon" >>"$work/lab.env"
up=0
for _ in $(seq 1 100); do
  if in_ns "$bin/certistack-ctl" hello --state-dir "$ctl/state" --node "127.0.0.1:$port" --name pve1 >/dev/null 2>&1; then
    up=1
    break
  fi
  sleep 0.1
done
[ "$up" = 1 ] || { echo "lab: the connector did not come up:" >&2; cat "$work/connector.log" >&2; exit 70; }
echo "connector pid $daemon listening on 127.0.0.1:$port inside $ns; backup marker $marker"
phase_end set-up

# ---- the validation -------------------------------------------------------------------------
say "certistack-ctl plan show lab.yaml"
# What will run where, and why, as the operator reads it before the night.
(cd "$ctl" && in_ns "$bin/certistack-ctl" plan show lab.yaml --config controller.toml --per-node 3) | tee "$work/plan-show.txt"

say "certistack-ctl run lab.yaml"
# `times` in this shell (not in a subshell) gives the CPU time of the waited-for children.
times >"$work/times.before"
# The run's own exit code (1 failed, 2 error) is the lab's answer, not a failure of the lab.
run_code=0
(cd "$ctl" && in_ns "$bin/certistack-ctl" run lab.yaml --config controller.toml --per-node 3) || run_code=$?
times >"$work/times.after"
cpu_before=$(tail -n 1 "$work/times.before")
cpu_after=$(tail -n 1 "$work/times.after")
run_ended=$(date +%s%N)
run_ms=$(((run_ended - mark) / 1000000))
mark=$run_ended
# The connector's own CPU time and that of the tools it waited for (doubles, qemu-img, nft).
connector_cpu=0
connector_children_cpu=0
if [ -r "/proc/$daemon/stat" ]; then
  read -r connector_cpu connector_children_cpu < <(awk -v hz="$(getconf CLK_TCK)" \
    '{printf "%d %d\n", ($14 + $15) * 1000 / hz, ($16 + $17) * 1000 / hz}' "/proc/$daemon/stat")
else
  echo "lab: the connector (pid $daemon) is gone; see $keep/connector.log" >&2
fi
reports=$(ls -1 "$ctl/reports"/*.json 2>/dev/null || true)
# The backups' content, after every validation restored, booted and cleaned up.
backups_changed=0
if [ "$(sha256sum "$disk" "$prod_disk" "$prod_disk_before")" != "$backups_sha256" ]; then
  echo "lab: a backup's image changed during the run:" >&2
  printf 'before:\n%s\nafter:\n%s\n' "$backups_sha256" "$(sha256sum "$disk" "$prod_disk" "$prod_disk_before")" >&2
  backups_changed=1
fi

# ---- verify ---------------------------------------------------------------------------------
say "certistack-ctl report verify"
verify_code=0
[ -n "$reports" ] || { echo "no report was written" >&2; verify_code=1; }
for report in $reports; do
  "$bin/certistack-ctl" report verify --state-dir "$ctl/state" "$report" || verify_code=$?
done

# What the receivers got, kept with the evidence.
cp "$tls/webhook/requests.log" "$work/webhook-requests.log" 2>/dev/null || true
cp "$tls/smtp/messages.log" "$work/smtp-messages.log" 2>/dev/null || true
cp "$ctl/metrics/certistack.prom" "$work/certistack.prom" 2>/dev/null || true
# The receiver's check of the webhook's signature (docs/history.md, "Webhook"), made here while
# the key exists; the key itself is not kept.
python3 - "$ctl/webhook.key" "$work/webhook-requests.log" >"$work/webhook-signature.txt" 2>&1 <<'PY' || true
import hashlib, hmac, json, sys
key = open(sys.argv[1], "rb").read().strip()
for line in open(sys.argv[2]):
    request = json.loads(line)
    stamp = request["headers"].get("x-certistack-timestamp", "")
    mac = "sha256=" + hmac.new(key, stamp.encode() + b"." + request["body"].encode(), hashlib.sha256).hexdigest()
    genuine = hmac.compare_digest(mac, request["headers"].get("x-certistack-signature", ""))
    leaked = key.decode() in line
    print("genuine" if genuine and not leaked else "FORGED OR LEAKED")
PY

say "certistack-ctl history"
# What the run left in the controller's history, and the alarm an operator sets after the night
# (it rings for the two validations that never passed: lab-stale and lab-prod-preserve).
(cd "$ctl" && "$bin/certistack-ctl" history --config controller.toml) || true
(cd "$ctl" && "$bin/certistack-ctl" history 101 --config controller.toml) || true
(cd "$ctl" && "$bin/certistack-ctl" history --config controller.toml --json) >"$work/history.json" || true
history_alarm=0
(cd "$ctl" && "$bin/certistack-ctl" history --config controller.toml --max-age-hours 24 >/dev/null 2>"$work/history-alarm.txt") ||
  history_alarm=$?
echo "history --max-age-hours 24: exit $history_alarm: $(cat "$work/history-alarm.txt")"

# The rewrite's appliance ran in its confined unit of the node's systemd, as the user the
# recovery's journaled intent names.
confined_units=$(in_node_systemd journalctl -q --no-pager -o cat -u 'certistack-guestnet-*' 2>/dev/null |
  grep -c '^Started certistack-guestnet-' || true)
appliance_users=$(find "$node/state" -name journal -type f -exec grep -ho '"appliance_user":"[^"]*"' {} + 2>/dev/null |
  sed 's/.*:"\(.*\)"/\1/' | sort -u | tr '\n' ' ' || true)

# ---- teardown -------------------------------------------------------------------------------
say "teardown"
left_on_node=$(node_residue)
kill -TERM "$daemon" 2>/dev/null || true
wait "$daemon" 2>/dev/null || true
daemon=""
keep_evidence
teardown
left=$(residue)
rm -rf "$work"
phase_end teardown
removed=$ns
ns=""
if [ -n "$left_on_node" ] || [ -n "$left" ]; then
  [ -n "$left_on_node" ] && echo "lab: the run left on the node:$left_on_node" >&2
  [ -n "$left" ] && echo "lab: RESIDUE on this machine:$left" >&2
  exit 71
fi
echo "the run left nothing on the node (no nft table, probe address, VM, loop device or process);"
echo "nothing left: namespace $removed (with its VNet and nft tables) removed, no loop device or process of the lab remains"

# ---- summary --------------------------------------------------------------------------------
kept_reports=()
for report in $reports; do
  kept_reports+=("$keep/$(basename "$report")")
done
say "summary"
expectations=0
LAB_PRESERVE_PROBE_NETWORK=${preserve_guest%.*}.0/24 LAB_REWRITE_ADDRESS=$rewrite_guest/24 LAB_APPLIANCE_ACCEL=$appliance_accel \
LAB_CONFINED_UNITS=$confined_units LAB_APPLIANCE_USERS="$appliance_users" LAB_PLAN_SHOW="$keep/plan-show.txt" \
LAB_HISTORY="$keep/history.json" LAB_HISTORY_ALARM="$keep/history-alarm.txt" LAB_HISTORY_ALARM_CODE=$history_alarm \
  python3 - "$run_code" "$verify_code" "$run_ms" "$connector_cpu" "$connector_children_cpu" \
  "$cpu_before" "$cpu_after" "$backups_changed" "${phases[*]}" "${kept_reports[@]}" <<'PY' || expectations=$?
import base64, ipaddress, json, os, re, sys

run_code, verify_code, run_ms = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
connector_cpu, tools_cpu = int(sys.argv[4]), int(sys.argv[5])
backups_changed = sys.argv[8] == "1"
phase_words = sys.argv[9].split()
phases = {phase_words[i]: int(phase_words[i + 1]) for i in range(0, len(phase_words) - 1, 2)}
reports = sys.argv[10:]
plan_show = open(os.environ["LAB_PLAN_SHOW"]).read()

def seconds(text):
    minutes, _, rest = text.partition("m")
    return int(minutes) * 60 + float(rest.rstrip("s"))

before, after = sys.argv[6].split(), sys.argv[7].split()
controller_cpu = int(1000 * (sum(map(seconds, after)) - sum(map(seconds, before))))

PROD_SUBNET = ipaddress.ip_network("192.168.77.0/24")
PROBE_NET = ipaddress.ip_network(os.environ["LAB_PRESERVE_PROBE_NETWORK"])
REWRITE_ADDRESS = ipaddress.ip_interface(os.environ["LAB_REWRITE_ADDRESS"])

def addresses(predicate):
    """The guest's IPv4 addresses per interface, as its agent reported them."""
    found = {}
    for nic in (predicate.get("guest") or {}).get("interfaces") or []:
        for a in nic.get("ip-addresses") or []:
            if a.get("ip-address-type") == "ipv4" and not a["ip-address"].startswith("127."):
                found.setdefault(nic.get("name", "?"), []).append(
                    ipaddress.ip_interface(f"{a['ip-address']}/{a.get('prefix', 32)}"))
    return found

def span(steps, first, last):
    s = [x for x in steps if first(x["name"])]
    e = [x for x in steps if last(x["name"])]
    return (max(x["ended_unix_ms"] for x in e) - min(x["started_unix_ms"] for x in s)) if s and e else 0

# What each validation must show; each failed expectation is a line.
def expect_passed(p, problems):
    if p["verdict"]["result"] != "passed":
        problems.append(f"verdict {p['verdict']['result']}, expected passed: {p['verdict'].get('reasons', [])}")

def expect_unreachable(p, problems):
    verdict = p["verdict"]
    if verdict["result"] != "failed":
        problems.append(f"verdict {verdict['result']}, expected failed (the probes cannot reach the guest)")
    # The guest booted and configured its own production network: its agent answered with it.
    nics = addresses(p)
    if not any(a in PROD_SUBNET for found in nics.values() for a in found):
        problems.append(f"the guest agent reported no address in {PROD_SUBNET}: {nics}")
    if any(a in PROBE_NET for found in nics.values() for a in found):
        problems.append(f"the guest has an address in the probe network {PROBE_NET} although nothing recovered it: {nics}")
    if any(s["name"].startswith("recover network") for s in p["steps"]):
        problems.append("a network recovery step ran in mode preserve")
    if not p["probes"]:
        problems.append("no probe ran")
    for probe in p["probes"]:
        if probe["passed"]:
            problems.append(f"probe {probe['target']} passed")
        elif not re.search(r"unreachable|no route|timed out|timeout", probe.get("detail", ""), re.I):
            problems.append(f"probe {probe['target']} failed for another reason than reachability: {probe.get('detail')}")
    reasons = " ".join(verdict.get("reasons", []))
    if "probe" not in reasons:
        problems.append(f"the verdict's reasons do not name the probes: {verdict.get('reasons')}")

def expect_recovered(p, problems):
    expect_passed(p, problems)
    steps = [s for s in p["steps"] if s["name"].startswith("recover network")]
    if len(steps) != 1 or steps[0]["result"] != "ok":
        problems.append(f"expected one successful recover network step, got {[(s['name'], s['result']) for s in steps]}")
    else:
        detail = steps[0].get("detail", "")
        for needed in ("linux debian 12.", "stack ifupdown", f"profile {REWRITE_ADDRESS} on",
                       "written /etc/network/interfaces.d/certistack-sandbox",
                       "written /etc/systemd/network/10-certistack-sandbox.link",
                       "changed /etc/network/interfaces"):
            if needed not in detail:
                problems.append(f"the recovery evidence lacks {needed!r}: {detail}")
    nics = addresses(p)
    sandbox = nics.get("cssandbox0", [])
    if REWRITE_ADDRESS not in sandbox:
        problems.append(f"the guest agent reported no {REWRITE_ADDRESS} on cssandbox0 (the NIC the recovery's link file names): {nics}")
    if any(a in PROD_SUBNET for found in nics.values() for a in found):
        problems.append(f"the guest still configured its production subnet: {nics}")

def expect_stale(p, problems):
    verdict = p["verdict"]
    if verdict["result"] != "failed":
        problems.append(f"verdict {verdict['result']}, expected failed (the newest backup is too old)")
    reasons = " ".join(verdict.get("reasons", []))
    if " old" not in reasons or "VM 102" not in reasons:
        problems.append(f"the verdict's reasons do not say how old VM 102's newest backup is: {verdict.get('reasons')}")
    if p["connector"]["version"] != "not contacted" or p["steps"][0]["name"] != "resolve backup":
        problems.append("a node was asked for a validation that fails before any node")

EXPECTED = {"lab-web-100": expect_passed, "lab-prod-preserve": expect_unreachable,
            "lab-prod-rewrite": expect_recovered, "lab-stale": expect_stale}

unmet = []
seen = set()
lines = []
appliance_users = set(os.environ.get("LAB_APPLIANCE_USERS", "").split())
for report in reports:
    envelope = json.load(open(report))
    p = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    name = p["name"]
    seen.add(name)
    steps = p["steps"]
    boot_ms = span(steps, lambda n: n.startswith("start "), lambda n: n.startswith("guest agent") or n.startswith("qga ") or n.startswith("qmp "))
    probes_ms = span(steps, lambda n: n.startswith("probe "), lambda n: n.startswith("probe "))
    recovery_ms = span(steps, lambda n: n.startswith("recover network"), lambda n: n.startswith("recover network"))
    teardown_ms = span(steps, lambda n: n.startswith("stop "), lambda n: n == "journal")
    lines.append(f"[{name}]")
    # What the controller resolved: the snapshot (from the listing for latest), the node (with
    # how placement chose it) and the sandbox VMIDs (from the range).
    created = [s["name"].split()[1] for s in steps if s["name"].startswith("create ")]
    placed = f" (placed: {p['placement']})" if p.get("placement") else ""
    # What plan show printed before the run is where the run placed it.
    if p.get("placement") and f"{p['node']} (from {p['placement']})" not in plan_show:
        unmet.append(f"{name}: placed on {p['node']} ({p['placement']}), which plan show did not print")
    lines.append(f"resolved      {p['snapshot']['snapshot']} on {p['node']}{placed}; sandbox VMIDs {' '.join(created) or 'none created'}")
    verdict = p["verdict"]
    lines.append(f"verdict       {verdict['result']}" + "".join(f"\n              {r}" for r in verdict.get("reasons", [])))
    os_info = (p.get("guest") or {}).get("os_info") or {}
    lines.append(f"guest         {p.get('guest', {}).get('status', '?')}; QGA: {os_info.get('pretty-name') or os_info.get('pretty_name') or os_info or 'no answer'}")
    nics = addresses(p)
    lines.append("guest network " + ("; ".join(f"{nic} {' '.join(map(str, found))}" for nic, found in sorted(nics.items())) or "no IPv4 address reported"))
    for step in steps:
        if step["name"].startswith("recover network"):
            lines.append(f"recovery      {step['result']} in {(step['ended_unix_ms'] - step['started_unix_ms']) / 1000:.1f} s: {step.get('detail', '')}")
    for probe in p.get("probes", []):
        lines.append(f"probe         {probe['target']}: {'passed' if probe['passed'] else 'FAILED'} ({probe.get('detail', '')}; expected {probe['expected']})")
    cleanup = p.get("cleanup", {})
    lines.append(f"cleanup       {'complete' if cleanup.get('complete') else 'NOT complete'}, {len(cleanup.get('receipts', []))} receipts, residue {cleanup.get('residue', [])}")
    lines.append(f"isolation     bridge addresses {p.get('isolation', {}).get('bridge_addresses')}, forwarding {p.get('isolation', {}).get('forwarding')}")
    lines.append(f"journal       {len(p['journal']['records'])} records, head {p['journal']['head_sha256'][:16]}…")
    lines.append(f"times         guest boot {boot_ms / 1000:.1f} s, network recovery {recovery_ms / 1000:.1f} s, probes {probes_ms / 1000:.1f} s, teardown on the node {teardown_ms / 1000:.1f} s")
    lines.append(f"report        {report}")
    problems = []
    check = EXPECTED.get(name)
    if check is None:
        problems.append("a validation the lab does not know")
    else:
        check(p, problems)
    lines.append("as expected   " + ("yes" if not problems else "NO: " + "\n              ".join(problems)))
    lines.append("")
    unmet += [f"{name}: {x}" for x in problems]
for name in EXPECTED:
    if name not in seen:
        unmet.append(f"{name}: no report")
if backups_changed:
    unmet.append("a backup's image changed during the run")
# The rewrite's appliance ran in its confined unit of the node's systemd, as the appliance user
# its journaled intent names.
if int(os.environ.get("LAB_CONFINED_UNITS") or 0) < 1:
    unmet.append("no guest network recovery ran in the appliance's confined unit")
if not appliance_users or not all(u.startswith("certistack-guestnet-") for u in appliance_users):
    unmet.append(f"the recovery's appliance ran as {sorted(appliance_users)}, not the package's appliance users")
try:
    starts = [json.loads(line) for line in open(os.path.join(os.path.dirname(reports[0]) if reports else ".", "doubles-calls.log"))]
    starts = [r for r in starts if r.get("event") == "qemu-start" and r.get("accel")]
    if starts:
        lines.append(f"accelerator   {starts[-1]['accel']} ({starts[-1].get('accel_why', '')}); libguestfs appliance {os.environ['LAB_APPLIANCE_ACCEL']}")
        lines.append(f"appliance     confined: {os.environ['LAB_CONFINED_UNITS']} unit(s) of the node's systemd, as {', '.join(sorted(appliance_users)) or 'no user'}")
except (OSError, ValueError):
    pass
lines.append("preflight     " + ("REFUSED: the PVE API token lacks privileges (see above)" if run_code == 77 else
             "passed: the PVE API token holds every privilege the plan needs, read before anything was asked"))
if run_code == 77:
    unmet.append("the preflight refused the plan")
# The history the run wrote: each validation's verdicts, restore times, and the alarm for the
# two that never passed (lab-stale: too old; lab-prod-preserve: probes cannot reach its guest).
try:
    rows = {vm["validation"]: vm for vm in json.load(open(os.environ["LAB_HISTORY"]))["vms"]}
except (OSError, ValueError, KeyError) as e:
    rows = {}
    unmet.append(f"history --json did not answer: {e}")
if rows:
    for name in ("lab-web-100", "lab-prod-rewrite"):
        row = rows.get(name, {})
        if not row.get("last_passed_unix_ms") or not row.get("last_restore_ms"):
            unmet.append(f"the history has no pass with a restore time for {name}: {row}")
    for name in ("lab-prod-preserve", "lab-stale"):
        row = rows.get(name, {})
        if row.get("last_state") != "failed" or row.get("last_passed_unix_ms") is not None:
            unmet.append(f"the history does not show {name} failed and never passed: {row}")
    restores = ", ".join(f"{n} {r['last_restore_ms'] / 1000:.1f} s" for n, r in sorted(rows.items()) if r.get("last_restore_ms"))
    lines.append(f"history       {len(rows)} validations of {len({r['source_vmid'] for r in rows.values()})} VMs; restore times {restores}")
alarm = open(os.environ["LAB_HISTORY_ALARM"]).read() if os.path.exists(os.environ["LAB_HISTORY_ALARM"]) else ""
if (os.environ.get("LAB_HISTORY_ALARM_CODE") != "1" or "lab-stale" not in alarm or "lab-prod-preserve" not in alarm
        or "lab-web-100" in alarm or "lab-prod-rewrite" in alarm):
    unmet.append(f"history --max-age-hours 24 should exit 1 naming lab-stale and lab-prod-preserve only: exit {os.environ.get('LAB_HISTORY_ALARM_CODE')}: {alarm.strip()}")
else:
    lines.append("alarm         history --max-age-hours 24: exit 1 for lab-stale and lab-prod-preserve (never passed), as expected")
# Someone was told: one signed webhook and one mail naming the two failed validations, and the
# metrics file node_exporter reads.
keep_dir = os.path.dirname(os.environ["LAB_HISTORY"])
def read_lines(name):
    try:
        return [json.loads(line) for line in open(os.path.join(keep_dir, name))]
    except (OSError, ValueError):
        return []
hooks = read_lines("webhook-requests.log")
if len(hooks) != 1:
    unmet.append(f"expected one webhook request, got {len(hooks)}")
else:
    try:
        checked = open(os.path.join(keep_dir, "webhook-signature.txt")).read().split()
    except OSError:
        checked = []
    body = json.loads(hooks[0]["body"])
    named = sorted(v["validation"] for v in body.get("validations", []))
    if checked != ["genuine"]:
        unmet.append(f"the webhook's signature does not check with the key, or the key is in it: {checked}")
    elif body.get("type") != "certistack.run.failure" or named != ["lab-prod-preserve", "lab-stale"]:
        unmet.append(f"the webhook should name lab-prod-preserve and lab-stale as failed: {body.get('type')} {named}")
    else:
        lines.append(f"webhook       1 signed certistack.run.failure (signature checked), naming {', '.join(named)}")
mails = read_lines("smtp-messages.log")
subject = next((l for l in (mails[0]["data"].split("\r\n") if mails else []) if l.startswith("Subject: ")), "")
if len(mails) != 1 or subject != "Subject: CertiStack: 2 failed, 0 erred in lab.yaml" or not mails[0].get("tls"):
    unmet.append(f"expected one mail over TLS with the two failures in its subject, got {len(mails)}: {subject!r}")
else:
    lines.append(f"mail          1 over STARTTLS as {mails[0]['auth_user']}: {subject[9:]}")
try:
    metrics = open(os.path.join(keep_dir, "certistack.prom")).read()
except OSError:
    metrics = ""
wanted = ['certistack_run_validations{verdict="passed"} 2', 'certistack_run_validations{verdict="failed"} 2',
          "certistack_run_notification_failures 0", 'certistack_vm_last_pass_timestamp_seconds{vmid="102",validation="lab-stale"} 0']
missing = [w for w in wanted if w not in metrics.splitlines()]
if missing:
    unmet.append(f"the metrics file lacks {missing}")
else:
    lines.append("metrics       certistack.prom replaced: 2 passed, 2 failed, 0 notifications lost; lab-stale never passed")
lines.append(f"reports       {len(reports)}, {'all verified' if verify_code == 0 else 'NOT ALL VERIFY'}; backups' content {'CHANGED' if backups_changed else 'unchanged (SHA-256 before and after)'}")
print("\n".join(lines))
total = sum(phases.values()) + run_ms
print(f"\nwall time {total / 1000:.1f} s: build {phases.get('build', 0) / 1000:.1f} s, set-up {phases.get('set-up', 0) / 1000:.1f} s, "
      f"run {run_ms / 1000:.1f} s, lab teardown {phases.get('teardown', 0) / 1000:.1f} s")
print(f"CPU during the run: connector {connector_cpu / 1000:.2f} s, tools it ran (doubles, qemu-img, nft, guestfish) {tools_cpu / 1000:.2f} s, "
      f"controller {controller_cpu / 1000:.2f} s; the rest of the {run_ms / 1000:.1f} s is the guests (and the appliance) under TCG")
if unmet:
    print("\nlab: not as expected:\n  " + "\n  ".join(unmet), file=sys.stderr)
    sys.exit(1)
PY
if [ "$verify_code" != 0 ]; then
  exit 70
fi
# `certistack-ctl run` exits 1 for lab-prod-preserve's expected failure: the lab's own
# expectations decide, unless the run itself ended in error.
if [ "$run_code" = 2 ]; then
  exit 2
fi
exit "$expectations"
