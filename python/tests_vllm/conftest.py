"""Fixtures of the tests against a real vLLM (``bash python/vllm-ci.sh``): a real
kvwarden server, the tiny model's directory, and helpers to store blocks under the
connector's keys."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # real_server.py, shared with tests/

from engine_child import write_model  # noqa: E402
from real_server import RealServer, find_binary  # noqa: E402

from kvwarden import MemfdBuffer, Worker, prefix  # noqa: E402


@pytest.fixture
def short_tmp() -> Iterator[str]:
    # Unix socket paths must stay under 108 bytes: not pytest's long tmp_path.
    with tempfile.TemporaryDirectory(prefix="kvw-vllm-") as path:
        yield path


@pytest.fixture
def server(short_tmp: str) -> Iterator[RealServer]:
    binary = find_binary()
    if binary is None:
        pytest.fail("no kvwarden binary: set KVWARDEN_BIN or cargo build -p kvwarden-cli")
    # The connector's worker pings every 10 s (its default): reap after 60 s.
    real = RealServer(
        binary,
        os.path.join(short_tmp, "kv.sock"),
        os.path.join(short_tmp, "server.log"),
        reap_timeout_seconds=60.0,
        registration_grace_seconds=120.0,
    )
    real.start()
    try:
        yield real
    finally:
        real.stop()


@pytest.fixture(scope="module")
def module_tmp() -> Iterator[str]:
    """A directory for one test module's engines and server (module-scoped fixtures)."""
    with tempfile.TemporaryDirectory(prefix="kvw-vllm-") as path:
        yield path


@pytest.fixture(scope="module")
def model(module_tmp: str) -> str:
    return write_model(os.path.join(module_tmp, "model"))


@pytest.fixture(scope="module")
def module_server(module_tmp: str) -> Iterator[RealServer]:
    """One server for a whole test module, with the same timeouts as ``server``."""
    real = RealServer(
        find_binary() or pytest.fail("no kvwarden binary: set KVWARDEN_BIN"),
        os.path.join(module_tmp, "kv.sock"),
        os.path.join(module_tmp, "server.log"),
        reap_timeout_seconds=60.0,
        registration_grace_seconds=120.0,
    )
    real.start()
    try:
        yield real
    finally:
        real.stop()


@pytest.fixture
def model_dir(short_tmp: str) -> str:
    return write_model(os.path.join(short_tmp, "model"))


def store_blocks(socket_path: str, keys: List[bytes], payload: bytes = b"x" * 256) -> None:
    """Stores a record under each server key (what ``lookup`` finds), from a worker of
    the test process that shuts down cleanly."""
    with Worker(socket_path) as worker, MemfdBuffer.create(1 << 20, "test-blocks") as buffer:
        worker.register_kv_cache([buffer], model_name="test")
        for key in keys:
            record = prefix.pack_header(key, payload, b"\0" * 8) + payload
            buffer.view[: len(record)] = record
            assert worker.store(key, 0, 0, len(record)), "the test could not store a block"
