#!/usr/bin/env bash
# The vLLM connector's CUDA route on a host with an NVIDIA GPU and PyTorch (no vLLM
# needed): KV tensors laid out like vLLM's GPU KV cache registered as CudaIpcBuffers,
# blocks stored, zeroed, retrieved elsewhere, bytes compared; then the connector's
# asynchronous path (its GPU route on save and load lanes while other blocks are being
# written), bytes compared again; then the route's figures G4-G6 on a Llama-3-8B-shaped
# cache (docs/targets.md, docs/vllm.md).
#
#   KVWARDEN_BIN=path/to/kvwarden shell-mio/scripts/gpu-kv-check.sh
#
# Exit 0: every byte came back; 1: some did not; 2: cannot run here (no torch, no
# CUDA, no binary). Takes under a minute (1.25 GiB of device memory for the figures).
#   PYTHON            interpreter with torch (default python3)
#   GPU_CHECK_DEVICE  device ordinal (default 0)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
export KVWARDEN_BIN=${KVWARDEN_BIN:-target/release/kvwarden}
# No torch (or no interpreter): exit 2 at once, before any pip install.
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "gpu-kv-check: cannot run here: $python has no PyTorch (set PYTHON to an interpreter with a CUDA build of torch)" >&2
  exit 2
fi
if ! "$python" -c 'import msgpack' 2>/dev/null; then
  # The client's one dependency, into a scratch dir (the image has torch, maybe not it).
  deps="$(mktemp -d)"; trap 'rm -rf "$deps"' EXIT
  "$python" -m pip install -q --target "$deps" msgpack \
    || { echo "gpu-kv-check: msgpack is missing and pip could not install it" >&2; exit 2; }
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout 300 "$python" python/scripts/gpu_kv_check.py
# The route again in an engine with expandable segments (vLLM's KV tensors then have no
# CUDA IPC handle; the route's own staging buffers must register all the same), after a
# tensor of such a segment registered as cuda_vmm (its POSIX fd), bytes compared.
echo "gpu-kv-check: the asynchronous path under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True GPU_KV_CHECK_ONLY=async \
  timeout 120 "$python" python/scripts/gpu_kv_check.py
