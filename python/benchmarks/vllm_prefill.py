"""Prefill saved by kvwarden on the second run of a long prompt (vLLM on CPU).

    KVWARDEN_BIN=target/release/kvwarden \\
      ~/.cache/kvwarden/vllm-venv-…/bin/python python/benchmarks/vllm_prefill.py

(the venv of ``python/vllm-ci.sh``, with ``./python`` installed in it). Starts a kvwarden
server on a private socket and one vLLM engine with the kvwarden connector (a random
llama-like model written to a temp dir: 8 layers, hidden 512; nothing is downloaded).
Each round generates one token for a fresh prompt twice: the first run computes the
whole prompt and saves its blocks, the second loads them and computes the last block.
Prints one figure per line, medians over the rounds: ``vllm_prefill NAME VALUE``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests_vllm"))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import engine_child  # noqa: E402  (the model writer and engine settings of the tests)

MODEL = engine_child.BENCH_MODEL_CONFIG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    binary = os.environ.get("KVWARDEN_BIN") or os.path.join(
        HERE, "..", "..", "target", "release", "kvwarden"
    )
    if not os.access(binary, os.X_OK):
        sys.exit(
            f"no kvwarden binary at {binary}: "
            "cargo build --release -p kvwarden-cli, or set KVWARDEN_BIN"
        )

    with tempfile.TemporaryDirectory(prefix="kvw-bench-") as tmp:
        socket_path = os.path.join(tmp, "kv.sock")
        server = subprocess.Popen(
            [binary, "serve", "--socket", socket_path, "--http", "off", "--l1-bytes", "1G"],
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(tmp, "server.log"), "wb"),
        )
        try:
            while not os.path.exists(socket_path):
                if server.poll() is not None:
                    sys.exit(f"kvwarden exited with {server.returncode}")
                time.sleep(0.05)
            run(args, engine_child.write_model(os.path.join(tmp, "model"), MODEL), socket_path)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(30)


def run(args: argparse.Namespace, model_dir: str, socket_path: str) -> None:
    sys.stdout, out = sys.stderr, sys.stdout  # vLLM's prints go to stderr
    llm = engine_child.make_llm(model_dir, socket_path)
    scheduler, worker = engine_child.connectors(llm)
    engine_child.generate(llm, [[5] * 64], 1)  # warm-up
    rows = []
    for round_index in range(args.rounds):
        prompt = [
            (i * 31 + round_index * 7919) % (MODEL["vocab_size"] - 3) + 3
            for i in range(args.prompt_tokens)
        ]
        row = {}
        for run_name in ("first", "second"):
            before_s, before_w = dict(scheduler.stats), dict(worker.stats)
            started = time.perf_counter()
            engine_child.generate(llm, [prompt], 1)
            row[run_name + "_seconds"] = time.perf_counter() - started
            matched = scheduler.stats["matched_tokens"] - before_s["matched_tokens"]
            row[run_name + "_prefill_tokens"] = args.prompt_tokens - matched
            for name in ("load_seconds", "save_seconds", "blocks_loaded", "blocks_saved"):
                row[f"{run_name}_{name}"] = worker.stats[name] - before_w[name]
        rows.append(row)
    median = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    print_figures(out, args, median)


def print_figures(out, args: argparse.Namespace, m: dict) -> None:
    import torch
    import vllm

    lines = [
        ("vllm_version", vllm.__version__),
        ("torch_version", torch.__version__),
        (
            "model",
            f"llama-like {MODEL['num_hidden_layers']} layers hidden {MODEL['hidden_size']} bf16",
        ),
        ("prompt_tokens", args.prompt_tokens),
        ("rounds", args.rounds),
        ("block_size", engine_child.BLOCK_SIZE),
        ("first_run_prefill_tokens", int(m["first_prefill_tokens"])),
        ("second_run_prefill_tokens", int(m["second_prefill_tokens"])),
        ("first_run_seconds", f"{m['first_seconds']:.3f}"),
        ("first_run_save_seconds", f"{m['first_save_seconds']:.3f}"),
        ("first_run_blocks_saved", int(m["first_blocks_saved"])),
        ("second_run_seconds", f"{m['second_seconds']:.3f}"),
        ("second_run_load_seconds", f"{m['second_load_seconds']:.3f}"),
        ("second_run_blocks_loaded", int(m["second_blocks_loaded"])),
        ("prefill_tokens_saved", int(m["first_prefill_tokens"] - m["second_prefill_tokens"])),
        ("seconds_saved", f"{m['first_seconds'] - m['second_seconds']:.3f}"),
        ("second_over_first", f"{m['second_seconds'] / m['first_seconds']:.3f}"),
    ]
    for name, value in lines:
        out.write(f"vllm_prefill {name} {value}\n")
    out.flush()


if __name__ == "__main__":
    main()
