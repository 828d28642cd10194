#!/usr/bin/env bash
# The core stays sans-IO: its normal dependency tree holds no event loop, no syscall
# wrapper, no CUDA, no signal handling and no metrics, and libc only as uuid's entropy
# source (uuid -> getrandom -> libc). Fails naming the crate and the path that brought it.
set -euo pipefail
cd "$(dirname "$0")/.."

tree=$(cargo tree -p kvwarden-core -e normal --prefix none --format '{p}')
status=0
for forbidden in mio rustix nix cudarc signal-hook prometheus-client; do
  if grep -Eq "^${forbidden} v" <<<"$tree"; then
    echo "core-deps: kvwarden-core depends on ${forbidden}; the core must not touch I/O. It comes in through:" >&2
    cargo tree -p kvwarden-core -e normal -i "$forbidden" >&2 || true
    status=1
  fi
done

if grep -Eq '^libc v' <<<"$tree"; then
  # Every crate on a path from the core to libc must be one of these.
  allowed=' libc getrandom uuid kvwarden-core '
  while read -r name _; do
    [[ -z "$name" ]] && continue
    if [[ "$allowed" != *" $name "* ]]; then
      echo "core-deps: kvwarden-core reaches libc through ${name}; only uuid's entropy source (uuid -> getrandom -> libc) may bring it in:" >&2
      cargo tree -p kvwarden-core -e normal -i libc >&2 || true
      status=1
      break
    fi
  done < <(cargo tree -p kvwarden-core -e normal -i libc --prefix none --format '{p}' | sort -u)
fi

if [[ $status -eq 0 ]]; then
  echo "core-deps: kvwarden-core's normal dependencies are free of I/O crates (libc only via uuid -> getrandom)"
fi
exit $status
