#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60) on stable Rust.
#   fuzz/run.sh [SECONDS] [TARGET...]
# The checked-in seed corpora (fuzz/corpus/<target>) are read, never written: new inputs
# go to a scratch directory. A crash leaves its input in fuzz/artifacts/<target>/ and
# makes this script exit non-zero; keep it as a regression seed in fuzz/corpus/<target>.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-60}
shift || true
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "cargo-fuzz is missing: cargo install cargo-fuzz --locked" >&2
  exit 2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cargo fuzz build --sanitizer none >/dev/null 2>&1 || cargo fuzz build --sanitizer none
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target" "$scratch/$target"
  printf 'fuzz %s for %ss ... ' "$target" "$seconds"
  log="$scratch/$target.log"
  if cargo fuzz run --sanitizer none "$target" "$scratch/$target" "corpus/$target" -- \
      -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1; then
    runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo '?')
    echo "ok, $runs executions"
  else
    echo "FAILED"
    grep -E 'panicked|ERROR|SUMMARY|Test unit written' "$log" | head -20 >&2
    exit 1
  fi
done
