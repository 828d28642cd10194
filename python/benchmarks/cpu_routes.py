"""The two routes a CPU engine's blocks can take to L1, measured in one run.

    KVWARDEN_BIN=target/release/kvwarden python3 python/benchmarks/cpu_routes.py

(with ``./python`` installed). Starts a kvwarden server on a private socket; for each
block size, moves the same blocks through

- ``staged``: copy the block into a registered memfd, ``store`` (the server copies it
  to L1); ``retrieve`` (the server copies it back), copy it out: one round trip a block;
- ``engine_driven``: ``prepare_store``, copy into the mapped L1 slot, ``commit_store``;
  ``prepare_retrieve``, copy out, ``commit_retrieve``: two round trips a block.

Prints ``cpu_routes ROUTE block_bytes=N save_us_per_block=… load_us_per_block=…``
(medians of rounds). The vLLM connector's CPU route is ``staged`` (docs/vllm.md).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from kvwarden import MemfdBuffer, Worker

BLOCKS = 256
ROUNDS = 5
SIZES = (16 << 10, 256 << 10, 1 << 20)


def staged(worker: Worker, buf: MemfdBuffer, blocks: list, tag: str) -> tuple:
    started = time.perf_counter()
    for i, data in enumerate(blocks):
        buf.view[: len(data)] = data
        assert worker.store(f"{tag}/{i}".encode(), 0, 0, len(data))
    saved = time.perf_counter()
    for i, data in enumerate(blocks):
        assert worker.retrieve(f"{tag}/{i}".encode(), 0, 0, nbytes=len(data)) == len(data)
        bytes(buf.view[: len(data)])
    return saved - started, time.perf_counter() - saved


def engine_driven(worker: Worker, blocks: list, tag: str) -> tuple:
    started = time.perf_counter()
    for i, data in enumerate(blocks):
        key = f"{tag}/{i}".encode()
        slot = worker.prepare_store(key)
        slot.view[: len(data)] = data
        del slot
        assert worker.commit_store(key, len(data))
    saved = time.perf_counter()
    for i, data in enumerate(blocks):
        key = f"{tag}/{i}".encode()
        slot = worker.prepare_retrieve(key)
        bytes(slot.view[: len(data)])
        del slot
        assert worker.commit_retrieve(key)
    return saved - started, time.perf_counter() - saved


def main() -> None:
    binary = os.environ.get("KVWARDEN_BIN", "target/release/kvwarden")
    if not os.access(binary, os.X_OK):
        sys.exit(
            f"no kvwarden binary at {binary}: "
            "cargo build --release -p kvwarden-cli, or set KVWARDEN_BIN"
        )
    with tempfile.TemporaryDirectory(prefix="kvw-routes-") as tmp:
        sock = os.path.join(tmp, "kv.sock")
        server = subprocess.Popen(
            [
                binary,
                "serve",
                "--socket",
                sock,
                "--http",
                "off",
                "--l1-bytes",
                "4G",
                "--slot-bytes",
                "1M",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while not os.path.exists(sock):
                time.sleep(0.05)
            with Worker(sock) as a, Worker(sock) as b, MemfdBuffer.create(1 << 20) as buf:
                a.register_kv_cache([buf], model_name="bench")
                b.register_engine_driven("bench")
                for size in SIZES:
                    blocks = [os.urandom(size)] * BLOCKS
                    for name in ("staged", "engine_driven"):
                        rows = []
                        for r in range(ROUNDS):
                            tag = f"{name}/{size}/{r}"
                            rows.append(
                                staged(a, buf, blocks, tag)
                                if name == "staged"
                                else engine_driven(b, blocks, tag)
                            )
                        save = statistics.median(s for s, _ in rows) / BLOCKS * 1e6
                        load = statistics.median(x for _, x in rows) / BLOCKS * 1e6
                        print(
                            f"cpu_routes {name} block_bytes={size} save_us_per_block={save:.1f} "
                            f"load_us_per_block={load:.1f}",
                            flush=True,
                        )
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(30)


if __name__ == "__main__":
    main()
