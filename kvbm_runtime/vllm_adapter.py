"""Thin adapter from vLLM's ``KVConnectorBase_V1`` to :mod:`kvbm_runtime.connector`.

Importing this module needs vLLM; without it the import raises :class:`ImportError` with
instructions (the rest of ``kvbm_runtime`` never imports vLLM).  Use it with::

    --kv-transfer-config '{"kv_connector": "KvbmVllmConnector",
                           "kv_connector_module_path": "kvbm_runtime.vllm_adapter",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"events_url": "zmq://...",
                                                         "g2_blocks": 4096}}'

The adapter only translates vLLM's objects (``Request``, ``KVCacheBlocks``,
``SchedulerOutput``, the per-layer ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` caches of the flash-attention backend) into the connector's dataclasses.
It was written against the vLLM 0.10/0.11 connector interface; vLLM does not install on
this CPU-only machine, so only the import guard is tested here.
"""

from __future__ import annotations

from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no branch - depends on the environment
    raise ImportError(
        "kvbm_runtime.vllm_adapter needs vLLM (a CUDA build: `pip install vllm`); the engine-neutral "
        "connector is kvbm_runtime.connector.KvbmConnector and works without it"
    ) from exc

import torch

from event_plane import make_publisher

from .config import RuntimeConfig
from .connector import (
    ConnectorRequest,
    KvbmConnectorScheduler,
    KvbmConnectorWorker,
    KvConnectorMetadata,
    ScheduledRequest,
    SchedulerOutput,
)
from .manager import BlockManager


class KvbmVllmMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """vLLM metadata wrapper around :class:`KvConnectorMetadata`."""

    def __init__(self, inner: KvConnectorMetadata) -> None:
        self.inner = inner


def _request(req: Any) -> ConnectorRequest:
    return ConnectorRequest(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(getattr(req, "output_token_ids", []) or []),
    )


def _first_group(block_ids: Any) -> list[int]:
    """vLLM gives block ids per KV-cache group (a tuple of lists); one group is supported."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids)


def runtime_config_from_vllm(vllm_config: Any) -> RuntimeConfig:
    """Runtime configuration matching vLLM's model and cache geometry (one KV-cache group).

    ``kv_connector_extra_config`` entries override RuntimeConfig fields (e.g. ``g2_blocks``).
    """
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    extra.pop("events_url", None)
    fields: dict[str, Any] = {
        "model_name": mc.model,
        "num_layers": mc.get_num_layers(pc),
        "outer_dim": 2,
        "page_size": cc.block_size,
        "inner_dim": mc.get_num_kv_heads(pc) * mc.get_head_size(),
        "kv_dtype": dtype,
        "g1_blocks": max(1, int(cc.num_gpu_blocks or 1)),
        "tp_rank": getattr(pc, "rank", 0) % max(1, pc.tensor_parallel_size),
        "tp_size": pc.tensor_parallel_size,
    }
    fields.update(extra)
    return RuntimeConfig(**fields)


class KvbmVllmConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM connector backed by a :class:`BlockManager` (G2 host pool + storage)."""

    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, role, *args, **kwargs)
        cfg = runtime_config_from_vllm(vllm_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        publisher = make_publisher(str(extra.get("events_url", "null://")), f"vllm-{cfg.tp_rank}")
        self._manager = BlockManager(cfg, publisher)
        self._scheduler = KvbmConnectorScheduler(self._manager) if role == KVConnectorRole.SCHEDULER else None
        self._worker = KvbmConnectorWorker(self._manager) if role == KVConnectorRole.WORKER else None
        self._blocks: dict[str, list[int]] = {}
        self._requests: dict[str, ConnectorRequest] = {}

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(_request(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        ids = _first_group(blocks.get_block_ids())
        self._scheduler.update_state_after_alloc(_request(request), ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmVllmMetadata:
        assert self._scheduler is not None
        out = SchedulerOutput()
        n_sched: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = ConnectorRequest(new.req_id, list(new.prompt_token_ids))
            self._requests[new.req_id] = req
            self._blocks[new.req_id] = _first_group(new.block_ids)
            out.scheduled.append(ScheduledRequest(req, self._blocks[new.req_id], new.num_computed_tokens, n_sched[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(getattr(cached, "req_ids", [])):
            req = self._requests.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                self._blocks[rid].extend(_first_group(new_ids))
            new_tokens = getattr(cached, "new_token_ids", None)
            if new_tokens:
                req.output_token_ids.extend(new_tokens[i])
            out.scheduled.append(ScheduledRequest(req, self._blocks[rid], cached.num_computed_tokens[i], n_sched[rid]))
        return KvbmVllmMetadata(self._scheduler.build_connector_meta(out))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._blocks.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        return self._scheduler.request_finished(_request(request), block_ids)

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        views: dict[str, torch.Tensor] = {}
        for name, t in kv_caches.items():
            # flash-attention layout [2, num_blocks, block_size, heads, head] → [num_blocks, 2, block_size, inner]
            views[name] = t.transpose(0, 1).flatten(3) if t.dim() == 5 else t
        self._worker.register_kv_caches(views)

    def bind_connector_metadata(self, connector_metadata: KvbmVllmMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        self._worker.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        # vLLM hands the raw [2, num_blocks, ...] tensor: compare storage, not the view
        self._worker._saved_layers.add(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()
