#!/usr/bin/env bash
# packaging/publish-repo against a pool someone else wrote into: the repository key signs only
# an index of CertiStack packages (certistack-connector, certistack-controller, each in its own
# pool directory) the publish just verified, and a refused publish
# signs and changes nothing. With small packages made here with dpkg-deb and signed with
# certistack-ctl (tests/packaging/run.sh publishes and installs the real one), it plants:
#
#   - pool/main/p/pve-manager/pve-manager_99_all.deb with a root postinst: on a node that
#     trusts the repository key, apt would install it over Proxmox's own;
#   - an older signed package with its signature copied to a newer version's file name (a
#     rollback that minisign alone accepts: the signature is genuine);
#   - a package named other than certistack-connector, signed by the package key, in the pool
#     and given to publish;
#   - a pool package of another surface, a stray file, a symlink, a signature without its
#     package, an extra index beside the signed ones;
#
# and checks each is refused with a message naming it, the repository byte for byte as it was.
# Then the apt pinning of docs/install.md: a repository whose key signed another package (what
# a stolen repository key allows) offers apt nothing but certistack-connector.
#
# Needs dpkg-deb, minisign, apt-ftparchive, apt-get and gpg, not root (apt runs on a private
# directory as the caller). CERTISTACK_CTL names certistack-ctl (default
# target/release/certistack-ctl, else target/debug/certistack-ctl). Exits non-zero on the first
# failure.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
fail() { echo "repository test FAILED: $*" >&2; exit 1; }
step() { echo "== $*"; }
expect_fail() {
  # Runs "$@", which must fail; its output is kept for the caller in $out.
  if out=$("$@" 2>&1); then fail "expected a refusal from: $* (it said: $out)"; fi
}
for tool in dpkg-deb minisign apt-ftparchive apt-get gpg gpg-agent; do
  command -v "$tool" >/dev/null || fail "$tool is missing (bash tests/prepare-machine.sh installs it)"
done
if [ -z "${CERTISTACK_CTL:-}" ]; then
  for build in release debug; do
    [ -x "$root/target/$build/certistack-ctl" ] && { CERTISTACK_CTL="$root/target/$build/certistack-ctl"; break; }
  done
fi
[ -x "${CERTISTACK_CTL:-}" ] || fail "no certistack-ctl: cargo build -p certistack-controller, or set CERTISTACK_CTL"
export CERTISTACK_CTL
ctl=$CERTISTACK_CTL
surface=$("$ctl" surface | sed -n 's/^digest: //p')

work=$(mktemp -d /tmp/certistack-repository.XXXXXX)
export GNUPGHOME="$work/gnupg"
cleanup() {
  for home in "$work/gnupg"; do
    [ -d "$home" ] && gpgconf --homedir "$home" --kill gpg-agent 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# make_deb NAME VERSION ARCHITECTURE SURFACE OUT: a package with one file and, for pve-manager,
# the postinst an attacker would ship.
make_deb() {
  local name=$1 version=$2 architecture=$3 digest=$4 out=$5 tree
  tree=$(mktemp -d "$work/tree.XXXXXX")
  mkdir -p "$tree/DEBIAN" "$tree/usr/share/doc/$name"
  {
    echo "Package: $name"
    echo "Version: $version"
    echo "Architecture: $architecture"
    echo "Maintainer: CertiStack test <test@certistack.invalid>"
    echo "Description: a package for the repository test"
    [ -z "$digest" ] || echo "X-Certistack-Surface-Digest: $digest"
  } > "$tree/DEBIAN/control"
  if [ "$name" = pve-manager ]; then
    printf '#!/bin/sh\n# runs as root on every node that installs it\nid > /root/owned\n' > "$tree/DEBIAN/postinst"
    chmod 0755 "$tree/DEBIAN/postinst"
  fi
  echo "$name $version" > "$tree/usr/share/doc/$name/README"
  dpkg-deb --root-owner-group -Zgzip --build "$tree" "$out" >/dev/null
}
sign() { "$ctl" package sign --key "$work/package.key" "$1" >/dev/null; }

step "a package key, a repository key, connector packages 0.1.0-1 and 0.1.0-2"
"$ctl" package keygen --secret-key "$work/package.key" --public-key "$work/package.pub" >/dev/null
fpr=$(packaging/publish-repo keygen "$GNUPGHOME" "CertiStack test archive <archive@certistack.invalid>")
mkdir -p "$work/in"
v1="$work/in/certistack-connector_0.1.0-1_amd64.deb"
v2="$work/in/certistack-connector_0.1.0-2_amd64.deb"
make_deb certistack-connector 0.1.0-1 amd64 "$surface" "$v1"; sign "$v1"
make_deb certistack-connector 0.1.0-2 amd64 "$surface" "$v2"; sign "$v2"
repo="$work/repo"
pool="$repo/pool/main/c/certistack-connector"
publish() { packaging/publish-repo publish "$GNUPGHOME" "$fpr" "$work/package.pub" "$repo" "$@"; }
publish "$v1" >/dev/null

# Every path in the repository with its type and, for files, its SHA-256: a refused publish
# leaves this exactly as it was (a re-signed Release differs in its signature's time).
state() {
  (cd "$repo" && find . -mindepth 1 -printf '%y %p\n' | LC_ALL=C sort && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
}
before=$(state)
# refused WHAT EXPECTED_TEXT [DEB...]: publish must refuse, saying EXPECTED_TEXT, and change nothing.
refused() {
  local what=$1 expected=$2; shift 2
  expect_fail publish "$@"
  [[ "$out" == *"$expected"*"nothing was published"* ]] || fail "$what: publish-repo's refusal does not say \"$expected\": $out"
  echo "$what: refused: $(echo "$out" | tail -1)"
}
# unchanged: the repository is as it was before the planted file (which the caller removes).
unchanged() {
  [ "$(state)" = "$before" ] || fail "a refused publish changed the repository: $(diff <(echo "$before") <(state) || true)"
}

step "a planted pve-manager with a root postinst, beside the pool's connector: refused, nothing signed"
make_deb pve-manager 99 all "" "$work/pve-manager_99_all.deb"
mkdir -p "$repo/pool/main/p/pve-manager"
cp "$work/pve-manager_99_all.deb" "$repo/pool/main/p/pve-manager/"
planted_state=$(state)
refused "re-signing with pve-manager in the pool" "pool/main/p/pve-manager/pve-manager_99_all.deb"
refused "publishing 0.1.0-2 with pve-manager in the pool" "pool/main/p/pve-manager/pve-manager_99_all.deb" "$v2"
[ "$(state)" = "$planted_state" ] || fail "a refused publish changed the repository: $(diff <(echo "$planted_state") <(state) || true)"
grep -q pve-manager "$repo/dists/stable/main/binary-amd64/Packages" && fail "the index lists pve-manager"
rm -r "$repo/pool/main/p"
unchanged

step "pve-manager signed by the package key, in the connector's pool directory or given: refused by name"
make_deb pve-manager 99 amd64 "$surface" "$work/in/pve-manager_99_amd64.deb"; sign "$work/in/pve-manager_99_amd64.deb"
"$ctl" package verify --pubkey "$work/package.pub" "$work/in/pve-manager_99_amd64.deb" >/dev/null \
  || fail "the signed pve-manager should pass package verify: only publish-repo's own name check can refuse it"
cp "$work/in/pve-manager_99_amd64.deb" "$work/in/pve-manager_99_amd64.deb.minisig" "$pool/"
refused "a signed pve-manager in the pool" "pool/main/c/certistack-connector/pve-manager_99_amd64.deb"
rm "$pool"/pve-manager_*
unchanged
refused "a signed pve-manager given to publish" "is pve-manager, not certistack-connector" "$work/in/pve-manager_99_amd64.deb"
unchanged
make_deb certistack-connector-tools 0.1.0-1 amd64 "$surface" "$work/in/certistack-connector_0.1.0-9_amd64.deb"
sign "$work/in/certistack-connector_0.1.0-9_amd64.deb"
refused "another package under the connector's file name" "is certistack-connector-tools, not certistack-connector" "$work/in/certistack-connector_0.1.0-9_amd64.deb"
unchanged

step "rollback: 0.1.0-1 and its genuine signature copied to 0.1.0-2's file name: refused"
cp "$v1" "$pool/certistack-connector_0.1.0-2_amd64.deb"
cp "$v1.minisig" "$pool/certistack-connector_0.1.0-2_amd64.deb.minisig"
minisign -V -q -p "$work/package.pub" -m "$pool/certistack-connector_0.1.0-2_amd64.deb" \
  || fail "the copied signature should verify with minisign: the file name is what lies"
refused "0.1.0-1 under 0.1.0-2's name in the pool" "certistack-connector_0.1.0-2_amd64.deb is certistack-connector 0.1.0-1"
rm "$pool"/certistack-connector_0.1.0-2_amd64.deb*
unchanged
mkdir -p "$work/rollback"
cp "$v1" "$work/rollback/certistack-connector_0.1.0-2_amd64.deb"
cp "$v1.minisig" "$work/rollback/certistack-connector_0.1.0-2_amd64.deb.minisig"
refused "0.1.0-1 under 0.1.0-2's name given to publish" "certistack-connector_0.1.0-2_amd64.deb is certistack-connector 0.1.0-1" \
  "$work/rollback/certistack-connector_0.1.0-2_amd64.deb"
unchanged

step "a pool package of another surface, signed: refused as package verify refuses it"
make_deb certistack-connector 0.1.0-3 amd64 "sha256:$(printf '0%.0s' $(seq 64))" "$pool/certistack-connector_0.1.0-3_amd64.deb"
sign "$pool/certistack-connector_0.1.0-3_amd64.deb"
refused "another surface in the pool" "certistack-connector_0.1.0-3_amd64.deb does not verify"
rm "$pool"/certistack-connector_0.1.0-3_amd64.deb*
unchanged

step "anything else in the pool or beside the signed indexes: refused"
echo notes > "$pool/README"
refused "a stray file in the pool" "pool/main/c/certistack-connector/README"
rm "$pool/README"
ln -s "$v2" "$pool/certistack-connector_0.1.0-2_amd64.deb"
cp "$v2.minisig" "$pool/"
refused "a symlink in the pool" "pool/main/c/certistack-connector/certistack-connector_0.1.0-2_amd64.deb"
rm "$pool"/certistack-connector_0.1.0-2_amd64.deb*
cp "$v2.minisig" "$pool/"
refused "a signature without its package" "pool/main/c/certistack-connector/certistack-connector_0.1.0-2_amd64.deb.minisig"
rm "$pool"/certistack-connector_0.1.0-2_amd64.deb.minisig
cp "$v2" "$pool/"
refused "a package without its signature" "pool/main/c/certistack-connector/certistack-connector_0.1.0-2_amd64.deb"
rm "$pool"/certistack-connector_0.1.0-2_amd64.deb
unchanged
# An index apt prefers to Packages.gz, listing pve-manager: signing the directory would sign it.
apt-ftparchive packages "$work/in" | xz > "$repo/dists/stable/main/binary-amd64/Packages.xz"
refused "an extra index in dists/stable" "dists/stable/main/binary-amd64/Packages.xz"
rm "$repo/dists/stable/main/binary-amd64/Packages.xz"
unchanged

step "the clean pool publishes: exactly the verified connector packages are indexed"
publish "$v2"
packages="$repo/dists/stable/main/binary-amd64/Packages"
[ "$(sed -n 's/^Package: //p' "$packages" | sort -u)" = certistack-connector ] || fail "the index lists other packages: $(grep '^Package:' "$packages")"
[ "$(sed -n 's/^Version: //p' "$packages" | sort | tr '\n' ' ')" = "0.1.0-1 0.1.0-2 " ] || fail "the index's versions: $(grep '^Version:' "$packages")"
cmp "$v2" "$pool/$(basename "$v2")" || fail "the published 0.1.0-2 is not the verified one"
cmp "$v1" "$pool/$(basename "$v1")" || fail "the pool's 0.1.0-1 changed"
gpg --batch --verify "$repo/dists/stable/InRelease" 2>/dev/null || fail "InRelease does not verify"
gpg --batch --verify "$repo/dists/stable/Release.gpg" "$repo/dists/stable/Release" 2>/dev/null || fail "Release.gpg does not verify"
for index in main/binary-amd64/Packages main/binary-amd64/Packages.gz; do
  sum=$(sha256sum < "$repo/dists/stable/$index" | cut -c1-64)
  grep -q " $sum .* $index\$" "$repo/dists/stable/Release" || fail "the Release has no SHA256 of $index"
done
[ "$(awk '/^SHA256:/ {on=1; next} /^[^ ]/ {on=0} on' "$repo/dists/stable/Release" | wc -l)" = 2 ] \
  || fail "the Release hashes more than Packages and Packages.gz: $(cat "$repo/dists/stable/Release")"
echo "published: $(grep -c '^Package:' "$packages") packages, all certistack-connector"

step "the controller's package: refused under the connector's name or in its directory, published in its own"
controller="$work/in/certistack-controller_0.1.0-1_amd64.deb"
make_deb certistack-controller 0.1.0-1 amd64 "$surface" "$controller"; sign "$controller"
before=$(state)
cp "$controller" "$work/in/certistack-connector_0.1.0-7_amd64.deb"
cp "$controller.minisig" "$work/in/certistack-connector_0.1.0-7_amd64.deb.minisig"
refused "the controller given under the connector's file name" "is certistack-controller 0.1.0-1, validly signed, but is named as another release" \
  "$work/in/certistack-connector_0.1.0-7_amd64.deb"
unchanged
cp "$controller" "$controller.minisig" "$pool/"
refused "the controller's package in the connector's pool directory" "pool/main/c/certistack-connector/certistack-controller_0.1.0-1_amd64.deb.minisig is in the pool but is not a signed CertiStack package"
rm "$pool"/certistack-controller_*
unchanged
mkdir -p "$work/twice"
cp "$controller" "$controller.minisig" "$work/twice/"
refused "one file name given twice" "two packages are named certistack-controller_0.1.0-1_amd64.deb" "$controller" "$work/twice/$(basename "$controller")"
unchanged
publish "$controller" >/dev/null
cmp "$controller" "$repo/pool/main/c/certistack-controller/$(basename "$controller")" || fail "the published controller is not the verified one"
[ "$(sed -n 's/^Package: //p' "$packages" | sort | tr '\n' ' ')" = "certistack-connector certistack-connector certistack-controller " ] \
  || fail "the index after publishing the controller: $(grep '^Package:' "$packages")"
echo "published beside the connector: $(sed -n 's/^Filename: //p' "$packages" | tr '\n' ' ')"

step "the apt pinning of docs/install.md: a stolen repository key's pve-manager is not installable"
# The preferences file exactly as docs/install.md gives it, for this repository's origin.
pin=$(awk '/^    cat > \/etc\/apt\/preferences.d\/certistack.pref/ {on=1; next} on && /^    EOF$/ {exit} on {sub(/^    /, ""); print}' docs/install.md)
[[ "$pin" == *"Pin-Priority: -1"* ]] || fail "docs/install.md has no pinning stanza to test: $pin"
# Someone holding the repository key (not the package key) signs an index listing pve-manager.
stolen="$work/stolen"
mkdir -p "$stolen/pool/main/c/certistack-connector" "$stolen/pool/main/p/pve-manager" "$stolen/dists/stable/main/binary-amd64"
cp "$v2" "$stolen/pool/main/c/certistack-connector/"
cp "$work/pve-manager_99_all.deb" "$stolen/pool/main/p/pve-manager/"
(cd "$stolen" && apt-ftparchive packages pool > dists/stable/main/binary-amd64/Packages \
  && apt-ftparchive -o APT::FTPArchive::Release::Origin=CertiStack -o APT::FTPArchive::Release::Suite=stable \
     -o APT::FTPArchive::Release::Architectures=amd64 -o APT::FTPArchive::Release::Components=main \
     release dists/stable > "$work/Release" && mv "$work/Release" dists/stable/Release)
gpg --batch --quiet --pinentry-mode loopback --passphrase "" --local-user "$fpr!" --clearsign \
  --output "$stolen/dists/stable/InRelease" "$stolen/dists/stable/Release"
apt_root="$work/apt"
mkdir -p "$apt_root/etc/preferences.d" "$apt_root/etc/sources.list.d" "$apt_root/etc/trusted.gpg.d" \
  "$apt_root/state/lists/partial" "$apt_root/cache/archives/partial" "$apt_root/keyrings"
gpg --batch --export "$fpr" > "$apt_root/keyrings/certistack-archive-keyring.gpg"
cat > "$apt_root/etc/sources.list.d/certistack.sources" <<SOURCES
Types: deb
URIs: file:$stolen
Suites: stable
Components: main
Signed-By: $apt_root/keyrings/certistack-archive-keyring.gpg
SOURCES
# The documented stanza names the repository's host; a file: repository has the empty host.
echo "${pin//packages.example.org/}" > "$apt_root/etc/preferences.d/certistack.pref"
sed -i 's/^Pin: origin $/Pin: origin ""/' "$apt_root/etc/preferences.d/certistack.pref"
apt_options=(-o Dir::Etc="$apt_root/etc" -o Dir::Etc::sourcelist=/dev/null -o Dir::State="$apt_root/state"
  -o Dir::State::status=/dev/null -o Dir::Cache="$apt_root/cache" -o APT::Architecture=amd64
  -o APT::Architectures::=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)")
apt-get "${apt_options[@]}" update -q >"$work/apt-update.log" 2>&1 || fail "apt-get update: $(cat "$work/apt-update.log")"
# Captured, then matched: grep -q on the pipe would stop apt-cache early (SIGPIPE, pipefail).
policy() { apt-cache "${apt_options[@]}" policy "$1"; }
shown=$(policy pve-manager)
[[ "$shown" == *"Candidate: (none)"* && "$shown" == *"-1 file:"* ]] || fail "pinned, pve-manager is still a candidate: $shown"
shown=$(policy certistack-connector)
[[ "$shown" == *"Candidate: 0.1.0-2"* ]] || fail "pinned, certistack-connector is no candidate: $shown"
rm "$apt_root/etc/preferences.d/certistack.pref"
shown=$(policy pve-manager)
[[ "$shown" == *"Candidate: 99"* ]] || fail "without the pin pve-manager should be a candidate, or the test shows nothing: $shown"
echo "pinned: pve-manager from the repository has no candidate, certistack-connector has 0.1.0-2"

echo "repository: publish-repo refused a planted package, a rollback copy, other names, other surfaces and stray files without signing or changing anything; the documented pin keeps the repository to certistack-connector"
