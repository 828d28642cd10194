"""Every name the docs give an operator is one the binary has.

    python3 .ci/docs-check.py ROOT METRICS_TEXT STATUS_JSON HELP_DIR BINARY [DOC ...]

Reads the code spans (`...`) of README.md, docs/*.md and python/README.md (or the DOCs
given) and looks each name up in what a live server showed:

- a metric (`kvwarden_...`): a series or family of METRICS_TEXT (a live /metrics;
  `_bucket`, `_sum`, `_count` of a histogram count), else a `kv_connector_extra_config`
  key of the vLLM connector (python/src/kvwarden/vllm.py) or a crate name; one written
  `vllm:kvwarden_NAME_total` (or a `*` pattern of them) is the connector's counter on
  vLLM's /metrics, and NAME must be a key of COUNTERS in
  python/src/kvwarden/vllm_metrics.py;
- a log target (`kvwarden::...`): a module of the `kvwarden` crate (a file under
  shell-mio/src/, or a folder with mod.rs);
- a status field (a dotted path whose first part is a key of STATUS_JSON, e.g.
  `worker_liveness.enabled`, `instances[].tenant`): present in STATUS_JSON (a live
  /status; `[]` looks into the first element of an array, and a server without
  `--l2` or a GPU has no `l2` / GPU fields: those are allowed absent);
- a flag of `kvwarden` (a span that starts with `--`, or `kvwarden CMD ... --flag`): in
  some `kvwarden ... --help` text saved under HELP_DIR (one file per command).
- a path in the repository (a span such as `core/src/node/l2/` or
  `tests/tests/l2.rs`, under one of its top folders, `:line` or `#anchor` after it
  allowed): a file or folder under ROOT;
- a quoted log line or message: a line `LEVEL kvwarden::target: message fields`, a span
  right after a level or a verb of saying (`WARNING `...``, `ERROR (`...`)`, `logs
  `...``, `says`, `prints`) and a span that starts with `kvwarden: ` (the Python
  client's and connector's log lines): each run of three or more plain words of the
  message (split at `…`, `...`, `<…>`, words in capitals (N, PATH) and
  values: a word with a digit, `/`, `=`, `_` or a quote; `key=value` fields cut off) is
  in BINARY's strings or in python/src/ (its string literals joined), whole or in two
  parts of two words or more (a `{}` between them).

Exits 1 naming every name it could not find, with the file and line.
"""

import json
import os
import re
import sys

SPAN = re.compile(r"`([^`\n]+)`")
METRIC = re.compile(r"(?<!vllm:)\bkvwarden_[a-z0-9_]+\b")
VLLM_METRIC = re.compile(r"\bvllm:kvwarden_([a-z0-9_]+?)(_total)?(?![a-z0-9_*])")
TARGET = re.compile(r"\bkvwarden::[a-z0-9_:]+[a-z0-9_]")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
PATH = re.compile(r"^[a-z_][a-z0-9_]*(\[\])?(\.[a-z_*][a-z0-9_*]*(\[\])?)+$")
FILE = re.compile(r"\.(md|rs|toml|py|sh|json|ya?ml|txt|service)$")
# A path in the repository: under one of its top folders, plain path characters only (a
# pattern with `*`, `<…>` or `{…}` is left alone); a `:line` or `#anchor` after it is not
# part of the path.
REPO_PATH = re.compile(
    r"^(?:\./)?((?:core|shell-mio|shell-sim|client|bench|tests|python|docs|deploy|fuzz|\.ci)"
    r"/[A-Za-z0-9_./-]*?)/?(?::\d+(?:-\d+)?|#[a-z0-9-]+)?$"
)
# Paths the repository makes at run time, never committed.
MADE_PATHS = ("python/.venv", "python/.pydeps")
CRATES = {"kvwarden_core", "kvwarden_client", "kvwarden_bench", "kvwarden_sim", "kvwarden_tests"}
# Flags of other tools that the docs name in a span of their own (vLLM's, Redis's, cargo's,
# curl's, pip's, promtool's, systemd's, the simulator's). A span that starts with another
# command (`vllm serve --x`, `cargo test --workspace`) is not read for flags at all.
FOREIGN_FLAGS = {
    "--kv-transfer-config", "--kv-cache-memory-bytes", "--block-size", "--max-model-len",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--dtype",
    "--load-format", "--tls-port", "--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file",
    "--release", "--workspace", "--locked", "--path", "--all-targets", "--check",
    "--seeds", "--seeds-file", "--check-determinism", "--determinism-every", "--stats",
    "--strict", "--cluster-enabled", "--save", "--appendonly", "--port", "--unixsocket",
    "--pid", "--fork", "--mount-proc", "--kill-child", "--reuid", "--regid", "--clear-groups",
    "--sanitizer", "--features", "--no-run", "--test", "--lib", "--target", "--help",
    "--version", "--json",
}
L2_PREFIX = "kvwarden_l2_"
# A log line as the server prints it (timestamp left out), and a span right after a level.
LOG_LINE = re.compile(r"^\s*(?:INFO|WARN|ERROR|DEBUG) kvwarden(?:::[a-z0-9_]+)*: (.+)$")
LEVEL_SPAN = re.compile(r"\b(?:INFO|WARN|WARNING|ERROR|logs?|says|prints)\s+\(?`([^`\n]+)`")
# Where a message's literal text breaks: a placeholder or a value.
BREAK = re.compile(r"…|\.\.\.|<[^>]*>|\{[^}]*\}")
VALUE = re.compile(r"[0-9/=_\"'`]|^[A-Z][A-Z_]+$|^[B-HJ-Z]$|^-")
FIELDS = re.compile(r"\s[a-z_]+=\S.*$")


def message_runs(message):
    """The runs of three or more plain words of a quoted message, as written: what must
    be literal text of the binary (or the Python client)."""
    message = FIELDS.sub("", message)
    runs = []
    for piece in BREAK.split(message):
        words = []
        for word in piece.split() + ["0"]:  # a value ends the last run
            if VALUE.search(word.strip(".,;:()[]!?")) or not word.strip(".,;:()[]!?"):
                if len(words) >= 3:
                    runs.append(" ".join(words).strip(" .,;:()"))
                words = []
            else:
                words.append(word)
    return runs


def in_corpus(run, corpus):
    """Whether `run` is in `corpus`, whole or as two parts of two words or more each
    (the binary keeps a format string's pieces apart)."""
    if run in corpus:
        return True
    words = run.split(" ")
    return any(
        " ".join(words[:k]) in corpus and " ".join(words[k:]) in corpus
        for k in range(2, len(words) - 1)
    )


def load_corpus(root, binary):
    """The binary's printable strings and python/src/'s text, whitespace collapsed (a
    Python literal split over lines joined back)."""
    data = open(binary, "rb").read()
    parts = [b" ".join(re.findall(rb"[\x20-\x7e]{4,}", data)).decode("ascii")]
    for folder, _, files in os.walk(os.path.join(root, "python", "src")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                text = re.sub(r"([\"'])\s*\n\s*[rbf]*\1", "", text)
                parts.append(text)
    return re.sub(r"\s+", " ", " ".join(parts))


def load_metrics(path):
    names = set()
    for line in open(path):
        line = line.strip()
        if line.startswith("# TYPE ") or line.startswith("# HELP "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, 1)[0]
            names.add(name)
            for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
                if name.endswith(suffix):
                    names.add(name[: -len(suffix)])
    return names


def module_exists(root, target):
    """A module of the `kvwarden` crate: a file or folder under shell-mio/src/, or a
    crate it re-exports under that name (`pub use kvwarden_client as client;`)."""
    parts = target.split("::")
    if parts[0] != "kvwarden":
        return False
    if len(parts) == 1:
        return True
    lib = open(os.path.join(root, "shell-mio", "src", "lib.rs")).read()
    name = re.escape(parts[1])
    if re.search(r"^pub use ([\w:]+ as %s|[\w:]+::%s);" % (name, name), lib, re.M):
        return True
    base = os.path.join(root, "shell-mio", "src", *parts[1:])
    return os.path.isfile(base + ".rs") or os.path.isfile(os.path.join(base, "mod.rs"))


def lookup(status, path):
    """Whether the dotted `path` (with `[]` for an array's elements) is in `status`."""
    node = status
    for part in path.split("."):
        array = part.endswith("[]")
        key = part[:-2] if array else part
        if key == "*":
            if not isinstance(node, dict) or not node:
                return False
            node = next(iter(node.values()))
        else:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        if array:
            if not isinstance(node, list):
                return False
            if not node:
                return True  # an empty list: its elements' fields cannot be checked here
            node = node[0]
    return True


def main():
    root, metrics_path, status_path, help_dir, binary, *docs = sys.argv[1:]
    corpus = load_corpus(root, binary)
    metrics = load_metrics(metrics_path)
    status = json.load(open(status_path))
    helps = "".join(open(os.path.join(help_dir, f)).read() for f in sorted(os.listdir(help_dir)))
    flags = set(FLAG.findall(helps))
    connector = open(os.path.join(root, "python", "src", "kvwarden", "vllm.py")).read()
    counters_source = open(os.path.join(root, "python", "src", "kvwarden", "vllm_metrics.py")).read()
    counters_block = counters_source.split("COUNTERS", 1)[1].split("}", 1)[0]
    connector_counters = set(re.findall(r'^\s+"([a-z0-9_]+)":', counters_block, re.M))
    assert connector_counters, "no COUNTERS in vllm_metrics.py: the check would prove nothing"
    if not docs:
        docs = ["README.md", "python/README.md"] + sorted(
            os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md")
        )
    problems = []
    checked = 0
    for doc in docs:
        path = doc if os.path.isabs(doc) else os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        for number, line in enumerate(open(path), 1):
            quoted = LEVEL_SPAN.findall(line)
            quoted += [span for span in SPAN.findall(line) if span.startswith("kvwarden: ")]
            logged = LOG_LINE.match(line)
            if logged:
                quoted.append(logged.group(1))
            for message in quoted:
                for run in message_runs(message):
                    checked += 1
                    if not in_corpus(run, corpus):
                        problems.append(
                            f"{doc}:{number}: `{message}`: \"{run}\" is in no message of the binary"
                        )
            for span in SPAN.findall(line):
                where = f"{doc}:{number}: `{span}`"
                for name in METRIC.findall(span):
                    checked += 1
                    if name in metrics or name in CRATES:
                        continue
                    if name.startswith(L2_PREFIX) and "l2" not in status:
                        problems.append(f"{where}: {name}: the checked server runs without --l2")
                        continue
                    if name.startswith("kvwarden_gpu_") and not status.get("gpu", {}).get("available"):
                        continue
                    if f'"{name}"' in connector:
                        continue
                    problems.append(f"{where}: no metric (and no connector setting) {name}")
                for name, _ in VLLM_METRIC.findall(span):
                    checked += 1
                    if name not in connector_counters:
                        problems.append(f"{where}: the vLLM connector has no counter {name}")
                for target in TARGET.findall(span):
                    checked += 1
                    if not module_exists(root, target):
                        problems.append(f"{where}: no module {target} (a log target names one)")
                text = span.strip()
                first = text.split()[0] if text.split() else ""
                if first.startswith("--") or first == "kvwarden":
                    for flag in FLAG.findall(text):
                        checked += 1
                        if flag not in flags and flag not in FOREIGN_FLAGS:
                            problems.append(f"{where}: `kvwarden` has no flag {flag}")
                repo_path = REPO_PATH.match(text)
                # `NN-short-name.toml`: a placeholder in capitals names a pattern, not a path.
                if (
                    repo_path
                    and not repo_path.group(1).startswith(MADE_PATHS)
                    and not re.search(r"\b[A-Z]{2,}\b", repo_path.group(1))
                ):
                    checked += 1
                    if not os.path.exists(os.path.join(root, repo_path.group(1))):
                        problems.append(f"{where}: no such path in the repository")
                if (
                    PATH.match(text)
                    and not FILE.search(text)
                    and text.split(".")[0].rstrip("[]") in status
                ):
                    checked += 1
                    optional = text.startswith("l2.") or text.startswith("gpu.")
                    if not lookup(status, text) and not optional:
                        problems.append(f"{where}: /status has no field {text}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"docs-check: {len(problems)} of {checked} names are not the binary's", file=sys.stderr)
        sys.exit(1)
    print(f"docs-check: {checked} names in the docs, every one the binary's")


if __name__ == "__main__":
    main()
