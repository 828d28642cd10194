#!/usr/bin/env bash
# The minimum Rust version the README states is the one the build needs: every package
# in the lock file (ours and every dependency, for this host's platform) declares a
# `rust-version` no newer than the workspace's `rust-version`, and that is the README's
# "Rust X or later". (Library APIs newer than it are caught by clippy's
# `incompatible_msrv` lint, which reads the same `rust-version`, in the lint stage.)
# Needs only cargo and python3: no other toolchain is downloaded.
#
#   bash .ci/msrv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
host="$(rustc -vV | sed -n 's/^host: //p')"
cargo metadata --format-version 1 --locked --filter-platform "$host" >"${TMPDIR:-/tmp}/kvwarden-metadata.json"
python3 - "${TMPDIR:-/tmp}/kvwarden-metadata.json" <<'PY'
import json, re, sys

def version(text):
    return tuple(int(part) for part in (text.split(".") + ["0", "0"])[:3])

meta = json.load(open(sys.argv[1]))
ours = [p for p in meta["packages"] if p["id"] in meta["workspace_members"]]
declared = {p.get("rust_version") for p in ours}
if len(declared) != 1 or None in declared:
    sys.exit("msrv: the workspace packages declare %s; give all one rust-version" % sorted(map(str, declared)))
msrv = declared.pop()
stated = re.search(r"\*\*Rust (\d+\.\d+) or later\*\*", open("README.md").read())
if not stated or version(stated.group(1)) != version(msrv):
    sys.exit("msrv: README.md says Rust %s or later, Cargo.toml says %s"
             % (stated.group(1) if stated else "(nothing)", msrv))
newer = sorted((p["name"], p["version"], p["rust_version"]) for p in meta["packages"]
               if p.get("rust_version") and version(p["rust_version"]) > version(msrv))
for name, ver, needs in newer:
    print("msrv: %s %s needs Rust %s, above the workspace rust-version %s" % (name, ver, needs, msrv),
          file=sys.stderr)
if newer:
    sys.exit(1)
need = max((version(p["rust_version"]), p["name"]) for p in meta["packages"] if p.get("rust_version"))
print("msrv: Rust %s (README.md and Cargo.toml agree); the most demanding dependency, %s, needs %s"
      % (msrv, need[1], ".".join(map(str, need[0]))))
PY
