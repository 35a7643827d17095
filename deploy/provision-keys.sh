#!/bin/sh
# Create the key files of one octo-worker instance, for systemd LoadCredential=.
#
#   deploy/provision-keys.sh [--dir DIR] [--storage-id ID] INSTANCE SCOPE...
#
# Writes, in DIR (default /etc/octo/keys/INSTANCE), one 32-byte random key
# per tenant scope (SCOPE.key) and one storage key (storage-ID.key, default
# ID k1), each mode 0600 in a 0700 directory. An existing key file is never
# overwritten: rotating a key is a deliberate step (docs/operations.md).
# Prints the LoadCredential= lines of these keys; never prints a key.
#
# It does not create DIR/broker.password, which the unit's
# LoadCredential=broker.password line also needs: create that file yourself,
# mode 0600, without the password on a command line (docs/operations.md,
# Install, step 4).
#
# The same scope key must reach the host that opens sessions for SCOPE: copy
# the file over a channel you trust (never through the broker, a command line
# or a log), or generate it on the host with `octo-host keys generate`.
set -eu

umask 077
dir=""
storage_id="k1"

usage() {
    echo "usage: $0 [--dir DIR] [--storage-id ID] INSTANCE SCOPE..." >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dir) [ $# -ge 2 ] || usage; dir="$2"; shift 2 ;;
        --storage-id) [ $# -ge 2 ] || usage; storage_id="$2"; shift 2 ;;
        --) shift; break ;;
        -*) usage ;;
        *) break ;;
    esac
done
[ $# -ge 2 ] || usage
instance="$1"
shift

token() {
    # Scope names and key ids are tokens: [a-z0-9._-], 1..128 characters.
    printf '%s' "$1" | grep -Eq '^[a-z0-9._-]{1,128}$' || {
        echo "provision-keys: '$1' is not a token ([a-z0-9._-], 1..128)" >&2
        exit 2
    }
    case "$1" in
        .|..) echo "provision-keys: '$1' is not a usable name" >&2; exit 2 ;;
    esac
}

token "$instance"
token "$storage_id"
for scope in "$@"; do token "$scope"; done
if [ -n "$dir" ]; then
    source_dir="$dir"
else
    dir="/etc/octo/keys/$instance"
    source_dir="/etc/octo/keys/%i"
fi

mkdir -p "$dir"
chmod 0700 "$dir"

make_key() {
    target="$dir/$1"
    if [ -e "$target" ] || [ -L "$target" ]; then
        echo "provision-keys: $target exists; kept" >&2
    else
        tmp="$dir/.$1.tmp.$$"
        head -c 32 /dev/urandom > "$tmp"
        chmod 0600 "$tmp"
        [ "$(wc -c < "$tmp")" -eq 32 ] || { rm -f "$tmp"; echo "provision-keys: short read" >&2; exit 1; }
        mv "$tmp" "$target"
        echo "provision-keys: created $target" >&2
    fi
    echo "LoadCredential=$1:$source_dir/$1"
}

for scope in "$@"; do
    make_key "$scope.key"
done
make_key "storage-$storage_id.key"
