"""Random-weight Llama checkpoints for running a real vLLM engine without a download.

vLLM loads a model from a directory in Hugging Face format; no model can be fetched here,
so tests, the TTFT benchmark and the example build one with ``transformers``
(``LlamaForCausalLM`` with random weights, ``save_pretrained``) and start
``LLM(model=dir, skip_tokenizer_init=True, ...)`` with token-id prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LlamaGeometry:
    """Shape of a random-weight Llama.

    Attributes:
        vocab: vocabulary size.
        hidden: hidden width.
        layers: decoder layers.
        heads: attention heads.
        kv_heads: KV heads (grouped-query attention when below ``heads``).
        intermediate: MLP width.
        max_positions: longest sequence in tokens.
    """

    vocab: int = 1024
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    max_positions: int = 2048

    @property
    def head_size(self) -> int:
        """Width of one head (``hidden // heads``)."""
        return self.hidden // self.heads

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """KV-cache bytes of one token: ``2 (K, V) × layers × kv_heads × head_size × itemsize``."""
        return 2 * self.layers * self.kv_heads * self.head_size * itemsize

    def matmul_params(self) -> int:
        """Weights a token goes through in a forward pass (embedding lookup excluded):
        per layer Q and O (``hidden × heads × head_size`` each), K and V (``hidden ×
        kv_heads × head_size`` each), the gated MLP (``3 × hidden × intermediate``); then
        the LM head (``hidden × vocab``)."""
        attn = 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads * self.head_size
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.hidden * self.vocab

    def flops_per_token(self, context: int = 0) -> int:
        """Forward-pass FLOPs of one prompt token: ``2 × matmul_params()`` (one multiply and
        one add per weight) plus attention over ``context`` earlier tokens, ``4 × layers ×
        heads × head_size × context`` (Q·Kᵀ and the weighted sum of V).  The usual
        ``2 N + 2 n_layer n_ctx d_attn`` estimate (Kaplan et al. 2020, "Scaling laws for
        neural language models", table 1) with causal prefill's average context."""
        return 2 * self.matmul_params() + 4 * self.layers * self.heads * self.head_size * context


def build_llama(directory: str | Path, geometry: LlamaGeometry = LlamaGeometry(), seed: int = 0) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` (float32) to ``directory`` and return it.

    The weights are drawn from torch's generator seeded with ``seed``, so the same
    arguments give the same model.  A directory that already holds ``config.json`` is
    reused as it is.

    Raises:
        ImportError: ``transformers`` is not installed (it comes with the ``[vllm]`` extra).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=geometry.vocab,
        hidden_size=geometry.hidden,
        intermediate_size=geometry.intermediate,
        num_hidden_layers=geometry.layers,
        num_attention_heads=geometry.heads,
        num_key_value_heads=geometry.kv_heads,
        max_position_embeddings=geometry.max_positions,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    return out
