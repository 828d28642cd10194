#!/usr/bin/env bash
# Every GPU check as one prepared job, for a GPU host lent for minutes: gpu-check.sh
# (G1, G1's control, G3, G2) then gpu-kv-check.sh (the vLLM connector's CUDA route, and
# its figures G4-G6),
# each under a time limit, then a summary of the figures in their stable form.
#
#   KVWARDEN_BIN=path/to/kvwarden shell-mio/scripts/gpu-all.sh
#
# Exit 0: everything ran and passed; 1: a check failed or ran out of time (its output
# says which; a ping answered `false`, a byte that differs or memory not back all fail);
# 3: gpu-check.sh passed but gpu-kv-check.sh could not run here (no torch with CUDA).
# The whole log is written to $GPU_ALL_LOG (default $OUT/gpu-all.log when $OUT is set,
# else gpu-all.log in a fresh temporary directory), the summary to standard output.
#   GPU_ALL_LIMIT_SECONDS   limit for gpu-check.sh (default 300; gpu-kv-check.sh gets 240)
# and gpu-check.sh's GPU_CHECK_* variables.
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${GPU_ALL_LOG:-${OUT:+$OUT/gpu-all.log}}
log=${log:-$(mktemp -d)/gpu-all.log}
limit=${GPU_ALL_LIMIT_SECONDS:-300}
bin=${KVWARDEN_BIN:-target/release/kvwarden}
{
  echo "gpu-all: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n); $("$bin" --version 2>&1)${KVWARDEN_COMMIT:+ (commit $KVWARDEN_COMMIT)}"
} | tee "$log"

timeout --kill-after=10 "$limit" bash shell-mio/scripts/gpu-check.sh >>"$log" 2>&1
check=$?
timeout --kill-after=10 240 bash shell-mio/scripts/gpu-kv-check.sh >>"$log" 2>&1
kv=$?

echo "== summary (log: $log) =="
grep -E '^G[123] ' "$log" || echo "no G1-G3 figures were printed"
grep -E '^gpu_kv (G[456]_|pinned_)' "$log" || echo "no G4-G6 figures were printed"
case $check in
  0) echo "gpu-check passed" ;;
  124|137) echo "gpu-check FAILED: ran past its ${limit} s limit" ;;
  *) echo "gpu-check FAILED (exit $check); its output ends:"; grep -v '^G[123] ' "$log" | tail -15 ;;
esac
case $kv in
  0) echo "gpu-kv-check passed" ;;
  2) echo "gpu-kv-check SKIPPED (cannot run here): $(grep -E '^gpu-kv-check|cannot' "$log" | tail -1)" ;;
  124|137) echo "gpu-kv-check FAILED: ran past its 240 s limit" ;;
  *) echo "gpu-kv-check FAILED (exit $kv); its output ends:"; tail -15 "$log" ;;
esac
if [ "$check" -ne 0 ] || { [ "$kv" -ne 0 ] && [ "$kv" -ne 2 ]; }; then exit 1; fi
if [ "$kv" -eq 2 ]; then exit 3; fi
exit 0
