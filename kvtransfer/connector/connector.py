"""``PdservePullConnector``: vLLM V1 KV connector that pulls KV over one-sided UCX reads.

Load it with::

    --kv-transfer-config '{"kv_connector": "PdservePullConnector",
                           "kv_connector_module_path": "kvtransfer.connector.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lease_s": 30}}'

vLLM builds the class twice: the SCHEDULER instance (engine-core process) delegates to
:class:`SchedulerHalf`, the WORKER instance (model-runner process) to :class:`WorkerHalf`.
Either role serves both directions: a request with ``do_remote_decode`` is prefilled and
leased, one with ``do_remote_prefill`` is pulled.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.metadata import PdserveHandshakeMetadata, PdserveMetadata
from kvtransfer.connector.scheduler import SchedulerHalf
from kvtransfer.connector.worker import WorkerHalf
from kvtransfer.stats import TransferPromMetrics, TransferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _attach_logging() -> None:
    """Show kvtransfer's logs inside vLLM processes (vLLM configures only its own logger)."""
    root = logging.getLogger("kvtransfer")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        "(pdserve-kv pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PDSERVE_KV_LOG_LEVEL", "INFO"))
    root.propagate = False


def _compat_facts(vllm_config: VllmConfig) -> dict[str, object]:
    import vllm

    model = vllm_config.model_config
    return {
        "vllm": vllm.__version__,
        "model": model.model,
        "dtype": str(model.dtype),
        "layers": model.get_num_layers(vllm_config.parallel_config),
        "kv_heads": model.get_num_kv_heads(vllm_config.parallel_config),
        "head_size": model.get_head_size(),
        "block_size": vllm_config.cache_config.block_size,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }


class PdservePullConnector(KVConnectorBase_V1):
    """Pull-based P/D connector: prefill leases blocks, decode reads them over UCX."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _attach_logging()
        kv_config = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(kv_config.kv_connector_extra_config)
        engine_id = str(kv_config.engine_id)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(engine_id, self.config)
        else:
            self._worker = WorkerHalf(engine_id, self.config, _compat_facts(vllm_config),
                                      kv_cache_config.num_blocks)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.handshake is None:
            return None
        return PdserveHandshakeMetadata(self._worker.handshake.to_wire())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's lease messages and start its pulls before its forward: vLLM calls
        ``start_load_kv`` only after the forward unless a load is synchronous, and on CPU the
        forward is the whole step, so a lease granted there waited for the next prefill to
        finish (200-400 ms of handoff for a decode whose early release waits on the grant),
        and a pull started there began only after a forward it does not depend on."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdserveMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request pulls complete before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # pull-based: the prefill side never pushes

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.poll()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> TransferStats | None:
        half = self._worker if self._worker is not None else self._scheduler
        return half.take_stats() if half is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output.num_scheduled_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.on_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self,
                                    metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_handshake(dict(metadata))

    # ------------------------------------------------------------ metrics
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        return TransferStats(data=data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TransferPromMetrics:
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
