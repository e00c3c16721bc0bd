#!/usr/bin/env bash
# The connector's Debian package, end to end, with real tools: build it from the release build,
# inspect it with dpkg-deb, sign it with certistack-ctl and verify it with both certistack-ctl
# and Debian's minisign (and see both refuse a changed byte and certistack-ctl refuse another
# surface), publish a signed apt repository (and see it refuse to sign anything it did not
# verify: repository.sh), install from it into a throwaway Debian root with signed-by= (and see
# apt refuse a tampered index and another key), run the maintainer scripts through install,
# reinstall, upgrade, remove and purge, and have the installed daemon answer Hello with the
# digest the package declares. Exits non-zero on the first failure.
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
cleanup() {
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

step "build the package twice (revisions 1 and 2, for the upgrade)"
v1=$(packaging/build-deb "$work/v1")
v2=$(DEB_REVISION=2 packaging/build-deb "$work/v2")
ls -l "$v1" "$v2"
again=$(packaging/build-deb "$work/again")
[ "$(sha256sum < "$v1")" = "$(sha256sum < "$again")" ] || fail "two packagings of the same build differ"
echo "the packaging step is reproducible: $(sha256sum "$v1" | cut -c1-64)"
echo "package size: $(stat -c %s "$v1") bytes"

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
dpkg-deb --ctrl-tarfile "$v1" | tar -xO ./conffiles | grep -qx /etc/certistack/connector.toml || fail "connector.toml is not a conffile"
for script in postinst prerm postrm; do
  dpkg-deb --ctrl-tarfile "$v1" | tar -tv "./$script" | grep -q '^-rwxr-xr-x root/root' || fail "$script missing or not 0755"
done
dpkg-deb --fsys-tarfile "$v1" | tar -xO ./usr/sbin/certistack-connector > "$work/packaged-connector"
readelf -S "$work/packaged-connector" | grep -q '\.symtab' && fail "the packaged binary is not stripped"

step "the packaged binary carries its dependency list (cargo auditable), matching Cargo.lock"
objcopy --dump-section .dep-v0="$work/dep-v0" "$work/packaged-connector" "$work/objcopy-out" 2>&1
[ -s "$work/dep-v0" ] || fail "the packaged binary has no .dep-v0 section: build with cargo auditable build --release --locked --bins"
python3 - "$work/dep-v0" Cargo.lock <<'PY' || fail "the embedded dependency list does not match Cargo.lock"
import json, sys, tomllib, zlib
embedded = json.loads(zlib.decompress(open(sys.argv[1], "rb").read()))["packages"]
locked = {(p["name"], p["version"]) for p in tomllib.load(open(sys.argv[2], "rb"))["package"]}
stray = [(p["name"], p["version"]) for p in embedded if (p["name"], p["version"]) not in locked]
assert not stray, f"embedded but not in Cargo.lock: {stray}"
roots = [p["name"] for p in embedded if p.get("root")]
assert roots == ["certistack-connector"], f"root packages: {roots}"
versions = {}
for p in embedded:
    versions.setdefault(p["name"], []).append(p["version"])
for crate in ("tonic", "rustls", "tokio", "prost", "ring"):
    assert crate in versions, f"{crate} is linked in but not listed"
for crate in ("certistack-tests", "certistack-controller"):
    assert crate not in versions, f"{crate} is not in the connector binary but is listed"
print(f"{len(embedded)} crates embedded, each at its Cargo.lock version; "
      + ", ".join(f"{c} {'/'.join(versions[c])}" for c in ("tonic", "rustls", "tokio")))
PY
echo "inspection ok: modes, owners, Depends ($depends), X-Certistack-Surface-Digest $package_digest"

step "sign with certistack-ctl; verify with certistack-ctl and with Debian's minisign"
printf 'package signing test password\n' > "$work/password"
"$ctl" package keygen --secret-key "$work/sign.key" --public-key "$work/sign.pub" --password-file "$work/password"
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$v1"
"$ctl" package sign --key "$work/sign.key" --password-file "$work/password" "$v2"
grep -q "^trusted comment: .*package:certistack-connector	version:0.1.0-1	surface:$controller_digest$" "$v1.minisig" \
  || fail "the trusted comment does not name package, version and surface: $(cat "$v1.minisig")"
"$ctl" package verify --pubkey "$work/sign.pub" "$v1"
minisign -V -q -p "$work/sign.pub" -m "$v1"
echo "minisign -V: ok"

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

packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/sign.pub" "$work/repo" "$v1"
cmp "$v1" "$work/repo/pool/main/c/certistack-connector/$(basename "$v1")" || fail "the published package is not the verified one"
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

echo "packaging: built, inspected, signed, verified by both tools, published, installed with signed-by=, cycled through reinstall, upgrade, remove and purge; the installed daemon served $served"
