#!/usr/bin/env bash
# Authentication key pairs for N SuperNodes, in the form Flower expects: ECDSA on NIST P-384, the
# private key in OpenSSH format (no passphrase), the public key as an OpenSSH public key line.
#
#   docker/keys/generate.sh N [OUT_DIR]
#
# OUT_DIR (default: this script's folder) receives supernode-1, supernode-1.pub, ... supernode-N,
# supernode-N.pub. With a SuperLink started with `--enable-supernode-auth`, register each public
# key once (the connection as in ~/.flwr/config.toml):
#
#   flwr supernode register OUT_DIR/supernode-1.pub [CONNECTION]
#
# and start that SuperNode with `--auth-supernode-private-key OUT_DIR/supernode-1`. A SuperNode
# whose public key was not registered is refused. For a SuperNode on another machine, run this on
# that machine and send the server only the .pub file: the private key never leaves it. Existing key
# files are overwritten. Private keys are readable by you only: a container that runs as another
# user needs them handed over (chown).
# Uses ssh-keygen when present, otherwise Python's `cryptography` package (a dependency of flwr).
set -euo pipefail

usage() {
    echo "usage: $0 N [OUT_DIR]" >&2
    exit 2
}
[[ $# -ge 1 && $# -le 2 && "$1" =~ ^[1-9][0-9]*$ ]] || usage
count=$1
out=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
mkdir -p "$out"
umask 077

python=${PYTHON:-python3}
for ((i = 1; i <= count; i++)); do
    key="$out/supernode-$i"
    rm -f "$key" "$key.pub"
    if command -v ssh-keygen >/dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$key"
    else
        "$python" - "$key" "supernode-$i" <<'EOF'
import sys
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path, comment = Path(sys.argv[1]), sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
path.write_bytes(key.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
Path(f"{path}.pub").write_bytes(public + f" {comment}\n".encode())
EOF
    fi
    chmod 600 "$key"
    chmod 644 "$key.pub"
done
echo "wrote $count key pairs to $out (supernode-<i>, supernode-<i>.pub)"
