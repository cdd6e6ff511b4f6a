#!/usr/bin/env bash
# A private certificate authority and a SuperLink certificate signed by it, for TLS between the
# SuperLink, its SuperNodes and `flwr`.
#
#   docker/certs/generate.sh ADDRESS[,ADDRESS...] [OUT_DIR]
#
# ADDRESS is how SuperNodes and `flwr` reach the SuperLink: an IP address (10.0.0.5, ::1) or a DNS
# name (superlink, fl.example.org); give several separated by commas. Each goes into the
# certificate's subjectAltName, which is what clients check, together with localhost, 127.0.0.1
# and ::1: the SuperLink's own SuperExec (which starts the ServerApp) reaches the SuperLink over
# loopback when it listens on 0.0.0.0 or ::, and checks the certificate like any client.
# OUT_DIR (default: this script's folder) receives
#
#   ca.crt      the CA certificate: `--ssl-ca-certfile` of flower-superlink, `--root-certificates`
#               of flower-supernode, `root-certificates` of the `flwr` connection
#   ca.key      the CA private key: keep it offline, it is needed only to sign new certificates
#   server.pem  the SuperLink certificate (`--ssl-certfile`)
#   server.key  the SuperLink private key (`--ssl-keyfile`)
#
# Existing files in OUT_DIR are overwritten. The private keys are written readable by you only: a
# container that runs as another user needs them handed over (chown to that user, or mount them
# as that user). Needs openssl (1.1.1 or later).
set -euo pipefail

usage() {
    echo "usage: $0 ADDRESS[,ADDRESS...] [OUT_DIR]" >&2
    exit 2
}
[[ $# -ge 1 && $# -le 2 && -n "$1" ]] || usage
command -v openssl >/dev/null || { echo "$0: openssl not found" >&2; exit 1; }

addresses=$1
out=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
days=${CERT_DAYS:-365}
mkdir -p "$out"

san=""
first=""
IFS=',' read -ra items <<<"$addresses"
given=0
for item in "${items[@]}"; do
    [[ -z "${item//[[:space:]]/}" ]] || given=$((given + 1))
done
[[ $given -gt 0 ]] || usage
seen=","
for item in "${items[@]}" localhost 127.0.0.1 ::1; do
    item=${item//[[:space:]]/}
    [[ -n "$item" && "$seen" != *",$item,"* ]] || continue
    seen+="$item,"
    [[ -n "$first" ]] || first=$item
    if [[ "$item" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$item" == *:* ]]; then
        san+="${san:+,}IP:${item}"
    else
        san+="${san:+,}DNS:${item}"
    fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
umask 077

# The certificate authority.
openssl req -x509 -new -newkey rsa:4096 -sha256 -nodes -days "$days" \
    -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=fedguard CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# The SuperLink's key and certificate request, then the certificate signed by the CA.
openssl req -new -newkey rsa:4096 -sha256 -nodes \
    -keyout "$out/server.key" -out "$tmp/server.csr" -subj "/CN=${first}" 2>/dev/null
cat >"$tmp/server.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=${san}
EOF
openssl x509 -req -in "$tmp/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
    -CAserial "$tmp/ca.srl" -out "$out/server.pem" -days "$days" -sha256 -extfile "$tmp/server.ext" 2>/dev/null

chmod 644 "$out/ca.crt" "$out/server.pem"
chmod 600 "$out/ca.key" "$out/server.key"
openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "wrote $out/ca.crt, $out/server.pem, $out/server.key (subjectAltName ${san})"
