"""The serving benchmark's fairness check (``python/benchmarks/vllm_serving.py``, issue
46): two servers whose start-up logs differ only in the connector's identity, ports,
process ids and durations have no ``config_diff``; a difference in what vLLM decided
(the CPU binding that made a baseline without a connector compute on one core of two)
or in a process's thread affinity is named, so the ratios are refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import vllm_serving  # noqa: E402


def startup_log(port: int, pid: int, connector: str, socket: str, cores: str) -> List[str]:
    """Start-up lines as vLLM 0.32 on CPU writes them (from a real run, shortened)."""
    reserve = "1" if cores == "[0]" else "2"
    reserved = "[1]" if cores == "[0]" else "[]"
    return [
        f"=== python -m vllm.entrypoints.openai.api_server --port {port}",
        f"(APIServer pid={pid}) INFO 12-05 11:22:26 [api_utils.py:286] non-default args: "
        f"{{'host': '127.0.0.1', 'port': {port}, 'block_size': 32, 'kv_transfer_config': "
        f"KVTransferConfig(kv_connector='{connector}', engine_id='be145d02-a585-44f8-8a3c-"
        f"e77204fb754b', kv_connector_extra_config={{'kvwarden_socket': '{socket}'}})}}",
        f"(EngineCore pid={pid + 7}) INFO 12-05 11:22:40 [ompmultiprocessing.py:185] "
        f"\tlocal_world_size=1, reserve_cpu_num={reserve}",
        f"(EngineCore pid={pid + 7}) INFO 12-05 11:22:40 [ompmultiprocessing.py:185] "
        f"\tlocal_rank=0, core ids={cores}",
        f"(EngineCore pid={pid + 7}) INFO 12-05 11:22:40 [ompmultiprocessing.py:185] "
        f"\treserved_cpus={reserved}",
        f"(Worker pid={pid + 9}) INFO 12-05 11:22:59 [parallel_state.py:1906] world_size=1 "
        f"distributed_init_method=file:///tmp/vllm_dist_{pid:x}0ae13317 backend=gloo",
        f"[W1205 11:22:59.61368{pid} utils.cpp:68] Warning: NUMA binding: MEMBIND",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:01<00:00,  1.21s/it]",
        f"(Worker pid={pid + 9}) INFO 12-05 11:22:59 [default_loader.py:501] Loading weights "
        f"took 0.{pid % 97} seconds",
        f"(Worker pid={pid + 9}) INFO 12-05 11:22:59 [factory.py:62] Creating v1 connector "
        f"with name: {connector} and engine_id: 1e145d02-a585-44f8-8a3c-e77204fb754b",
        f"(Worker pid={pid + 9}) INFO 12-05 11:23:00 [vllm.py:410] kvwarden: registered "
        f"on {socket}",
        f"(EngineCore pid={pid + 7}) INFO 12-05 11:23:00 [kv_cache_utils.py:2327] CPU KV "
        "cache size: 131,072 tokens",
        f"(APIServer pid={pid}) INFO 12-05 11:23:06 [entry.py:140] Starting vLLM server on "
        f"http://127.0.0.1:{port}",
        f"(APIServer pid={pid}) INFO 12-05 11:23:09 [loggers.py:1] Avg prompt throughput: "
        f"{pid % 13} tokens/s",
    ]


def settings(tmp_path: Path, name: str, lines: List[str], processes=None) -> dict:
    path = tmp_path / f"{name}.log"
    path.write_text("\n".join(lines) + "\n")
    return {"log": vllm_serving.log_settings(str(path), 0), "processes": processes or {}}


WORKER_BOTH_CORES = {"VLLM::Worker": ["threads on cpus ['0', '1'], env ['OMP_NUM_THREADS=2']"]}
WORKER_ONE_CORE = {"VLLM::Worker": ["threads on cpus ['0'], env ['OMP_NUM_THREADS=1']"]}


def test_servers_differing_only_in_the_connector_have_no_config_diff(tmp_path: Path) -> None:
    baseline = settings(
        tmp_path,
        "baseline",
        startup_log(18001, 16044, "NoOpConnector", "", "[0, 1]"),
        WORKER_BOTH_CORES,
    )
    kvwarden = settings(
        tmp_path,
        "kvwarden",
        startup_log(18002, 16045, "KvwardenConnector", "/tmp/kvw-x/kv.sock", "[0, 1]"),
        WORKER_BOTH_CORES,
    )
    # The comparison reads the lines: the OpenMP binding and the KV cache size are there.
    assert any("core ids=[0, 1]" in line for line in baseline["log"])
    assert any("131,072 tokens" in line for line in baseline["log"])
    # Nothing after vLLM's "Starting vLLM server on" (the load's own lines) is read.
    assert not any("Avg prompt throughput" in line for line in baseline["log"])
    assert vllm_serving.settings_diff(baseline, kvwarden) == []


def test_a_different_cpu_binding_is_named(tmp_path: Path) -> None:
    # Issue 46: without any connector vLLM reserved a core and computed on one.
    baseline = settings(
        tmp_path, "baseline", startup_log(18001, 16044, "NoOpConnector", "", "[0]")
    )
    kvwarden = settings(
        tmp_path,
        "kvwarden",
        startup_log(18002, 16045, "KvwardenConnector", "/tmp/kvw-x/kv.sock", "[0, 1]"),
    )
    differences = vllm_serving.settings_diff(baseline, kvwarden)
    assert "log line only in baseline: EngineCore [ompmultiprocessing.py:185] \t" \
        "local_rank=0, core ids=[0]" in differences, differences
    assert any(
        line.startswith("log line only in kvwarden:") and "reserve_cpu_num=2" in line
        for line in differences
    ), differences
    assert len(differences) == 6, differences


def test_a_different_thread_affinity_is_named(tmp_path: Path) -> None:
    lines = startup_log(18001, 16044, "NoOpConnector", "", "[0, 1]")
    baseline = settings(tmp_path, "baseline", lines, WORKER_ONE_CORE)
    kvwarden = settings(tmp_path, "kvwarden", lines, WORKER_BOTH_CORES)
    assert vllm_serving.settings_diff(baseline, kvwarden) == [
        f"process VLLM::Worker: baseline {WORKER_ONE_CORE['VLLM::Worker']}, "
        f"kvwarden {WORKER_BOTH_CORES['VLLM::Worker']}"
    ]
