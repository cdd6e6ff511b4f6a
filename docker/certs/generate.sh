#!/usr/bin/env bash
# TLS certificates signed by a private certificate authority: the SuperLink's, for TLS between
# the SuperLink, its SuperNodes and `flwr`, and the SuperNodes' Runtime API certificates, for TLS
# between each SuperNode and its ClientApp SuperExec.
#
#   docker/certs/generate.sh ADDRESS[,ADDRESS...] [OUT_DIR]
#   docker/certs/generate.sh --supernode NAME[,NAME...] [OUT_DIR]
#
# The first form makes a new CA and the SuperLink certificate. ADDRESS is how SuperNodes and
# `flwr` reach the SuperLink: an IP address (10.0.0.5, ::1) or a DNS name (superlink,
# fl.example.org); give several separated by commas. Each goes into the certificate's
# subjectAltName, which is what clients check, together with localhost, 127.0.0.1 and ::1: the
# SuperLink's own SuperExec (which starts the ServerApp) reaches the SuperLink over loopback when
# it listens on 0.0.0.0 or ::, and checks the certificate like any client. OUT_DIR (default: this
# script's folder) receives
#
#   ca.crt      the CA certificate: `--ssl-ca-certfile` of flower-superlink and flower-supernode,
#               `--root-certificates` of flower-supernode and flower-superexec, `root-certificates`
#               of the `flwr` connection
#   ca.key      the CA private key: keep it offline, it is needed only to sign new certificates
#   server.pem  the SuperLink certificate (`--ssl-certfile`)
#   server.key  the SuperLink private key (`--ssl-keyfile`)
#
# The second form issues, with the CA already in OUT_DIR (a new one when OUT_DIR has none, as on
# a client machine that keeps its Runtime APIs to itself), one certificate per SuperNode for its
# Runtime API: NAME is how that SuperNode's SuperExec reaches it (the Compose service supernode-1,
# a container name, an IP address), the only name in the certificate. OUT_DIR receives NAME.pem
# (flower-supernode's `--ssl-certfile`) and NAME.key (`--ssl-keyfile`) for each NAME. Run it
# after the first form, which replaces the CA.
#
# Existing files in OUT_DIR are overwritten. The private keys are written readable by you only: a
# container that runs as another user needs them handed over (chown to that user, or mount them
# as that user). Needs openssl (1.1.1 or later).
set -euo pipefail

usage() {
    echo "usage: $0 ADDRESS[,ADDRESS...] [OUT_DIR]" >&2
    echo "       $0 --supernode NAME[,NAME...] [OUT_DIR]" >&2
    exit 2
}
supernodes=0
if [[ "${1:-}" == "--supernode" ]]; then
    supernodes=1
    shift
fi
[[ $# -ge 1 && $# -le 2 && -n "$1" ]] || usage
command -v openssl >/dev/null || { echo "$0: openssl not found" >&2; exit 1; }

addresses=$1
out=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
days=${CERT_DAYS:-365}
mkdir -p "$out"

IFS=',' read -ra items <<<"$addresses"
given=0
for item in "${items[@]}"; do
    [[ -z "${item//[[:space:]]/}" ]] || given=$((given + 1))
done
[[ $given -gt 0 ]] || usage

# subjectAltName entry of one address: IP:... for an IPv4 or IPv6 address, DNS:... otherwise.
san_entry() {
    if [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$1" == *:* ]]; then
        echo "IP:$1"
    else
        echo "DNS:$1"
    fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
umask 077

make_ca() {
    openssl req -x509 -new -newkey rsa:4096 -sha256 -nodes -days "$days" \
        -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=fedguard CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    chmod 644 "$out/ca.crt"
    chmod 600 "$out/ca.key"
    echo "wrote $out/ca.crt, $out/ca.key (a new CA)"
}

# issue NAME CN SAN: NAME.key and NAME.pem in OUT_DIR, a server certificate signed by the CA.
issue() {
    local name=$1 cn=$2 san=$3
    openssl req -new -newkey rsa:4096 -sha256 -nodes \
        -keyout "$out/$name.key" -out "$tmp/$name.csr" -subj "/CN=${cn}" 2>/dev/null
    cat >"$tmp/$name.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=${san}
EXT
    openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
        -CAserial "$tmp/ca.srl" -out "$out/$name.pem" -days "$days" -sha256 -extfile "$tmp/$name.ext" 2>/dev/null
    chmod 644 "$out/$name.pem"
    chmod 600 "$out/$name.key"
    openssl verify -CAfile "$out/ca.crt" "$out/$name.pem" >/dev/null
    echo "wrote $out/$name.pem, $out/$name.key (subjectAltName ${san})"
}

if [[ $supernodes -eq 1 ]]; then
    if [[ ! -f "$out/ca.crt" || ! -f "$out/ca.key" ]]; then
        make_ca
    fi
    for item in "${items[@]}"; do
        item=${item//[[:space:]]/}
        [[ -n "$item" ]] || continue
        # The name becomes a file name: a DNS name or an address, nothing that leaves OUT_DIR.
        [[ "$item" =~ ^[A-Za-z0-9][A-Za-z0-9.:_-]*$ ]] || { echo "$0: not a host name: $item" >&2; exit 2; }
        issue "$item" "$item" "$(san_entry "$item")"
    done
    exit 0
fi

san=""
first=""
seen=","
for item in "${items[@]}" localhost 127.0.0.1 ::1; do
    item=${item//[[:space:]]/}
    [[ -n "$item" && "$seen" != *",$item,"* ]] || continue
    seen+="$item,"
    [[ -n "$first" ]] || first=$item
    san+="${san:+,}$(san_entry "$item")"
done

make_ca
issue server "$first" "$san"
