#!/usr/bin/env bash
# A worker links the client, not the server: kvwarden-client's normal dependency tree
# holds neither the server crate nor what only the server needs (the event loop, the
# metrics, the HTTP parser, signal handling, the CUDA driver). Fails naming the crate
# and the path that brought it.
set -euo pipefail
cd "$(dirname "$0")/.."

tree=$(cargo tree -p kvwarden-client -e normal --prefix none --format '{p}')
status=0
for forbidden in kvwarden-shell-mio kvwarden-cli mio prometheus-client httparse signal-hook cudarc clap tracing-subscriber; do
  if grep -Eq "^${forbidden} v" <<<"$tree"; then
    echo "client-deps: kvwarden-client depends on ${forbidden}, which only the server needs. It comes in through:" >&2
    cargo tree -p kvwarden-client -e normal -i "$forbidden" >&2 || true
    status=1
  fi
done
if [[ $status -eq 0 ]]; then
  echo "client-deps: kvwarden-client links the core and what the client needs, not the server"
fi
exit $status
