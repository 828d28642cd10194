#!/usr/bin/env bash
# The GPU checks of docs/targets.md, G1 and G2, on a host with an NVIDIA GPU.
#
# Run from the repository root, with a kvwarden built elsewhere if this host has no
# cargo (x86-64, `cargo build --release -p kvwarden`; CUDA is loaded at run time):
#   KVWARDEN_BIN=path/to/kvwarden shell-mio/scripts/gpu-check.sh
# Prints one figure per line (`G1 …`, `G2 …`) and finishes in well under 4 minutes.
# Every step fails (and stops the script) when the server answered a ping `false`: a
# live worker told that its instance is not held voids the figures.
#   GPU_CHECK_BYTES   bytes the worker registers for G1 (default 16G)
#   GPU_CHECK_DEVICE  device ordinal (default 0)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${KVWARDEN_BIN:-target/release/kvwarden}
bytes=${GPU_CHECK_BYTES:-16G}
device=${GPU_CHECK_DEVICE:-0}
if [ ! -x "$bin" ]; then
  echo "gpu-check: no kvwarden binary at $bin; build it with cargo build --release -p kvwarden, or set KVWARDEN_BIN" >&2
  exit 2
fi
started=$(date +%s)
step() { printf '\n== %s (%ss) ==\n' "$1" "$(( $(date +%s) - started ))"; }

step "devices"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv || true
"$bin" gpu info

step "G1: SIGKILLed worker holding $bytes over CUDA IPC, same host (process-exit proof)"
timeout 120 "$bin" gpu reclaim --bytes "$bytes" --device "$device" --rounds 3 --wait-seconds 10

step "G1 control: the same, but the server cannot know (reaping disabled, worker over TCP)"
timeout 60 "$bin" gpu reclaim --bytes "$bytes" --device "$device" --control --wait-seconds 5

step "G2: store/retrieve device <-> L1 against plain pinned copies"
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 2M --total-bytes 2G --clients 4
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 8M --total-bytes 2G --clients 4

step "issue 16: one client, 8 MiB chunks (a live worker's ping answered false fails the run)"
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 8M --total-bytes 1G --clients 1

step "done"
