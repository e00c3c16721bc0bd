#!/usr/bin/env bash
# Starts a connector on loopback with a freshly made controller CA, enrolls it the way an
# operator would, and talks to it over mTLS with `certistack-ctl hello`. Exits non-zero on
# any failure. Uses only the two built binaries and a temporary directory.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/debug"
cargo build --quiet --locked --manifest-path "$root/Cargo.toml" --bin certistack-connector --bin certistack-ctl

work=$(mktemp -d /tmp/certistack-loopback.XXXXXX)
daemon=""
cleanup() {
  if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill -TERM "$daemon"; wait "$daemon" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$work/node"
cat > "$work/node/connector.toml" <<CONF
node_name = "pve1"
listen = "127.0.0.1:$port"
[tls]
certificate = "$work/node/node.crt"
private_key = "$work/node/node.key"
controller_ca = "$work/node/ca.crt"
run_authority_public_key = "$work/node/run-authority.pub"
[paths]
state_dir = "$work/node/state"
overlay_root = "$work/node/overlays"
CONF

echo "== controller: create the CA and signing keys"
"$bin/certistack-ctl" ca init --state-dir "$work/ctl" | tee "$work/ca-init.txt"
# The operator carries this fingerprint to the node out of band; enrollment refuses any other CA.
fingerprint=$(sed -n 's/^CA fingerprint: //p' "$work/ca-init.txt")
echo "== node: generate its key and a CSR (the key never leaves the node)"
"$bin/certistack-connector" --config "$work/node/connector.toml" enroll --csr > "$work/node.csr"
echo "== controller: sign the CSR"
"$bin/certistack-ctl" node sign --state-dir "$work/ctl" --node pve1 --csr "$work/node.csr" --out "$work/node-issued.crt"
echo "== node: install certificate, CA and run-authority key"
"$bin/certistack-connector" --config "$work/node/connector.toml" enroll --install \
  --certificate "$work/node-issued.crt" --ca "$work/ctl/ca.crt" --ca-fingerprint "$fingerprint" --run-authority "$work/ctl/run-authority.pub"
echo "== node: start the connector on 127.0.0.1:$port"
"$bin/certistack-connector" --config "$work/node/connector.toml" 2> "$work/connector.log" &
daemon=$!
for _ in $(seq 1 50); do
  if "$bin/certistack-ctl" hello --state-dir "$work/ctl" --node "127.0.0.1:$port" --name pve1 > "$work/hello.txt" 2>&1; then
    break
  fi
  sleep 0.1
done
echo "== controller: hello over mTLS"
"$bin/certistack-ctl" hello --state-dir "$work/ctl" --node "127.0.0.1:$port" --name pve1
echo "== controller: a wrong node name is refused (exit 4 expected)"
set +e
"$bin/certistack-ctl" hello --state-dir "$work/ctl" --node "127.0.0.1:$port" --name pve2
code=$?
set -e
[ "$code" -eq 4 ] || { echo "expected exit 4, got $code" >&2; exit 1; }
kill -TERM "$daemon"
wait "$daemon"
daemon=""
echo "== connector log"
cat "$work/connector.log"
echo "loopback: connector and certistack-ctl talked over mTLS"
