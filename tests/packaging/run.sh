#!/usr/bin/env bash
# The Debian packages, end to end, with real tools. The connector's: build it from the release build,
# inspect it with dpkg-deb, sign it with certistack-ctl and verify it with both certistack-ctl
# and Debian's minisign (and see both refuse a changed byte and certistack-ctl refuse another
# surface), publish a signed apt repository (and see it refuse to sign anything it did not
# verify: repository.sh), install from it into a throwaway Debian root with signed-by= (and see
# apt refuse a tampered index and another key), run the maintainer scripts through install,
# reinstall, upgrade, remove and purge, and have the installed daemon answer Hello with the
# digest the package declares. The controller's (certistack-controller): built, inspected, signed,
# verified and published beside it, installed from the repository into the same root (then
# removed and purged, its CA kept), and installed into the systemd tests' root
# (tests/systemd/container-root.sh), booted with systemd-nspawn: its service started once against
# a node that does not answer runs as its user, writes its history row and exits; its timer is
# listed by `systemctl list-timers`; `systemd-analyze security` of the service is printed, and
# must be at most 2.5. Exits non-zero on the first failure.
#
# Needs root (chroot). Installs what is missing: dpkg-dev, minisign, mmdebstrap, apt-utils and
# gpg from Debian, cargo-deb (pinned) with cargo. The Debian root is built once and cached in
# target/packaging/.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
release="$root/target/release"
cache="$root/target/packaging"
suite_debian=trixie   # Proxmox VE 9's Debian
cargo_deb_version=3.8.0

fail() { echo "packaging test FAILED: $*" >&2; exit 1; }
step() { echo "== $*"; }
expect_fail() {
  # Runs "$@", which must fail; its output is kept for the caller in $out.
  if out=$("$@" 2>&1); then fail "expected a refusal from: $*"; fi
}

[ "$(id -u)" = 0 ] || fail "needs root (it chroots into a Debian root)"

# The Debian root the package is installed into, built once into the cache. `--base-root` builds
# only that (CI starts it early, beside the compilation, since it mostly waits on downloads).
base_root() {
  [ -f "$cache/$suite_debian-base.tar" ] && return 0
  mkdir -p "$cache"
  mmdebstrap --quiet --variant=minbase --include=qemu-utils,nftables,iproute2 \
    "$suite_debian" "$cache/$suite_debian-base.partial.tar" http://deb.debian.org/debian
  mv "$cache/$suite_debian-base.partial.tar" "$cache/$suite_debian-base.tar"
}
if [ "${1:-}" = --base-root ]; then
  base_root
  exit 0
fi
step "tools: dpkg-dev, minisign, mmdebstrap, apt-utils, gpg; cargo-deb $cargo_deb_version"
need_apt=0
for tool in dpkg-deb dpkg-shlibdeps minisign mmdebstrap apt-ftparchive gpg gpg-agent readelf; do
  command -v "$tool" >/dev/null || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    dpkg-dev minisign mmdebstrap apt-utils gpg gpg-agent binutils ca-certificates
fi
if ! cargo deb --version 2>/dev/null | grep -q " $cargo_deb_version\b"; then
  cargo install --locked --quiet cargo-deb --version "$cargo_deb_version"
fi

# The package is made from the release build CI has just made (`cargo auditable build --release --locked
# --bins`), never a second one.
for bin in certistack-connector certistack-ctl; do
  [ -x "$release/$bin" ] || fail "$release/$bin is missing: run cargo auditable build --release --locked --bins first"
done
ctl="$release/certistack-ctl"
controller_digest=$("$ctl" surface | sed -n 's/^digest: //p')

work=$(mktemp -d /tmp/certistack-packaging.XXXXXX)
chroot_dir="$work/debian"
daemon=""
nspawn=""
cleanup() {
  if [ -n "$nspawn" ] && kill -0 "$nspawn" 2>/dev/null; then kill -KILL "$nspawn"; wait "$nspawn" || true; fi
  if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill -TERM "$daemon"; wait "$daemon" || true; fi
  for m in "$chroot_dir/proc" "$chroot_dir/srv/repo"; do
    mountpoint -q "$m" 2>/dev/null && umount "$m"
  done
  for home in "$work/gnupg" "$work/gnupg-other"; do
    [ -d "$home" ] && gpgconf --homedir "$home" --kill gpg-agent 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

step "build the packages: the connector twice (revisions 1 and 2, for the upgrade), the controller"
mapfile -t built < <(packaging/build-deb "$work/v1")
[ "${#built[@]}" = 2 ] || fail "build-deb built ${#built[@]} packages, not the connector's and the controller's: ${built[*]}"
v1=${built[0]}
c1=${built[1]}
[ "$(basename "$v1")" = certistack-connector_0.1.0-1_amd64.deb ] && [ "$(basename "$c1")" = certistack-controller_0.1.0-1_amd64.deb ] \
  || fail "build-deb's packages: ${built[*]}"
v2=$(DEB_REVISION=2 packaging/build-deb "$work/v2" certistack-connector)
ls -l "$v1" "$v2" "$c1"
mapfile -t again < <(packaging/build-deb "$work/again")
for i in 0 1; do
  [ "$(sha256sum < "${built[$i]}")" = "$(sha256sum < "${again[$i]}")" ] || fail "two packagings of the same build differ: ${built[$i]}"
done
echo "the packaging step is reproducible: $(sha256sum "$v1" | cut -c1-64), $(sha256sum "$c1" | cut -c1-64)"
echo "package sizes: connector $(stat -c %s "$v1") bytes, controller $(stat -c %s "$c1") bytes"

step "inspect it with dpkg-deb: files, modes, owners, control fields, conffiles"
listing=$(dpkg-deb --contents "$v1")
echo "$listing"
expect_entry() {
  # MODE PATH: the entry exists with exactly this mode and root/root.
  echo "$listing" | awk -v mode="$1" -v path="$2" '$1 == mode && $2 == "root/root" && $6 == path {found=1} END {exit !found}' \
    || fail "the package has no $2 with mode $1 owned by root/root"
}
expect_entry -rwxr-xr-x ./usr/sbin/certistack-connector
expect_entry -rw-r--r-- ./usr/lib/systemd/system/certistack-connector.service
expect_entry -rw-r--r-- ./usr/lib/sysusers.d/certistack-connector.conf
expect_entry -rw-r----- ./etc/certistack/connector.toml
expect_entry -rw-r--r-- ./usr/share/doc/certistack-connector/copyright
expect_entry -rw-r--r-- ./usr/share/doc/certistack-connector/changelog.Debian.gz
expect_entry -rw-r--r-- ./usr/share/doc/certistack-connector/install.md
field() { dpkg-deb --field "$2" "$1"; }
# The package's conffile is listed, and each maintainer script is root's and 0755.
check_control() {
  local deb=$1 conffile=$2 name=$3
  dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx "$conffile" || fail "$name: $conffile is not a conffile"
  for script in postinst prerm postrm; do
    dpkg-deb --ctrl-tarfile "$deb" | tar -tv "./$script" | grep -q '^-rwxr-xr-x root/root' || fail "$name: $script missing or not 0755"
  done
}
# Extracts the package's binary to OUT and fails unless it is stripped.
stripped_binary() {
  local deb=$1 path=$2 out=$3
  dpkg-deb --fsys-tarfile "$deb" | tar -xO "$path" > "$out"
  readelf -S "$out" | grep -q '\.symtab' && fail "the packaged $path is not stripped"
  return 0
}
[ "$(field Package "$v1")" = certistack-connector ] || fail "Package field"
[ "$(field Architecture "$v1")" = amd64 ] || fail "Architecture field"
[ "$(field Version "$v1")" = 0.1.0-1 ] && [ "$(field Version "$v2")" = 0.1.0-2 ] || fail "Version fields"
depends=$(field Depends "$v1")
for dep in qemu-utils nftables iproute2 libc6; do
  [[ ", $depends," == *", $dep"[\ ,\(]* ]] || fail "Depends ($depends) lacks $dep"
done
[[ "$(field Recommends "$v1")" == *qemu-server*proxmox-backup-client* ]] || fail "Recommends"
package_digest=$(field X-Certistack-Surface-Digest "$v1")
[ "$package_digest" = "$controller_digest" ] || fail "the control field says $package_digest, certistack-ctl $controller_digest"
check_control "$v1" /etc/certistack/connector.toml certistack-connector
stripped_binary "$v1" ./usr/sbin/certistack-connector "$work/packaged-connector"

step "the packaged binary carries its dependency list (cargo auditable), matching Cargo.lock"
objcopy --dump-section .dep-v0="$work/dep-v0" "$work/packaged-connector" "$work/objcopy-out" 2>&1
[ -s "$work/dep-v0" ] || fail "the packaged binary has no .dep-v0 section: build with cargo auditable build --release --locked --bins"
dependency_list_matches() {
python3 - "$@" <<'PY'
import json, sys, tomllib, zlib
embedded = json.loads(zlib.decompress(open(sys.argv[1], "rb").read()))["packages"]
root_crate, absent = sys.argv[3], sys.argv[4:]
locked = {(p["name"], p["version"]) for p in tomllib.load(open(sys.argv[2], "rb"))["package"]}
stray = [(p["name"], p["version"]) for p in embedded if (p["name"], p["version"]) not in locked]
assert not stray, f"embedded but not in Cargo.lock: {stray}"
roots = [p["name"] for p in embedded if p.get("root")]
assert roots == [root_crate], f"root packages: {roots}"
versions = {}
for p in embedded:
    versions.setdefault(p["name"], []).append(p["version"])
for crate in ("tonic", "rustls", "tokio", "prost", "ring"):
    assert crate in versions, f"{crate} is linked in but not listed"
for other in absent:
    assert other not in versions, f"{other} is not in the {root_crate} binary but is listed"
print(f"{root_crate}: {len(embedded)} crates embedded, each at its Cargo.lock version; "
      + ", ".join(f"{c} {'/'.join(versions[c])}" for c in ("tonic", "rustls", "tokio")))
PY
}
dependency_list_matches "$work/dep-v0" Cargo.lock certistack-connector certistack-tests certistack-controller \
  || fail "the connector's embedded dependency list does not match Cargo.lock"
echo "inspection ok: modes, owners, Depends ($depends), X-Certistack-Surface-Digest $package_digest"

step "inspect the controller's package: files, modes, control fields, conffile, maintainer scripts, dependency list"
listing=$(dpkg-deb --contents "$c1")
echo "$listing"
expect_entry -rwxr-xr-x ./usr/bin/certistack-ctl
expect_entry -rw-r--r-- ./usr/lib/systemd/system/certistack-controller.service
expect_entry -rw-r--r-- ./usr/lib/systemd/system/certistack-controller.timer
expect_entry -rw-r--r-- ./usr/lib/sysusers.d/certistack-controller.conf
expect_entry -rw-r----- ./etc/certistack/controller.toml
expect_entry -rw-r--r-- ./usr/share/doc/certistack-controller/examples/plan.yaml
expect_entry -rw-r--r-- ./usr/share/doc/certistack-controller/install.md
expect_entry -rw-r--r-- ./usr/share/doc/certistack-controller/copyright
[ "$(field Package "$c1")" = certistack-controller ] && [ "$(field Version "$c1")" = 0.1.0-1 ] || fail "the controller's Package or Version field"
[ "$(field X-Certistack-Surface-Digest "$c1")" = "$controller_digest" ] || fail "the controller's surface field: $(field X-Certistack-Surface-Digest "$c1")"
[[ ", $(field Depends "$c1")," == *", libc6"[\ ,\(]* ]] || fail "the controller's Depends: $(field Depends "$c1")"
check_control "$c1" /etc/certistack/controller.toml certistack-controller
stripped_binary "$c1" ./usr/bin/certistack-ctl "$work/packaged-ctl"
objcopy --dump-section .dep-v0="$work/ctl-dep-v0" "$work/packaged-ctl" "$work/objcopy-ctl-out" 2>&1
dependency_list_matches "$work/ctl-dep-v0" Cargo.lock certistack-controller certistack-tests certistack-connector \
  || fail "the controller's embedded dependency list does not match Cargo.lock"
chmod 0755 "$work/packaged-ctl"
"$work/packaged-ctl" surface | grep -qx "digest: $controller_digest" || fail "the packaged certistack-ctl speaks another surface"

step "sign with certistack-ctl; verify with certistack-ctl and with Debian's minisign"
printf 'package signing test password\n' > "$work/password"
"$ctl" package keygen --secret-key "$work/sign.key" --public-key "$work/sign.pub" --password-file "$work/password"
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$v1"
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$v2"
grep -q "^trusted comment: .*package:certistack-connector	version:0.1.0-1	surface:$controller_digest$" "$v1.minisig" \
  || fail "the trusted comment does not name package, version and surface: $(cat "$v1.minisig")"
"$ctl" package verify --pubkey "$work/sign.pub" "$v1"
minisign -V -q -p "$work/sign.pub" -m "$v1"
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$c1"
verified=$("$ctl" package verify --pubkey "$work/sign.pub" "$c1")
[[ "$verified" == *"is certistack-controller 0.1.0-1 (surface $controller_digest)"*"speaks this controller's surface"* ]] || fail "the controller's verification: $verified"
minisign -V -q -p "$work/sign.pub" -m "$c1"
echo "minisign -V: ok (connector and controller)"

step "one changed byte in the package: both verifiers refuse"
cp "$v1" "$work/changed.deb"; cp "$v1.minisig" "$work/changed.deb.minisig"
size=$(stat -c %s "$work/changed.deb")
offset=$((size / 2))
byte=$(dd if="$work/changed.deb" bs=1 skip="$offset" count=1 status=none | od -An -tu1 | tr -d ' ')
printf "$(printf '\\%03o' $(((byte + 1) % 256)))" | dd of="$work/changed.deb" bs=1 seek="$offset" conv=notrunc status=none
expect_fail "$ctl" package verify --pubkey "$work/sign.pub" "$work/changed.deb"
[[ "$out" == *"does not verify"*"do not install it"* ]] || fail "certistack-ctl's refusal: $out"
set +e; "$ctl" package verify --pubkey "$work/sign.pub" "$work/changed.deb" >/dev/null 2>&1; code=$?; set -e
[ "$code" = 4 ] || fail "a refused package exits 4, not $code"
expect_fail minisign -V -q -p "$work/sign.pub" -m "$work/changed.deb"
echo "changed package refused by both"

step "one changed byte in the signature: both verifiers refuse"
cp "$v1" "$work/resigned.deb"
awk 'NR == 2 { c = substr($0, 40, 1); $0 = substr($0, 1, 39) (c == "A" ? "B" : "A") substr($0, 41) } { print }' \
  "$v1.minisig" > "$work/resigned.deb.minisig"
cmp -s "$v1.minisig" "$work/resigned.deb.minisig" && fail "the signature was not changed"
expect_fail "$ctl" package verify --pubkey "$work/sign.pub" "$work/resigned.deb"
expect_fail minisign -V -q -p "$work/sign.pub" -m "$work/resigned.deb"
echo "changed signature refused by both"

step "a package for another surface: signed and valid for minisign, refused by certistack-ctl"
dpkg-deb --raw-extract "$v1" "$work/other"
sed -i "s/^X-Certistack-Surface-Digest: .*/X-Certistack-Surface-Digest: sha256:$(printf '0%.0s' $(seq 64))/" "$work/other/DEBIAN/control"
dpkg-deb --root-owner-group -Zgzip --build "$work/other" "$work/other.deb" >/dev/null
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$work/other.deb"
minisign -V -q -p "$work/sign.pub" -m "$work/other.deb"
expect_fail "$ctl" package verify --pubkey "$work/sign.pub" "$work/other.deb"
[[ "$out" == *"would fail the audit"*"install the connector release built with this certistack-ctl"* ]] || fail "certistack-ctl's refusal: $out"
echo "other surface refused: $out"

step "the repository key signs only verified connector packages: a planted package, a rollback copy, stray files (tests/packaging/repository.sh)"
CERTISTACK_CTL="$ctl" bash tests/packaging/repository.sh

step "publish a signed apt repository (OpenPGP Ed25519)"
export GNUPGHOME="$work/gnupg"   # gpg-agent sockets for this test only
export CERTISTACK_CTL="$ctl"
fpr=$(packaging/publish-repo keygen "$GNUPGHOME" "CertiStack test archive <archive@certistack.invalid>")
gpg --homedir "$GNUPGHOME" --batch --list-keys --with-colons "$fpr" | grep -q '^pub:[^:]*:255:22:' || fail "the repository key is not Ed25519"

step "publish-repo refuses an unsigned package, a mis-signed one and one signed by another key"
cp "$v1" "$work/unsigned.deb"
expect_fail packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/refused-repo" "$v2" "$work/unsigned.deb"
[[ "$out" == *"unsigned.deb has no signature"*"nothing was published"* ]] || fail "publish-repo's refusal: $out"
[ ! -e "$work/refused-repo/pool" ] || fail "a refused publish copied packages: $(find "$work/refused-repo")"
[ -z "$(find "$work/refused-repo" -mindepth 1)" ] || fail "a refused publish left files: $(find "$work/refused-repo")"
cp "$v2.minisig" "$work/unsigned.deb.minisig"   # a real signature, of another package
expect_fail packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/refused-repo" "$work/unsigned.deb"
[[ "$out" == *"does not verify"*"nothing was published"* ]] || fail "publish-repo's refusal: $out"
"$ctl" package keygen --secret-key "$work/other-sign.key" --public-key "$work/other-sign.pub"
expect_fail packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/other-sign.pub" "$work/refused-repo" "$v1"
[[ "$out" == *"does not verify"*"nothing was published"* ]] || fail "publish-repo's refusal: $out"
[ ! -e "$work/refused-repo/dists" ] || fail "a refused publish wrote indexes"
echo "unsigned, mis-signed and other-key packages: refused before anything was published"

packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo" "$v1" "$c1"
cmp "$v1" "$work/repo/pool/main/c/certistack-connector/$(basename "$v1")" || fail "the published package is not the verified one"
cmp "$c1" "$work/repo/pool/main/c/certistack-controller/$(basename "$c1")" || fail "the published controller is not the verified one"
[ -z "$(find "$work/repo" -name '.publish.*')" ] || fail "publish-repo left its staging directory"
release_file="$work/repo/dists/stable/Release"
date_s=$(date -d "$(sed -n 's/^Date: //p' "$release_file")" +%s)
until_s=$(date -d "$(sed -n 's/^Valid-Until: //p' "$release_file")" +%s) || fail "the Release has no Valid-Until"
[ $((until_s - date_s)) = $((30 * 86400)) ] || fail "Valid-Until is $((until_s - date_s)) s after Date, not 30 days"
VALID_DAYS=7 packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo"
until_s=$(date -d "$(sed -n 's/^Valid-Until: //p' "$release_file")" +%s)
date_s=$(date -d "$(sed -n 's/^Date: //p' "$release_file")" +%s)
[ $((until_s - date_s)) = $((7 * 86400)) ] || fail "VALID_DAYS=7 gave Valid-Until $((until_s - date_s)) s after Date"
packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo"
echo "Release valid for 30 days by default, VALID_DAYS sets it: $(grep -E '^(Date|Valid-Until):' "$release_file" | tr '\n' ' ')"
other_fpr=$(packaging/publish-repo keygen "$work/gnupg-other" "Another archive <other@certistack.invalid>")

step "a throwaway $suite_debian root (mmdebstrap, cached in target/packaging)"
base_root
mkdir -p "$chroot_dir"
tar -C "$chroot_dir" -xf "$cache/$suite_debian-base.tar"
mkdir -p "$chroot_dir/srv/repo" "$chroot_dir/etc/apt/keyrings"
mount --bind "$work/repo" "$chroot_dir/srv/repo"
mount -t proc proc "$chroot_dir/proc"
in_root() { chroot "$chroot_dir" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"; }
# Only our repository: the dependencies are in the cached root, so nothing is downloaded.
rm -f "$chroot_dir/etc/apt/sources.list" "$chroot_dir"/etc/apt/sources.list.d/*
cat > "$chroot_dir/etc/apt/sources.list.d/certistack.sources" <<'SOURCES'
Types: deb
URIs: file:/srv/repo
Suites: stable
Components: main
Signed-By: /etc/apt/keyrings/certistack-archive-keyring.gpg
SOURCES
apt_update() { rm -rf "$chroot_dir"/var/lib/apt/lists/*; in_root apt-get update -q; }

step "apt refuses the repository signed by another key"
gpg --homedir "$work/gnupg-other" --batch --export "$other_fpr" > "$chroot_dir/etc/apt/keyrings/certistack-archive-keyring.gpg"
expect_fail apt_update
[[ "$out" == *"NO_PUBKEY"* || "$out" == *"not signed"* || "$out" == *"Missing key"* || "$out" == *"signature"* ]] || fail "apt's refusal: $out"
echo "another key: refused"
cp "$work/repo/certistack-archive-keyring.gpg" "$chroot_dir/etc/apt/keyrings/"

step "apt refuses a tampered Packages index"
packages="$work/repo/dists/stable/main/binary-amd64/Packages"
cp "$packages" "$work/Packages.orig"; cp "$packages.gz" "$work/Packages.gz.orig"
sed -i 's/^Priority: optional/Priority: required/' "$packages"; gzip -9 -n -k -f "$packages"
expect_fail apt_update
[[ "$out" == *"Hash Sum mismatch"* || "$out" == *"hash"* || "$out" == *"Hashes"* ]] || fail "apt's refusal: $out"
echo "tampered Packages: refused"
cp "$work/Packages.orig" "$packages"; cp "$work/Packages.gz.orig" "$packages.gz"

step "apt refuses an expired Release (a frozen or replayed repository)"
cp -a "$work/repo" "$work/repo.current"
# The same repository as it was signed long ago: apt-ftparchive takes Date and Valid-Until
# from its configuration, so the publisher's clock is set back, not the file edited.
cat > "$work/apt-old-clock.conf" <<'APTCONF'
APT::FTPArchive::Release::Date "Mon, 01 Jan 2024 00:00:00 +0000";
APT::FTPArchive::Release::Valid-Until "Wed, 31 Jan 2024 00:00:00 +0000";
APTCONF
APT_CONFIG="$work/apt-old-clock.conf" packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo"
grep -q '^Valid-Until: Wed, 31 Jan 2024' "$work/repo/dists/stable/InRelease" || fail "the replayed Release is not from 2024"
expect_fail apt_update
[[ "$out" == *"expired"* ]] || fail "apt's refusal of an expired Release: $out"
echo "expired Release: refused ($(echo "$out" | grep -m1 -i expired))"
rm -rf "$work/repo"/*; cp -a "$work/repo.current"/. "$work/repo"/; rm -rf "$work/repo.current"

step "apt-get update and install with signed-by="
apt_update
in_root apt-get install -y -q certistack-connector
in_root dpkg-query -W -f '${Status} ${Version}\n' certistack-connector | grep -qx 'install ok installed 0.1.0-1' || fail "not installed"
mode() { stat -c '%a %U:%G' "$chroot_dir$1"; }
[ "$(mode /var/lib/certistack)" = "700 root:root" ] || fail "/var/lib/certistack is $(mode /var/lib/certistack)"
[ "$(mode /etc/certistack/connector.toml)" = "640 root:root" ] || fail "connector.toml is $(mode /etc/certistack/connector.toml)"
[ "$(mode /usr/sbin/certistack-connector)" = "755 root:root" ] || fail "the binary is $(mode /usr/sbin/certistack-connector)"
[ -f "$chroot_dir/usr/lib/systemd/system/certistack-connector.service" ] || fail "the unit is missing"
if [ -x "$chroot_dir/usr/bin/systemd-sysusers" ]; then
  for n in 1 2 3 4; do
    in_root getent passwd "certistack-guestnet-$n" | grep -q ':/nonexistent:/usr/sbin/nologin$' ||
      fail "postinst made no appliance user certistack-guestnet-$n"
  done
  echo "appliance users: $(in_root getent passwd certistack-guestnet-1 certistack-guestnet-2 certistack-guestnet-3 certistack-guestnet-4 | cut -d: -f1,3 | tr '\n' ' ')"
else
  echo "no systemd-sysusers in the root: the appliance user comes with systemd's first sysusers run"
fi
if [ -x "$chroot_dir/usr/bin/deb-systemd-helper" ]; then
  [ -L "$chroot_dir/etc/systemd/system/multi-user.target.wants/certistack-connector.service" ] || fail "the unit is not enabled"
  echo "unit enabled (deb-systemd-helper), not started (no systemd in the root; and not enrolled)"
else
  echo "no deb-systemd-helper in the root: postinst enabled nothing and said so"
fi

step "the installed daemon answers Hello with the digest its package declares"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
node="$work/node"; mkdir -p "$node"
cat > "$node/connector.toml" <<CONF
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
CONF
installed="$chroot_dir/usr/sbin/certistack-connector"
"$ctl" ca init --state-dir "$work/ctl" > "$work/ca-init.txt"
fingerprint=$(sed -n 's/^CA fingerprint: //p' "$work/ca-init.txt")
"$installed" --config "$node/connector.toml" enroll --csr > "$work/node.csr"
"$ctl" node sign --state-dir "$work/ctl" --node pve1 --csr "$work/node.csr" --out "$work/node-issued.crt" >/dev/null
"$installed" --config "$node/connector.toml" enroll --install --certificate "$work/node-issued.crt" \
  --ca "$work/ctl/ca.crt" --ca-fingerprint "$fingerprint" --run-authority "$work/ctl/run-authority.pub" >/dev/null
"$installed" --config "$node/connector.toml" serve 2> "$work/connector.log" &
daemon=$!
hello=""
for _ in $(seq 1 100); do
  if hello=$("$ctl" hello --state-dir "$work/ctl" --node "127.0.0.1:$port" --name pve1 2>&1); then break; fi
  sleep 0.1
done
echo "$hello"
served=$(echo "$hello" | sed -n 's/^surface: \(sha256:[0-9a-f]*\).*/\1/p')
[ "$served" = "$package_digest" ] || fail "the installed daemon serves ${served:-nothing}, the package declares $package_digest (log: $(cat "$work/connector.log"))"
kill -TERM "$daemon"; wait "$daemon"; daemon=""
echo "installed daemon: Hello with $served"

step "maintainer scripts: reinstall keeps configuration and state"
echo '# operator edit' >> "$chroot_dir/etc/certistack/connector.toml"
mkdir -p "$chroot_dir/var/lib/certistack/runs/run-a"
echo 1 > "$chroot_dir/var/lib/certistack/runs/run-a/closed"
chmod 0755 "$chroot_dir/var/lib/certistack"   # a mode changed by hand is put back
in_root apt-get install -y -q --reinstall certistack-connector
grep -q '^# operator edit' "$chroot_dir/etc/certistack/connector.toml" || fail "reinstall lost the configuration"
[ -f "$chroot_dir/var/lib/certistack/runs/run-a/closed" ] || fail "reinstall lost the state"
[ "$(mode /var/lib/certistack)" = "700 root:root" ] || fail "reinstall left /var/lib/certistack $(mode /var/lib/certistack)"

step "maintainer scripts: upgrade to 0.1.0-2 from the repository keeps configuration and state"
packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo" "$v2"
apt_update
in_root apt-get install -y -q certistack-connector
in_root dpkg-query -W -f '${Version}' certistack-connector | grep -qx 0.1.0-2 || fail "not upgraded"
grep -q '^# operator edit' "$chroot_dir/etc/certistack/connector.toml" || fail "upgrade lost the configuration"
[ -f "$chroot_dir/var/lib/certistack/runs/run-a/closed" ] || fail "upgrade lost the state"

step "maintainer scripts: remove keeps configuration, enrollment and state"
echo "enrolled" > "$chroot_dir/etc/certistack/node.crt"
# The operator moved the run registry: purge must look there, not only in /var/lib/certistack.
moved=/srv/certistack-state
sed -i "s|^state_dir = .*|state_dir = \"$moved\"|" "$chroot_dir/etc/certistack/connector.toml"
grep -q "^state_dir = \"$moved\"" "$chroot_dir/etc/certistack/connector.toml" || fail "the test could not move state_dir"
# A comment on the table's header line must not hide the table from purge.
sed -i 's|^\[paths\]$|[paths]   # moved by the operator|' "$chroot_dir/etc/certistack/connector.toml"
grep -q '^\[paths\]   # moved' "$chroot_dir/etc/certistack/connector.toml" || fail "the test could not comment the [paths] header"
in_root apt-get remove -y -q certistack-connector
in_root dpkg-query -W -f '${Status}' certistack-connector | grep -qx 'deinstall ok config-files' || fail "not in config-files state"
[ ! -e "$chroot_dir/usr/sbin/certistack-connector" ] || fail "remove left the binary"
[ ! -e "$chroot_dir/usr/lib/systemd/system/certistack-connector.service" ] || fail "remove left the unit"
grep -q '^# operator edit' "$chroot_dir/etc/certistack/connector.toml" || fail "remove lost the configuration"
[ -f "$chroot_dir/etc/certistack/node.crt" ] || fail "remove lost the enrollment"
[ -f "$chroot_dir/var/lib/certistack/runs/run-a/closed" ] || fail "remove lost the state"

step "maintainer scripts: purge refuses while a run is open in the configured state directory"
mkdir -p "$chroot_dir$moved/runs/run-moved"
expect_fail in_root dpkg --purge certistack-connector
echo "$out"
[[ "$out" == *"runs still open"*"$moved/runs/run-moved"*"certistack-ctl cleanup"* ]] || fail "purge's refusal: $out"
[ -d "$chroot_dir$moved/runs/run-moved" ] || fail "a refused purge removed the open run"
[ -f "$chroot_dir/etc/certistack/node.crt" ] || fail "a refused purge removed the enrollment"

step "maintainer scripts: reinstall after a refused purge restores the configuration, and never overwrites an edited copy"
in_root apt-get install -y -q certistack-connector
operator="$chroot_dir/etc/certistack/connector.toml.operator"
grep -q '^# operator edit' "$operator" || fail "the configuration before the refused purge was not restored as connector.toml.operator"
echo '# edited after the restore' >> "$operator"
in_root apt-get remove -y -q certistack-connector
expect_fail in_root dpkg --purge certistack-connector
[[ "$out" == *"$moved/runs/run-moved"* ]] || fail "the second purge's refusal (state_dir named by connector.toml.operator): $out"
in_root apt-get install -y -q certistack-connector
grep -q '^# edited after the restore' "$operator" || fail "a reinstall overwrote the operator's edited connector.toml.operator"
[ -f "$operator.1" ] || fail "the second refused purge's configuration was not restored beside it as connector.toml.operator.1"
echo "restored copies: $(cd "$chroot_dir/etc/certistack" && ls connector.toml.operator*)"
in_root apt-get install -y -q --reinstall certistack-connector
grep -q '^# edited after the restore' "$operator" || fail "a further reinstall changed connector.toml.operator"
[ ! -e "$operator.2" ] || fail "a reinstall without a refused purge wrote another copy"
in_root apt-get remove -y -q certistack-connector

step "maintainer scripts: purge refuses while a run is open in the default state directory"
echo 1 > "$chroot_dir$moved/runs/run-moved/closed"
mkdir -p "$chroot_dir/var/lib/certistack/runs/run-open"
expect_fail in_root dpkg --purge certistack-connector
[[ "$out" == *"runs still open"*"/var/lib/certistack/runs/run-open"*"certistack-ctl cleanup"* ]] || fail "purge's refusal: $out"
[ -d "$chroot_dir/var/lib/certistack/runs/run-open" ] || fail "a refused purge removed the open run"

step "maintainer scripts: once the runs are closed, purge removes configuration, enrollment and state"
echo 1 > "$chroot_dir/var/lib/certistack/runs/run-open/closed"
in_root dpkg --purge certistack-connector 2> "$work/purge.err"
cat "$work/purge.err"
in_root dpkg-query -W certistack-connector 2>/dev/null && fail "still known to dpkg after purge"
[ ! -e "$chroot_dir/var/lib/certistack" ] || fail "purge left /var/lib/certistack"
[ ! -e "$chroot_dir/etc/certistack" ] || fail "purge left /etc/certistack: $(ls -la "$chroot_dir/etc/certistack")"
[ ! -e "$chroot_dir/etc/systemd/system/multi-user.target.wants/certistack-connector.service" ] || fail "purge left the enablement"
[ -d "$chroot_dir$moved" ] && grep -q "kept the configured state directory $moved" "$work/purge.err" \
  || fail "purge removed the operator's state directory $moved or did not say it kept it"

step "install again after purge (a fresh install on a used node)"
in_root apt-get install -y -q certistack-connector
[ "$(mode /var/lib/certistack)" = "700 root:root" ] || fail "fresh install: /var/lib/certistack"

step "the controller from the repository: its user, its state directory, its configuration, not scheduled"
# Owners as the root's own users and groups name them.
in_mode() { in_root stat -c '%a %U:%G' "$1"; }
in_root apt-get install -y -q certistack-controller 2> "$work/controller-install.err"
cat "$work/controller-install.err"
in_root dpkg-query -W -f '${Status} ${Version}\n' certistack-controller | grep -qx 'install ok installed 0.1.0-1' || fail "the controller is not installed"
[ "$(mode /usr/bin/certistack-ctl)" = "755 root:root" ] || fail "certistack-ctl is $(mode /usr/bin/certistack-ctl)"
grep -q 'systemctl enable --now certistack-controller.timer' "$work/controller-install.err" || fail "postinst did not say how to schedule the controller"
if [ ! -x "$chroot_dir/usr/bin/systemd-sysusers" ]; then
  # Without systemd (an OCI image), postinst says how to make the user; doing so works.
  said=$(grep 'the user certistack-ctl could not be made' "$work/controller-install.err") \
    || fail "without systemd-sysusers, postinst did not say the user is missing"
  [ "$(in_mode /var/lib/certistack-ctl)" = "700 root:root" ] || fail "without the user, /var/lib/certistack-ctl is $(in_mode /var/lib/certistack-ctl)"
  useradd_line=$(echo "$said" | sed -n 's/.*create it (\(useradd [^)]*\)).*/\1/p')
  [ -n "$useradd_line" ] || fail "postinst's advice names no useradd: $said"
  # shellcheck disable=SC2086
  in_root $useradd_line
  in_root dpkg-reconfigure certistack-controller
  echo "no systemd-sysusers in this root: postinst said to run $useradd_line, which made the user"
fi
in_root getent passwd certistack-ctl | grep -q ':/var/lib/certistack-ctl:/usr/sbin/nologin$' || fail "no user certistack-ctl: $(in_root getent passwd certistack-ctl)"
[ "$(in_mode /var/lib/certistack-ctl)" = "700 certistack-ctl:certistack-ctl" ] || fail "/var/lib/certistack-ctl is $(in_mode /var/lib/certistack-ctl)"
[ "$(in_mode /etc/certistack/controller.toml)" = "640 root:certistack-ctl" ] || fail "controller.toml is $(in_mode /etc/certistack/controller.toml)"
echo "user $(in_root getent passwd certistack-ctl | cut -d: -f1,6,7); state directory $(in_mode /var/lib/certistack-ctl); controller.toml $(in_mode /etc/certistack/controller.toml)"
# The installed certistack-ctl reads the example configuration as its user.
in_root runuser -u certistack-ctl -- certistack-ctl history --config /etc/certistack/controller.toml > "$work/ctl-history.txt" \
  || fail "certistack-ctl as its user refused the example configuration: $(cat "$work/ctl-history.txt")"
grep -q 'no validation in the history' "$work/ctl-history.txt" || fail "history on a fresh install: $(cat "$work/ctl-history.txt")"
[ ! -e "$chroot_dir/etc/systemd/system/timers.target.wants/certistack-controller.timer" ] || fail "installing scheduled the timer"

step "the controller: purge keeps a state directory that holds the CA, and removes one that does not"
echo "a CA key" > "$chroot_dir/var/lib/certistack-ctl/ca.key"
in_root apt-get remove -y -q certistack-controller
[ -f "$chroot_dir/etc/certistack/controller.toml" ] || fail "remove lost the controller's configuration"
in_root dpkg --purge certistack-controller 2> "$work/controller-purge.err"
grep -q 'kept /var/lib/certistack-ctl: it holds the CA your nodes trust' "$work/controller-purge.err" || fail "purge did not say it kept the CA: $(cat "$work/controller-purge.err")"
[ -f "$chroot_dir/var/lib/certistack-ctl/ca.key" ] || fail "purge removed the CA"
[ ! -e "$chroot_dir/etc/certistack/controller.toml" ] || fail "purge left controller.toml"
rm "$chroot_dir/var/lib/certistack-ctl/ca.key"
in_root apt-get install -y -q certistack-controller 2>/dev/null
in_root apt-get purge -y -q certistack-controller
[ ! -e "$chroot_dir/var/lib/certistack-ctl" ] || fail "purge left a state directory without a CA"
[ -f "$chroot_dir/etc/certistack/connector.toml" ] || fail "the controller's purge touched the connector's configuration"

step "the controller under systemd: the systemd tests' root, booted, runs the service once as its user"
systemd_root="$root/target/nspawn/systemd-root"
bash tests/systemd/container-root.sh "$systemd_root"
machine="csctl-$$"
systemd-nspawn -D "$systemd_root" --volatile=overlay -b --register=no --keep-unit --console=passive -M "$machine" \
  --bind-ro="$c1:/srv/certistack-controller.deb" >"$work/nspawn.log" 2>&1 &
nspawn=$!
leader=""
for _ in $(seq 1 300); do
  leader=$(for pid in $(cat "/proc/$nspawn/task/$nspawn/children" 2>/dev/null); do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = systemd ] && echo "$pid"; done | head -n 1)
  [ -n "$leader" ] && break
  sleep 0.1
done
[ -n "$leader" ] || fail "systemd-nspawn started no container: $(cat "$work/nspawn.log")"
inside() { nsenter -t "$leader" -a -- "$@"; }
stop_container() {
  inside systemctl poweroff >/dev/null 2>&1 || true
  for _ in $(seq 1 100); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$nspawn" 2>/dev/null || true
  wait "$nspawn" 2>/dev/null || true
  nspawn=""
}
state=""
for _ in $(seq 1 300); do
  state=$(inside systemctl is-system-running --wait 2>/dev/null || true)
  [ "$state" = running ] || [ "$state" = degraded ] && break
  sleep 0.1
done
[ "$state" = running ] || [ "$state" = degraded ] || { stop_container; fail "the container's systemd: $state"; }
controller_test() {
  inside dpkg -i /srv/certistack-controller.deb >"$work/dpkg-in-container.log" 2>&1 || { cat "$work/dpkg-in-container.log"; return 1; }
  inside getent passwd certistack-ctl | grep -q ':/var/lib/certistack-ctl:' || { echo "no user certistack-ctl"; return 1; }
  # The operator's first steps, as the controller's user: the CA, a plan, a node in the
  # configuration. The node's port is closed: the run fails fast, as a night with that node
  # down would.
  inside runuser -u certistack-ctl -- certistack-ctl ca init --state-dir /var/lib/certistack-ctl >/dev/null
  closed=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  inside sh -c "printf '\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = $closed\n' >> /etc/certistack/controller.toml"
  inside runuser -u certistack-ctl -- sh -c 'umask 077; printf "s3cret\n" > /var/lib/certistack-ctl/pbs-token'
  inside runuser -u certistack-ctl -- sh -c "sed -e 's/snapshot: latest/snapshot: \"2026-12-01T02:00:00Z\"/' -e '/max_age_hours/d' -e 's/^    probes:/    archives: [drive-scsi0.img]\n    probes:/' -e '/^    sandbox:/,/^      - vmid/s/- vmid: 9100/- vmid: 9100\n        cores: 1\n        memory_mib: 512/' /usr/share/doc/certistack-controller/examples/plan.yaml > /var/lib/certistack-ctl/plan.yaml"
  inside runuser -u certistack-ctl -- certistack-ctl plan check --offline --config /etc/certistack/controller.toml /var/lib/certistack-ctl/plan.yaml \
    || { echo "the plan made from the example is refused"; return 1; }
  inside systemctl start certistack-controller.service && { echo "the run against a closed port succeeded"; return 1; }
  local result status user history
  result=$(inside systemctl show -p Result --value certistack-controller.service)
  status=$(inside systemctl show -p ExecMainStatus --value certistack-controller.service)
  user=$(inside systemctl show -p User --value certistack-controller.service)
  echo "certistack-controller.service: Result=$result ExecMainStatus=$status User=$user"
  [ "$result" = exit-code ] && [ "$status" = 2 ] && [ "$user" = certistack-ctl ] || { inside journalctl -u certistack-controller --no-pager | tail -20; return 1; }
  inside journalctl -u certistack-controller --no-pager | tail -n 8
  # What it wrote is its user's: the history and the run lock in the state directory.
  for file in history.sqlite run.lock; do
    [ "$(inside stat -c '%U %a' "/var/lib/certistack-ctl/$file")" = "certistack-ctl 600" ] \
      || { echo "/var/lib/certistack-ctl/$file is $(inside stat -c '%U %a' "/var/lib/certistack-ctl/$file")"; return 1; }
  done
  history=$(inside runuser -u certistack-ctl -- certistack-ctl history --config /etc/certistack/controller.toml 100 --json)
  python3 -c 'import json, sys
page = json.loads(sys.argv[1])
rows = page["validations"]
assert len(rows) == 1 and rows[0]["state"] == "error" and rows[0]["node"] == "pve1", rows
print("history row:", rows[0]["validation"], rows[0]["state"], rows[0]["node"], "; ".join(rows[0]["reasons"])[:200])' "$history" || return 1
  # The timer, enabled as install.md says: systemd lists its next run.
  inside systemctl enable --now certistack-controller.timer >/dev/null 2>&1
  inside systemctl list-timers --all --no-pager certistack-controller.timer | tee "$work/timers.txt"
  grep -q 'certistack-controller.timer' "$work/timers.txt" && grep -q 'certistack-controller.service' "$work/timers.txt" \
    || { echo "list-timers does not show the timer"; return 1; }
  [ -n "$(inside systemctl show -p NextElapseUSecRealtime --value certistack-controller.timer)" ] || { echo "the timer has no next run"; return 1; }
  # A second run while one holds the state directory's run lock is refused, as the timer's
  # start during an operator's run would be.
  inside runuser -u certistack-ctl -- flock /var/lib/certistack-ctl/run.lock sleep 30 >/dev/null 2>&1 &
  local holder=$!
  sleep 1
  inside systemctl start certistack-controller.service && { echo "a run started while the lock was held"; return 1; }
  status=$(inside systemctl show -p ExecMainStatus --value certistack-controller.service)
  kill "$holder" 2>/dev/null || true
  inside pkill -f 'flock /var/lib/certistack-ctl/run.lock' || true
  wait "$holder" 2>/dev/null || true
  [ "$status" = 75 ] || { echo "a run while the lock was held exited $status, not 75"; return 1; }
  echo "a second run while the run lock is held: exit 75"
  inside systemd-analyze security --no-pager certistack-controller.service > "$work/controller-security.txt" || true
  grep -v '^✓' "$work/controller-security.txt"
  local exposure
  exposure=$(sed -n 's/.*Overall exposure level for certistack-controller.service: \([0-9.]*\).*/\1/p' "$work/controller-security.txt")
  python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= 2.5 else 1)' "${exposure:-99}" || { echo "exposure ${exposure:-unknown} is above 2.5"; return 1; }
  echo "certistack-controller.service exposure: $exposure (the connector's, offline: $(systemd-analyze security --offline=true --no-pager packaging/certistack-connector.service 2>/dev/null | sed -n 's/.*Overall exposure level for certistack-connector.service: //p'))"
}
if ! controller_test; then stop_container; fail "the controller under systemd (above)"; fi
stop_container

echo "packaging: built, inspected, signed, verified by both tools, published, installed with signed-by=, cycled through reinstall, upgrade, remove and purge; the installed daemon served $served; the controller installed, purged (its CA kept), and ran once under systemd as certistack-ctl"
