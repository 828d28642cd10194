#!/usr/bin/env bash
# Checks every file under deploy/ with the tool that knows its format, and the
# metrics it names against a live server:
#
#   systemd/kvwarden.{socket,service}  systemd-analyze verify (a copy whose ExecStart is the
#                                binary built here; any warning about the unit fails)
#   kubernetes/*.yaml            kubernetes-validate --strict, offline (bundled schemas);
#                                the NetworkPolicy selects the DaemonSet's pods, admits
#                                only its HTTP port and only from named sources
#   prometheus/kvwarden-rules*   promtool check rules, promtool test rules
#   grafana/kvwarden.json        valid JSON, unique panel ids, a query per panel
#   a live kvwarden serve        promtool check metrics on its /metrics; every metric
#                                the rules and the dashboard query is on it
#
#   bash deploy/check.sh         # from anywhere; installs what is missing (root: apt)
#
# Environment: KVWARDEN_BIN (default: `cargo build -p kvwarden-cli`, then
# ${CARGO_TARGET_DIR:-target}/debug/kvwarden), PYTHON (default python3).
# Network: apt and PyPI, only for tools that are missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvwarden-deploy-check.XXXXXX")"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

say() { printf '\n=== deploy: %s (%s) ===\n' "$1" "$(date -u +%H:%M:%S)"; }
die() { printf 'deploy/check.sh: %s\n' "$1" >&2; exit 1; }

# Every file here is checked below; a new one must be added to a check.
say "every file under deploy/ has a check"
known="check.sh check-metrics.py systemd/kvwarden.service systemd/kvwarden.socket kubernetes/daemonset.yaml
kubernetes/networkpolicy.yaml kubernetes/kv-events-networkpolicy.yaml
prometheus/kvwarden-rules.yml prometheus/kvwarden-rules.test.yml grafana/kvwarden.json"
while IFS= read -r file; do
  grep -qxF "$file" <<<"$(tr ' ' '\n' <<<"$known")" \
    || die "deploy/$file has no check: add it to deploy/check.sh"
done < <(cd "$here" && find . -type f ! -name '*.pyc' | sed 's#^\./##' | sort)
echo "ok"

say "tools"
apt_install() {
  command -v apt-get >/dev/null && [ "$(id -u)" -eq 0 ] \
    || die "$1 is missing and cannot be installed here (needs root and apt-get): install $2"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
}
command -v promtool >/dev/null || apt_install promtool prometheus
command -v systemd-analyze >/dev/null || apt_install systemd-analyze systemd
command -v curl >/dev/null || apt_install curl curl
venv="${CARGO_TARGET_DIR:-$root/target}/deploy-check-venv"
if ! "$venv/bin/python" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  rm -rf "$venv"
  "$python" -m venv "$venv" || die "cannot make a venv with $python (install python3-venv)"
  "$venv/bin/python" -m pip --disable-pip-version-check -q install kubernetes-validate pyyaml
fi
promtool --version 2>&1 | head -1
systemd-analyze --version | head -1
"$venv/bin/kubernetes-validate" --version

if [ -n "${KVWARDEN_BIN:-}" ]; then
  bin="$KVWARDEN_BIN"
else
  (cd "$root" && cargo build -p kvwarden-cli)
  bin="${CARGO_TARGET_DIR:-$root/target}/debug/kvwarden"
fi
[ -x "$bin" ] || die "no kvwarden binary at $bin"
bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"

say "systemd: systemd-analyze verify deploy/systemd/kvwarden.socket and kvwarden.service"
# verify needs ExecStart's binary to exist: check a copy that runs the one built here.
grep -q '^ExecStart=/usr/local/bin/kvwarden ' "$here/systemd/kvwarden.service" \
  || die "kvwarden.service: ExecStart no longer starts /usr/local/bin/kvwarden; update this check"
sed "s#^ExecStart=/usr/local/bin/kvwarden #ExecStart=$bin #" \
  "$here/systemd/kvwarden.service" > "$work/kvwarden.service"
cp "$here/systemd/kvwarden.socket" "$work/kvwarden.socket"
# The socket unit and the service agree on the path the workers connect to.
socket_path="$(sed -n 's/^ListenStream=//p' "$here/systemd/kvwarden.socket")"
grep -q -- "--socket $socket_path " "$here/systemd/kvwarden.service" \
  || die "kvwarden.socket listens on $socket_path but kvwarden.service's --socket differs"
verify_log="$work/verify.log"
systemd-analyze verify "$work/kvwarden.socket" "$work/kvwarden.service" >"$verify_log" 2>&1 || {
  cat "$verify_log" >&2
  die "systemd-analyze verify failed"
}
# It only warns about unknown keys and bad values: any line about the unit fails.
if grep -E 'kvwarden\.(service|socket)' "$verify_log" >&2; then
  die "systemd-analyze verify warned about kvwarden.service or kvwarden.socket (above)"
fi
echo "ok"

say "kubernetes: kubernetes-validate --strict deploy/kubernetes/*.yaml (offline)"
offline=()
# No network namespace of its own where it may: proves the schemas are local.
if unshare -n true 2>/dev/null; then offline=(unshare -n); fi
"${offline[@]}" "$venv/bin/kubernetes-validate" --strict "$here"/kubernetes/*.yaml

say "kubernetes: the NetworkPolicy selects the DaemonSet's pods and admits only its HTTP port"
"$venv/bin/python" - "$here/kubernetes/daemonset.yaml" "$here/kubernetes/networkpolicy.yaml" <<'PY'
import sys, yaml
daemonset = yaml.safe_load(open(sys.argv[1]))
policy = yaml.safe_load(open(sys.argv[2]))
pod = daemonset["spec"]["template"]
labels = pod["metadata"]["labels"]
container = next(c for c in pod["spec"]["containers"] if c["name"] == "kvwarden")
http_ports = {p["containerPort"] for p in container["ports"] if p["name"] == "http"}
selector = policy["spec"]["podSelector"]["matchLabels"]
problems = []
if any(labels.get(k) != v for k, v in selector.items()):
    problems.append(f"podSelector {selector} does not select the DaemonSet's pods {labels}")
if policy["spec"].get("policyTypes") != ["Ingress"]:
    problems.append("policyTypes must be [Ingress]: every other ingress denied")
ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
if not ports or ports != http_ports:
    problems.append(f"admitted ports {ports} are not the HTTP port {http_ports}")
if any(not rule.get("from") for rule in policy["spec"]["ingress"]):
    problems.append("an ingress rule without `from` admits every pod in the cluster")
if problems:
    sys.exit("networkpolicy.yaml: " + "; ".join(problems))
print(f"ok: pods {selector}, port {sorted(ports)} from {len(policy['spec']['ingress'])} source rule(s)")
PY

say "kubernetes: the KV-events NetworkPolicy selects the DaemonSet's pods and admits its two ports from named sources"
"$venv/bin/python" - "$here/kubernetes/daemonset.yaml" "$here/kubernetes/kv-events-networkpolicy.yaml" <<'PY'
import sys, yaml
daemonset = yaml.safe_load(open(sys.argv[1]))
policy = yaml.safe_load(open(sys.argv[2]))
labels = daemonset["spec"]["template"]["metadata"]["labels"]
selector = policy["spec"]["podSelector"]["matchLabels"]
problems = []
if any(labels.get(k) != v for k, v in selector.items()):
    problems.append(f"podSelector {selector} does not select the DaemonSet's pods {labels}")
if policy["spec"].get("policyTypes") != ["Ingress"]:
    problems.append("policyTypes must be [Ingress]")
ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
if ports != {5557, 5558}:
    problems.append(f"admitted ports {ports} are not the stream's and its replay's (5557, 5558)")
if any(not rule.get("from") for rule in policy["spec"]["ingress"]):
    problems.append("an ingress rule without `from` lets every pod read a tenant's tokens")
if problems:
    sys.exit("kv-events-networkpolicy.yaml: " + "; ".join(problems))
print(f"ok: pods {selector}, ports {sorted(ports)}")
PY

say "prometheus: promtool check rules, promtool test rules"
promtool check rules "$here/prometheus/kvwarden-rules.yml"
(cd "$here/prometheus" && promtool test rules kvwarden-rules.test.yml)

say "grafana: deploy/grafana/kvwarden.json"
"$venv/bin/python" - "$here/grafana/kvwarden.json" <<'PY'
import json, sys
dashboard = json.load(open(sys.argv[1]))
ids, problems = set(), []
def walk(panels):
    for panel in panels:
        if panel["id"] in ids:
            problems.append(f"panel id {panel['id']} used twice")
        ids.add(panel["id"])
        if "gridPos" not in panel:
            problems.append(f"panel {panel['title']!r} has no gridPos")
        if panel["type"] != "row" and not panel.get("targets"):
            problems.append(f"panel {panel['title']!r} queries nothing")
        walk(panel.get("panels", []))
walk(dashboard["panels"])
if problems:
    sys.exit("kvwarden.json: " + "; ".join(problems))
print(f"ok: {len(ids)} panels, uid {dashboard['uid']}")
PY

say "a live server: promtool check metrics, every queried metric exposed"
"$bin" serve --socket "$work/kvwarden.sock" --http 127.0.0.1:0 \
  >"$work/serve.out" 2>"$work/serve.log" &
server_pid=$!
for _ in $(seq 300); do
  grep -qx ready "$work/serve.out" && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.log" >&2; die "the server exited at start"; }
  sleep 0.1
done
grep -qx ready "$work/serve.out" || { cat "$work/serve.log" >&2; die "the server never said ready"; }
http="$(sed -n 's/^http=//p' "$work/serve.out")"
# One request that is refused (exit 3: an error reply), so that the request and error
# counters have a series.
status=0
"$bin" call --socket "$work/kvwarden.sock" ping >/dev/null || status=$?
[ "$status" -eq 3 ] || die "kvwarden call of a refused request exited $status, expected 3"
curl -fsS "http://$http/metrics" >"$work/metrics.txt"
curl -fsS "http://$http/status" >"$work/status.json"
# /metrics as served, the way operators check it: the classic text format unless the
# scraper asks for OpenMetrics.
promtool check metrics <"$work/metrics.txt"
echo "promtool check metrics: ok"
curl -fsS -H 'Accept: application/openmetrics-text; version=1.0.0' "http://$http/metrics" \
  | tail -1 | grep -qx '# EOF' || die "an OpenMetrics scrape did not end with # EOF"
curl -fsSI "http://$http/healthz" | head -1 | grep -q ' 200 ' || die "HEAD /healthz is not 200"
echo "OpenMetrics on request, HEAD /healthz: ok"
"$venv/bin/python" "$here/check-metrics.py" "$work/metrics.txt" "$work/status.json" \
  "$here/prometheus/kvwarden-rules.yml" "$here/grafana/kvwarden.json"
kill -TERM "$server_pid"
wait "$server_pid" || die "the server exited with $? after SIGTERM; expected 0"
server_pid=""
[ ! -e "$work/kvwarden.sock" ] || die "the server left its socket file behind"

say "done"
