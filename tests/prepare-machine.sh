#!/usr/bin/env bash
# Prepares a Debian machine for the test suite and the lab, as root: one `apt-get install` of
# every package they use, run only when something is missing. `.ci/run` calls it, and so do the
# README's test command and the lab. Not as root, it says what is missing and installs nothing.
#
#   bash tests/prepare-machine.sh
#
# Debian's QEMU system emulator conflicts with the newer qemu-utils some machines ship, so
# qemu-utils (and its block modules) are pinned to the emulator's version in the same command:
# installing the emulator alone would remove qemu-img.
set -euo pipefail

# The connector runs tools (and the test doubles, which are Python scripts) with
# PATH=/usr/sbin:/usr/bin:/sbin:/bin, so look there, not in this shell's PATH.
missing=()
for tool in qemu-system-x86_64 qemu-img qemu-ga losetup prlimit python3 ip nft iptables-legacy-save ip6tables-legacy-save \
  dnsmasq slapd openssl busybox cpio sfdisk mkfs.vfat mcopy syslinux guestfish mkfs.ext4 mkfs.btrfs \
  systemd-analyze systemd-nspawn mmdebstrap debugfs pgrep sysctl dpkg-deb dpkg-shlibdeps minisign apt-ftparchive gpg gpg-agent readelf; do
  PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
# The surface-digest test re-encodes the descriptor with Google's protobuf library; the report
# test verifies a signed report with Python's `cryptography`, independently of the project's code.
/usr/bin/python3 -c "import google.protobuf" 2>/dev/null || missing+=(python3-protobuf)
/usr/bin/python3 -c "import cryptography" 2>/dev/null || missing+=(python3-cryptography)
# The metrics test reads the controller's textfile with Prometheus' own Python parser.
/usr/bin/python3 -c "import prometheus_client.parser" 2>/dev/null || missing+=(python3-prometheus-client)
# UEFI sandbox VMs (bios: ovmf) boot the qm double's QEMU on Debian's OVMF firmware.
[ -e /usr/share/OVMF/OVMF_CODE_4M.fd ] || missing+=(ovmf)
# The lab's guest disks boot through SYSLINUX's MBR code.
[ -e /usr/lib/syslinux/mbr/mbr.bin ] || missing+=(syslinux-common)
# The lab's guest runs busybox without a C library: Debian's dynamic busybox is not enough.
if busybox=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v busybox) && ! python3 "$(dirname "$0")/lab/elf-static" "$busybox" 2>/dev/null; then
  missing+=("busybox-static ($busybox is dynamically linked)")
fi
# Guest network recovery runs libguestfs' appliance, which boots a kernel from /boot.
compgen -G '/boot/vmlinuz-*' >/dev/null || missing+=("a kernel in /boot")

if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" != 0 ]; then
  # Not root: nothing can be installed, and the tests that need root skip anyway (each says
  # why); the rest of the test command goes on.
  echo "prepare-machine: missing ${missing[*]}; not root, so nothing was installed (sudo bash $0 installs them); the tests that need them will skip" >&2
  exit 0
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "prepare-machine: installing what is missing: ${missing[*]}"
  # Packages with a service (slapd, dnsmasq's, ...) must not start it on this machine: the tests
  # start their own servers in namespaces of their own. A policy-rc.d of Debian's
  # invoke-rc.d interface says so for the time of the install, unless the machine has its own.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# tests/prepare-machine.sh: no service starts while it installs.\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  qemu=$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --allow-downgrades \
    qemu-system-x86 "qemu-utils=$qemu" "qemu-block-extra=$qemu" qemu-guest-agent util-linux python3 \
    iproute2 nftables iptables dnsmasq-base slapd openssl python3-protobuf python3-cryptography \
    busybox-static cpio fdisk dosfstools mtools syslinux syslinux-common ovmf \
    libguestfs-tools linux-image-amd64 e2fsprogs btrfs-progs systemd systemd-container mmdebstrap \
    dpkg-dev minisign apt-utils gpg gpg-agent binutils ca-certificates procps python3-prometheus-client
fi
[ -e /usr/lib/syslinux/mbr/mbr.bin ] || { echo "prepare-machine: syslinux-common is missing /usr/lib/syslinux/mbr/mbr.bin" >&2; exit 1; }
command -v qemu-img >/dev/null || { echo "prepare-machine: qemu-img is gone; reinstall qemu-utils" >&2; exit 1; }
echo "prepare-machine: $(qemu-img --version | head -n 1); $(qemu-system-x86_64 --version | head -n 1)"
