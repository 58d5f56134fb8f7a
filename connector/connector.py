"""The KVConnectorBase_V1 facade that vLLM loads; it only delegates by role.

Load it with::

    --kv-transfer-config '{"kv_connector": "P2pMooncakeConnector",
                           "kv_connector_module_path": "connector.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {"protocol": "tcp", ...}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.groups import group_specs
from connector.log import get_logger
from connector.scheduler import P2pMetadata, P2pScheduler
from connector.settings import ConnectorSettings
from connector.stats import P2pConnectorStats, P2pPromMetrics
from connector.wire import PROTOCOL_VERSION, Compat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from connector.worker import P2pWorker

logger = get_logger(__name__)


class P2pMooncakeConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None and ktc.engine_id is not None
        if kv_cache_config is None:
            raise ValueError("P2pMooncakeConnector needs vLLM's kv_cache_config")
        settings = ConnectorSettings.load(ktc.kv_connector_extra_config)
        groups = group_specs(kv_cache_config)
        par = vllm_config.parallel_config
        # Each DP engine gets its own range of side-channel ports, one per TP rank.
        base_port = settings.engine_base_port(par.data_parallel_rank, par.tensor_parallel_size)
        self._scheduler: P2pScheduler | None = None
        self._worker: P2pWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = P2pScheduler(
                engine_id=ktc.engine_id,
                host=settings.advertised_host(),
                side_channel_port=base_port,
                can_produce=ktc.is_kv_producer,
                can_consume=ktc.is_kv_consumer,
                groups=groups,
                transfer_group_ids=kv_cache_config.transfer_group_ids,
                idle_wait_s=settings.idle_wait_ms / 1000.0,
                tp_size=par.tensor_parallel_size,
            )
            self._bad_params_reported = 0
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from connector.worker import P2pWorker

            tp_rank = get_tensor_model_parallel_rank()
            self._worker = P2pWorker(
                settings,
                engine_id=ktc.engine_id,
                num_blocks=kv_cache_config.num_blocks,
                tp_rank=tp_rank,
                side_channel_port=base_port + tp_rank,
                can_produce=ktc.is_kv_producer,
                can_consume=ktc.is_kv_consumer,
                groups=groups,
                compat=compat_of(vllm_config, settings),
                tp_size=par.tensor_parallel_size,
            )

    # --- worker side -----------------------------------------------------------------------

    def _w(self) -> P2pWorker:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pMetadata)
        self._w().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._w().get_transfer_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._w().get_transfer_results()
        return sending or None, recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks the scheduler-side connector too: it reports malformed params.
        if self._worker is None:
            bad = self._s().num_bad_params - self._bad_params_reported
            if bad <= 0:
                return None
            self._bad_params_reported += bad
            return P2pConnectorStats(data={"bad_params": [1] * bad})
        data = self._worker.take_stats()
        return P2pConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return P2pConnectorStats(data=data) if data is not None else P2pConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return P2pPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side --------------------------------------------------------------------

    def _s(self) -> P2pScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A transfer restores every transfer group, not only the prefix-cacheable ones.
        return self._kv_cache_config.transfer_group_ids

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)


def compat_of(vllm_config: VllmConfig, settings: ConnectorSettings) -> Compat:
    """This instance's compatibility fingerprint, checked by the prefiller on every pull."""
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    served = model.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return Compat(
        protocol=PROTOCOL_VERSION,
        model=settings.model_id or str(served or model.model),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        num_layers=model.get_num_layers(par),
        # MLA's latent KV is one "head" that every rank holds whole (connector.tp).
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
    )
