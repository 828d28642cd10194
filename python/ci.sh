#!/usr/bin/env bash
# CI for the Python worker client: install ./python and pytest, find (or build) the
# kvwarden server binary, run the tests. Exits non-zero on any failure, including
# pytest's exit 5 ("no tests collected").
#
#   bash python/ci.sh            # from anywhere; extra args go to pytest
#
# Environment:
#   KVWARDEN_BIN  the server binary to test; default: `cargo build -p kvwarden-cli` (a no-op
#                 when up to date) and ${CARGO_TARGET_DIR:-<repo>/target}/debug/kvwarden
#   PYTHON        the interpreter (default python3; 3.9 or newer)
#
# Where packages go: a venv at python/.venv; where the interpreter cannot make one (a
# Debian python3 without python3-venv), `pip install --target python/.pydeps` instead,
# which also sidesteps PEP 668's externally-managed refusal. Network: PyPI only.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
python="${PYTHON:-python3}"

say() { printf '\n=== python: %s (%s) ===\n' "$1" "$(date -u +%H:%M:%S)"; }
die() { printf 'python/ci.sh: %s\n' "$1" >&2; exit 1; }

command -v "$python" >/dev/null || die "no '$python' on PATH; install CPython 3.9+ or set PYTHON"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
  || die "$("$python" -V 2>&1) is too old: kvwarden needs Python 3.9+ (socket.send_fds/recv_fds); set PYTHON"

say "install ./python and pytest"
venv="$here/.venv"
run_python=()
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "reusing $venv"
  run_python=("$venv/bin/python")
elif "$python" -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "created $venv"
  run_python=("$venv/bin/python")
else
  rm -rf "$venv"
  echo "cannot create a venv with $python (python3-venv missing?); using pip --target"
  "$python" -m pip --version >/dev/null 2>&1 \
    || die "neither venv nor pip works for $python; install python3-venv or python3-pip"
fi

if [ ${#run_python[@]} -gt 0 ]; then
  pip=("${run_python[@]}" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install pytest "$here"
  # Same version number as an earlier install: force the local sources in.
  "${pip[@]}" install --force-reinstall --no-deps "$here"
else
  deps="$here/.pydeps"
  rm -rf "$deps"
  "$python" -m pip --disable-pip-version-check -q install --target "$deps" pytest "$here"
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
  run_python=("$python")
fi
"${run_python[@]}" -c 'import kvwarden, msgpack, pytest; print("kvwarden", kvwarden.__version__, "from", kvwarden.__file__)'

say "locate the kvwarden server"
if [ -n "${KVWARDEN_BIN:-}" ]; then
  [ -x "$KVWARDEN_BIN" ] || die "KVWARDEN_BIN=$KVWARDEN_BIN is not an executable file"
else
  bin="${CARGO_TARGET_DIR:-$root/target}/debug/kvwarden"
  if command -v cargo >/dev/null; then
    (cd "$root" && cargo build -p kvwarden-cli)
  elif [ ! -x "$bin" ]; then
    die "no cargo on PATH and no $bin; install Rust or set KVWARDEN_BIN"
  else
    echo "no cargo on PATH: testing the existing $bin as is"
  fi
  [ -x "$bin" ] || die "cargo build -p kvwarden-cli did not produce $bin"
  export KVWARDEN_BIN="$bin"
fi
echo "KVWARDEN_BIN=$KVWARDEN_BIN"

say "pytest"
cd "$here"
limit=()
command -v timeout >/dev/null && limit=(timeout --kill-after=30 900)
set +e
"${limit[@]}" "${run_python[@]}" -m pytest -ra -p no:cacheprovider tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  die "pytest collected no tests (exit 5): counted as a failure"
elif [ "$rc" -ne 0 ]; then
  die "pytest failed with exit code $rc"
fi
say "done"
