"""The serving benchmark's baseline: a vLLM KV connector that does nothing.

vLLM changes more than the connector when any ``--kv-transfer-config`` is set. On CPU,
``vllm/utils/ompmultiprocessing.py`` reserves one more core per rank for the connector;
on a 2-core machine that leaves no core to reserve, so the engine computes on both,
where the same server without a connector reserves one and computes on one. The
"without" side of ``vllm_serving.py`` therefore runs this connector: both servers go
through vLLM's connector plumbing, and they differ only in kvwarden.

Loaded by vLLM through ``kv_connector_module_path`` (the benchmark puts this directory
on the servers' ``PYTHONPATH``). It never loads, never saves, and holds no state.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

#: The ``--kv-transfer-config`` of the baseline server.
KV_TRANSFER_CONFIG = {
    "kv_connector": "NoOpConnector",
    "kv_connector_module_path": "baseline_connector",
    "kv_role": "kv_both",
}


class NoOpConnector(KVConnectorBase_V1):
    """Every hook returns at once: no external hit, nothing to load or save."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
