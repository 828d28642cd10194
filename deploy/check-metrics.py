"""Checks that every kvwarden metric the rules and the dashboard query exists.

    python3 deploy/check-metrics.py METRICS_TEXT STATUS_JSON RULES_YML DASHBOARD_JSON

METRICS_TEXT is a live server's /metrics, STATUS_JSON its /status. L2 metrics
(`kvwarden_l2_*`) exist only on a server started with --l2: without it (as /status
says) they are allowed absent. A name counts as
queried when it appears in a rule's `expr` or a dashboard target's `expr`; a
`kvwarden:...` name must be recorded by the rule file. Histogram and counter suffixes
matter: `kvwarden_reaps` is not `kvwarden_reaps_total`. Device-memory gauges exist only
on a host with a GPU: on a host without one (as /status says) they are allowed absent.
Exits 1 naming every problem.
"""

import json
import re
import sys

import yaml

GPU_ONLY = {"kvwarden_gpu_memory_bytes"}
# Exposed only by a server started with --l2 (as /status's `l2` section says).
L2_PREFIX = "kvwarden_l2_"
NAME = re.compile(r"\bkvwarden[_:][a-zA-Z0-9_:]*")


def exposed_names(text):
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def dashboard_exprs(dashboard):
    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"dashboard panel {panel.get('title')!r}", target.get("expr", "")


def main(metrics_path, status_path, rules_path, dashboard_path):
    exposed = exposed_names(open(metrics_path).read())
    status = json.load(open(status_path))
    gpu = status.get("gpu", {}).get("available", False)
    l2 = "l2" in status
    rules = yaml.safe_load(open(rules_path))
    recorded = set()
    queries = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recorded.add(rule["record"])
            what = rule.get("record") or rule.get("alert")
            queries.append((f"rule {what}", rule["expr"]))
    queries += list(dashboard_exprs(json.load(open(dashboard_path))))

    problems = []
    checked = set()
    for where, expr in queries:
        names = set(NAME.findall(expr))
        if where.startswith("dashboard") and not names:
            if "kvwarden" not in expr and "up{" not in expr:
                problems.append(f"{where}: queries no kvwarden metric: {expr}")
        for name in names:
            checked.add(name)
            if ":" in name:
                if name not in recorded:
                    problems.append(f"{where}: {name} is not recorded by {rules_path}")
            elif name in exposed:
                pass
            elif name in GPU_ONLY and not gpu:
                pass
            elif name.startswith(L2_PREFIX) and not l2:
                pass
            else:
                problems.append(
                    f"{where}: {name} is not on the live server's /metrics "
                    f"(it has: {', '.join(sorted(n for n in exposed if n.startswith('kvwarden')))})"
                )
    for problem in problems:
        print(f"check-metrics: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check-metrics: {len(checked)} names in {len(queries)} queries, all exposed"
          + ("" if gpu else f" ({', '.join(sorted(GPU_ONLY))}: GPU hosts only, none here)"))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
