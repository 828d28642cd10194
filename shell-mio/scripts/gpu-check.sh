#!/usr/bin/env bash
# The GPU checks of docs/targets.md, G1, G2 and G3, on a host with an NVIDIA GPU.
#
# Run from the repository root, with a kvwarden built elsewhere if this host has no
# cargo (x86-64, `cargo build --release -p kvwarden-cli`; CUDA is loaded at run time):
#   KVWARDEN_BIN=path/to/kvwarden shell-mio/scripts/gpu-check.sh
# Prints one figure per line (`G1 …`, `G2 …`, `G3 …`; those of cuMemCreate memory,
# registered as cuda_vmm, named `vmm_…`) and finishes in well under 4 minutes on an
# H200 (not yet timed with the VMM steps). Every step fails (and stops the script) when the server answered
# a ping `false` (a live worker told that its instance is not held voids the figures),
# when a retrieved chunk's bytes differ from what was stored, or when memory does not
# come back. `shell-mio/scripts/gpu-all.sh` runs this and gpu-kv-check.sh as one job.
#   GPU_CHECK_BYTES       bytes per worker for G1 and G3 (default 16G)
#   GPU_CHECK_RANKS       workers SIGKILLed at once for G3 (default 8)
#   GPU_CHECK_COPY_BYTES  bytes moved each way per G2 run (default 2G)
#   GPU_CHECK_SMALL_COPY_BYTES  the same for the 32 KiB run (default 256M)
#   GPU_CHECK_DEVICE      device ordinal (default 0)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${KVWARDEN_BIN:-target/release/kvwarden}
bytes=${GPU_CHECK_BYTES:-16G}
ranks=${GPU_CHECK_RANKS:-8}
copy_bytes=${GPU_CHECK_COPY_BYTES:-2G}
small_bytes=${GPU_CHECK_SMALL_COPY_BYTES:-256M}
device=${GPU_CHECK_DEVICE:-0}
if [ ! -x "$bin" ]; then
  echo "gpu-check: no kvwarden binary at $bin; build it with cargo build --release -p kvwarden-cli, or set KVWARDEN_BIN" >&2
  exit 2
fi
started=$(date +%s)
step() { printf '\n== %s (%ss) ==\n' "$1" "$(( $(date +%s) - started ))"; }

step "devices"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv || true
fi
"$bin" gpu info

step "G1: SIGKILLed worker holding $bytes over CUDA IPC, same host (process-exit proof)"
timeout 120 "$bin" gpu reclaim --bytes "$bytes" --device "$device" --rounds 3 --wait-seconds 10

step "G1 control: the same, but the server cannot know (reaping disabled, worker over TCP)"
timeout 60 "$bin" gpu reclaim --bytes "$bytes" --device "$device" --control --wait-seconds 5

step "G3: $ranks workers x $bytes SIGKILLed at once (an engine's ranks)"
timeout 180 "$bin" gpu reclaim --bytes "$bytes" --workers "$ranks" --device "$device" --rounds 3 --wait-seconds 10

step "G2: store/retrieve device <-> L1 against plain pinned copies"
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 2M --total-bytes "$copy_bytes" --clients 4
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 8M --total-bytes "$copy_bytes" --clients 4

step "issue 16: one client, 8 MiB chunks (a live worker's ping answered false fails the run)"
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 8M --total-bytes "$copy_bytes" --clients 1

step "G2's form with 32 KiB chunks (one vLLM block region of one layer): a copy's fixed cost, 4 clients"
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 32K --total-bytes "$small_bytes" --clients 4

step "VMM memory (cuMemCreate, cuda_vmm): G1's kill once, G2's 2 MiB copies (own lines, vmm_)"
timeout 60 "$bin" gpu reclaim --bytes "$bytes" --device "$device" --rounds 1 --wait-seconds 10 --cuda-allocator vmm
timeout 60 "$bin" gpu copy --device "$device" --chunk-bytes 2M --total-bytes "$copy_bytes" --clients 4 --cuda-allocator vmm

step "done"
