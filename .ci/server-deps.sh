#!/usr/bin/env bash
# The server links the core and the client, never the bench: kvwarden-shell-mio's normal
# dependency tree holds neither kvwarden-bench nor the binary's crate (kvwarden-cli,
# which brings the server's commands and the bench's drivers together). Fails naming
# the crate and the path that brought it.
set -euo pipefail
cd "$(dirname "$0")/.."

tree=$(cargo tree -p kvwarden-shell-mio -e normal --prefix none --format '{p}')
status=0
for forbidden in kvwarden-bench kvwarden-cli kvwarden-shell-sim; do
  if grep -Eq "^${forbidden} v" <<<"$tree"; then
    echo "server-deps: kvwarden-shell-mio depends on ${forbidden}; move what needs it to cli/. It comes in through:" >&2
    cargo tree -p kvwarden-shell-mio -e normal -i "$forbidden" >&2 || true
    status=1
  fi
done
if [[ $status -eq 0 ]]; then
  echo "server-deps: kvwarden-shell-mio links the core and the client, not the bench"
fi
exit $status
