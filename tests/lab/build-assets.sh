#!/usr/bin/env bash
# Builds the lab's guest disks from Debian packages, once: a Debian kernel (apt-get download +
# dpkg -x, never installed), a busybox initramfs with the virtio/SCSI modules and qemu-ga, and
# two raw disk images that boot the way Proxmox VE boots a VM: SeaBIOS reads the MBR, SYSLINUX
# loads the kernel and initramfs from a FAT partition. Nothing is mounted and no loop device is
# used (mtools and syslinux write into the image file), so building needs no root.
#
#   tests/lab/build-assets.sh [DIR]     (default target/lab-assets)
#
# Outputs in DIR/<stamp>/ (the stamp is this script's digest, so a changed recipe rebuilds):
#   disk-boot.img     boots; /init reads its settings and marker from partition 2 (raw bytes),
#                     or boots the Debian-like root filesystem an ext4 partition 2 holds
#   disk-panic.img    the same disk whose boot loader asks for an init that does not exist:
#                     the kernel panics ("VFS: Unable to mount root fs") and nothing answers
#   disk-probe.img    the same disk whose init prints "certistack-probe: init reached" on the
#                     serial console and powers off: what the qm double boots to decide KVM
#   layout            DATA_OFFSET=<bytes of partition 2 into the image>, DATA_SIZE=<bytes>
#   kernel-version
# and DIR/current -> <stamp>. A disk for a backup is a copy of one of the images with its data
# area (raw settings, or an ext4 filesystem of at most DATA_SIZE bytes) written at DATA_OFFSET
# (the formats are at the top of tests/lab/guest-init).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=${1:-$root/target/lab-assets}
# The recipe is the contents of this script and the guest's init (not the paths they were called
# by), and the host programs copied into the guest: a change to any of them is a new recipe.
busybox=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v busybox || true)
stamp=$(cat "$here/build-assets.sh" "$here/guest-init" "${busybox:-/dev/null}" \
  "$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v qemu-ga)" | sha256sum | cut -c1-16)
out=$dir/$stamp

if [ -f "$out/done" ]; then
  echo "guest assets: cached in $out"
  exit 0
fi

for tool in apt-get apt-cache dpkg-deb busybox cpio gzip sfdisk mkfs.vfat mcopy syslinux; do
  if ! PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$tool" >/dev/null; then
    echo "guest assets: $tool is missing; install busybox-static cpio fdisk dosfstools mtools syslinux syslinux-common" >&2
    exit 69
  fi
done
# The guest has no C library of its own: only a static busybox runs as its /init's shell.
if ! python3 "$here/elf-static" "$busybox"; then
  echo "guest assets: $busybox is dynamically linked; install busybox-static (it replaces busybox)" >&2
  exit 69
fi
for file in /usr/lib/syslinux/mbr/mbr.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 /usr/sbin/qemu-ga; do
  if [ ! -e "$file" ]; then
    echo "guest assets: $file is missing; install syslinux-common and qemu-guest-agent" >&2
    exit 69
  fi
done

work=$(mktemp -d "$dir.build.XXXXXX" 2>/dev/null || { mkdir -p "$dir" && mktemp -d "$dir.build.XXXXXX"; })
trap 'rm -rf "$work"' EXIT
# apt-get download drops privileges to _apt, which must be able to write here.
chmod 0755 "$work"

# The kernel: the package linux-image-amd64 currently depends on, downloaded and unpacked.
kernel_package() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
package=$(kernel_package)
if [ -z "$package" ] && [ "$(id -u)" = 0 ]; then
  # A fresh machine may have no package lists yet.
  apt-get update -qq
  package=$(kernel_package)
fi
if [ -z "$package" ]; then
  echo "guest assets: apt knows no linux-image-amd64; run apt-get update" >&2
  exit 69
fi
echo "guest assets: fetching $package"
(cd "$work" && apt-get download -qq -o APT::Sandbox::User=root "$package")
dpkg-deb -x "$work"/"$package"_*.deb "$work/kernel"
version=${package#linux-image-}
modules=$work/kernel/lib/modules/$version
# The package leaves modules.dep to its postinst; compute it for the unpacked tree.
busybox depmod -b "$work/kernel" "$version"
vmlinuz=$work/kernel/boot/vmlinuz-$version

# Modules the guest needs, dependencies first (modules.dep lists each module's dependencies).
# virtio_blk too: a sandbox mirrors the source's disk bus, and a guest may boot from virtio-blk.
wanted="virtio_pci virtio_scsi sd_mod virtio_blk virtio_net virtio_console"
declare -A seen=()
ordered=()
add_module() {
  local path=$1 dep
  [ -n "${seen[$path]:-}" ] && return 0
  seen[$path]=1
  for dep in $(awk -v m="$path:" '$1 == m { $1 = ""; print }' "$modules/modules.dep"); do
    add_module "$dep"
  done
  ordered+=("$path")
}
for name in $wanted; do
  path=$(awk -F: -v m="/$name.ko" 'index($1, m) && substr($1, length($1) - length(m) + 1) == m {print $1; exit}' "$modules/modules.dep")
  path=${path:-$(awk -F: -v m="/$name.ko" 'index($1, m) {print $1; exit}' "$modules/modules.dep")}
  if [ -z "$path" ]; then
    echo "guest assets: module $name not found in $package" >&2
    exit 70
  fi
  add_module "$path"
done
boot_modules=("${ordered[@]}")

# ext4, for a guest whose partition 2 is its root filesystem: loaded only then. modules.dep
# gives crc16, mbcache and jbd2; ext4 and jbd2 also ask for the crc32c hash through the crypto
# API (modules.softdep "pre: crypto-crc32c"), which crc32c_generic provides.
ordered=()
for name in crc32c_generic ext4; do
  path=$(awk -F: -v m="/$name.ko" 'index($1, m) {print $1; exit}' "$modules/modules.dep")
  if [ -z "$path" ]; then
    echo "guest assets: module $name not found in $package" >&2
    exit 70
  fi
  add_module "$path"
done
ext4_modules=("${ordered[@]}")

# The initramfs: busybox, the modules, qemu-ga with its libraries, /init.
initrd=$work/initrd
mkdir -p "$initrd"/{bin,dev,proc,sys,run,tmp,etc,lib/modules,var/www}
cp "$busybox" "$initrd/bin/busybox"
copy_modules() {
  local list=$1 path file base
  shift
  for path in "$@"; do
    file=$modules/$path
    base=$(basename "$path")
    case "$file" in
      *.ko.xz) xz -dc "$file" >"$initrd/lib/modules/${base%.xz}"; base=${base%.xz} ;;
      *.ko.zst) zstd -qdc "$file" >"$initrd/lib/modules/${base%.zst}"; base=${base%.zst} ;;
      *) cp "$file" "$initrd/lib/modules/$base" ;;
    esac
    echo "$base" >>"$initrd/lib/modules/$list"
  done
}
copy_modules order "${boot_modules[@]}"
copy_modules order-ext4 "${ext4_modules[@]}"
mkdir -p "$initrd/usr/sbin"
cp /usr/sbin/qemu-ga "$initrd/usr/sbin/qemu-ga"
for lib in $(ldd /usr/sbin/qemu-ga | awk '/=> \// {print $3} /^\t\/lib/ {print $1}'); do
  mkdir -p "$initrd$(dirname "$lib")"
  cp -L "$lib" "$initrd$lib"
done
cp "$here/guest-init" "$initrd/init"
chmod 0755 "$initrd/init"
cat >"$initrd/etc/os-release" <<'EOF'
PRETTY_NAME="CertiStack lab guest (busybox)"
NAME="CertiStack lab guest"
ID=certistack-lab
VERSION_ID="1"
EOF
echo "root:x:0:0:root:/:/bin/sh" >"$initrd/etc/passwd"
(cd "$initrd" && find . -print0 | cpio --null -o -H newc --quiet | gzip -6) >"$work/initrd.gz"

# The disk: MBR with SYSLINUX's boot code, partition 1 FAT (bootable) with the kernel, the
# initramfs and syslinux.cfg, partition 2 the data area /init reads (16 MiB: room for a small
# ext4 root filesystem).
boot_start=2048
boot_sectors=$(( (($(stat -c %s "$vmlinuz") + $(stat -c %s "$work/initrd.gz")) / 512) + 16384 ))
boot_sectors=$(( (boot_sectors + 2047) / 2048 * 2048 ))
data_start=$((boot_start + boot_sectors))
data_sectors=32768
image=$work/disk-boot.img
truncate -s $(((data_start + data_sectors) * 512)) "$image"
printf 'label: dos\nstart=%d, size=%d, type=c, bootable\nstart=%d, size=%d, type=83\n' \
  "$boot_start" "$boot_sectors" "$data_start" "$data_sectors" | sfdisk -q "$image"
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$image" bs=440 count=1 conv=notrunc status=none
offset=$((boot_start * 512))
# mkfs.vfat counts the whole image from the offset; the size given bounds it to partition 1.
if ! mkfs.vfat -n CSLAB --offset "$boot_start" "$image" $((boot_sectors / 2)) >"$work/mkfs.log" 2>&1; then
  cat "$work/mkfs.log" >&2
  exit 70
fi
export MTOOLS_SKIP_CHECK=1
mcopy -i "$image@@$offset" "$vmlinuz" ::vmlinuz
mcopy -i "$image@@$offset" "$work/initrd.gz" ::initrd.gz
boot_config() {
  printf 'DEFAULT lab\nPROMPT 0\nTIMEOUT 0\nLABEL lab\n  KERNEL /vmlinuz\n  INITRD /initrd.gz\n  APPEND %s\n' "$1"
}
# What the guest does not need, under TCG a measurable part of its boot (the probe disk reached
# its init in 5.1 s with these against 5.5 s without, three boots each on an idle machine): no
# CPU vulnerability mitigations, one serial port, no PS/2 controller probing, no TSC
# calibration checks, no self-tests of the crypto manager, no BIOS disk enumeration (EDD).
fast="mitigations=off 8250.nr_uarts=1 i8042.noaux i8042.nokbd i8042.nopnp tsc=reliable no_timer_check cryptomgr.notests edd=off random.trust_cpu=on"
boot_config "console=ttyS0 quiet loglevel=3 panic=0 $fast" >"$work/syslinux.cfg"
mcopy -i "$image@@$offset" "$work/syslinux.cfg" ::syslinux.cfg
syslinux --offset "$offset" --install "$image"

# The accelerator probe: the same disk, whose init says on the serial console that it was
# reached and powers off (the qm double's test of whether KVM runs a guest like the lab's).
cp --sparse=always "$image" "$work/disk-probe.img"
boot_config "console=ttyS0 quiet loglevel=3 panic=-1 certistack.probe $fast" >"$work/syslinux.cfg"
mcopy -o -i "$work/disk-probe.img@@$offset" "$work/syslinux.cfg" ::syslinux.cfg

# The disk that does not boot: the same, but the boot loader names an init that is not there.
cp --sparse=always "$image" "$work/disk-panic.img"
boot_config "console=ttyS0 loglevel=3 panic=0 rdinit=/sbin/no-such-init $fast" >"$work/syslinux.cfg"
mcopy -o -i "$work/disk-panic.img@@$offset" "$work/syslinux.cfg" ::syslinux.cfg

mkdir -p "$out"
mv "$image" "$work/disk-panic.img" "$work/disk-probe.img" "$out/"
printf 'DATA_OFFSET=%d\nDATA_SIZE=%d\n' $((data_start * 512)) $((data_sectors * 512)) >"$out/layout"
echo "$version" >"$out/kernel-version"
touch "$out/done"
ln -sfn "$stamp" "$dir/current"
# Disks of an older recipe are never used again; those of the last day are kept, since a test
# run that began before an upgrade may still be booting them.
find "$dir" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended -regex '.*/[0-9a-f]{16}' ! -name "$stamp" -mmin +1440 -exec rm -rf {} +
echo "guest assets: built in $out (kernel $version, $(du -h --apparent-size "$out/disk-boot.img" | cut -f1) disk)"
