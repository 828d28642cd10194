#!/usr/bin/env bash
# Runs README.md's commands as written, so that the README cannot rot:
#
#   1. every link in the repository's Markdown resolves inside the repository, and
#      nothing points outside it (no contract files beside the checkout);
#   2. the blocks marked `<!-- readme-test: NAME -->`, each verbatim:
#      serve (until it says ready), demo, install (into a scratch root), commands
#      (against that server), python-install and python, whose output must be the
#      block marked python-output; then the server is stopped with SIGTERM and must
#      exit 0 and leave no socket file.
#
#   bash .ci/readme.sh
#
# XDG_RUNTIME_DIR is pointed at a scratch directory, so the server's default socket and
# the clients' default are both there (the README says that is where they look); the
# HTTP default, 127.0.0.1:8080, must be free. The test command (`cargo test
# --workspace`) is what .ci/run runs first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvwarden-readme.XXXXXX")"
serve_pid=""
cleanup() {
  if [ -n "$serve_pid" ]; then kill -TERM -- "-$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

say() { printf '\n=== readme: %s (%s) ===\n' "$1" "$(date -u +%H:%M:%S)"; }
die() { printf '.ci/readme.sh: %s\n' "$1" >&2; exit 1; }

# The fenced block after `<!-- readme-test: NAME -->`, without its fences.
block() {
  local text
  text="$(awk -v name="$1" '
    $0 == "<!-- readme-test: " name " -->" { armed = 1; next }
    armed && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }
  ' "$root/README.md")"
  [ -n "$text" ] || die "README.md has no block marked <!-- readme-test: $1 -->"
  printf '%s\n' "$text"
}

# Every block up front: a missing one stops the script here (an assignment fails with
# its command substitution; a substitution inside another command would not).
serve_block="$(block serve)"
demo_block="$(block demo)"
install_block="$(block install)"
commands_block="$(block commands)"
python_install_block="$(block python-install)"
python_block="$(block python)"
python_output_block="$(block python-output)"

# What the README's commands use besides cargo and python3 (CI: a bare Debian).
if ! command -v curl >/dev/null; then
  [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null || die "curl is missing: install it"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
fi

say "the repository is self-contained: every Markdown link resolves inside it"
if git grep -n -I -e 'shared/spec' -e '\.\./shared' -- . ':!.ci/readme.sh'; then
  die "the lines above point outside the repository"
fi
python3 - <<'PY'
import os, re, subprocess, sys
root = os.getcwd()
files = subprocess.run(["git", "ls-files", "*.md"], capture_output=True, text=True,
                       check=True).stdout.split()
bad = []
for path in files:
    text = open(path, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        resolved = os.path.realpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
        if not resolved.startswith(root + os.sep) and resolved != root:
            bad.append(f"{path}: {target} points outside the repository")
        elif not os.path.exists(resolved):
            bad.append(f"{path}: {target} does not exist")
if bad:
    sys.exit("\n".join(bad))
print(f"ok: links in {len(files)} Markdown files")
PY

export XDG_RUNTIME_DIR="$work/run"
mkdir -m 700 "$XDG_RUNTIME_DIR"

say "serve: $serve_block"
setsid bash -euo pipefail -c "$serve_block" >"$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
# The first release build takes minutes on a 2-core machine.
for _ in $(seq 1800); do
  grep -qx ready "$work/serve.out" && break
  kill -0 "$serve_pid" 2>/dev/null || { tail -20 "$work/serve.err" >&2; die "the server exited"; }
  sleep 0.5
done
grep -qx ready "$work/serve.out" || { tail -20 "$work/serve.err" >&2; die "the server never said ready"; }
cat "$work/serve.out"
grep -qx "socket=$XDG_RUNTIME_DIR/kvwarden.sock" "$work/serve.out" \
  || die "the server's socket is not the default the README names"

say "demo: $demo_block"
timeout 600 bash -euo pipefail -c "$demo_block" >"$work/demo.out" 2>&1 \
  || { cat "$work/demo.out" >&2; die "the demo failed"; }
tail -3 "$work/demo.out"

say "install: $install_block"
# Into a scratch root, building in the workspace's target directory (what was just
# built is reused).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
CARGO_INSTALL_ROOT="$work/cargo" bash -euo pipefail -c "$install_block"
export PATH="$work/cargo/bin:$PATH"
command -v kvwarden

say "commands"
printf '%s\n' "$commands_block"
bash -euo pipefail -c "$commands_block" >"$work/commands.out" 2>&1 \
  || { cat "$work/commands.out" >&2; die "a command failed"; }
grep -q "kvwarden_tracked_instances" "$work/commands.out" || die "no metrics from curl"

say "python-install: $(tr '\n' ';' <<<"$python_install_block")"
if ! python3 -c 'import ensurepip, venv' 2>/dev/null && [ "$(id -u)" -eq 0 ] \
  && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
# In a scratch directory that sees the checkout's python/: the venv the block makes
# goes there, not into the checkout.
mkdir "$work/py"
ln -s "$root/python" "$work/py/python"
(cd "$work/py" && bash -euo pipefail -c "$python_install_block") >"$work/pip.out" 2>&1 \
  || { cat "$work/pip.out" >&2; die "the Python install failed"; }

say "python: the quick start"
"$work/py/.venv/bin/python" -c "$python_block" >"$work/python.out" 2>"$work/python.err" \
  || { cat "$work/python.out" "$work/python.err" >&2; die "the Python quick start failed"; }
cat "$work/python.out"
if ! diff -u <(printf '%s\n' "$python_output_block") "$work/python.out"; then
  die "the quick start does not print what the README says (diff above)"
fi

say "stop the server: SIGTERM"
kill -TERM -- "-$serve_pid"
status=0
wait "$serve_pid" || status=$?
serve_pid=""
[ "$status" -eq 0 ] || { tail -5 "$work/serve.err" >&2; die "the server exited with $status after SIGTERM"; }
[ ! -e "$XDG_RUNTIME_DIR/kvwarden.sock" ] || die "the server left its socket file behind"
echo "exit 0, socket removed"

say "done"
