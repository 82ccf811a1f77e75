"""A tiny decoder-only transformer in plain torch with attention over a paged KV cache.

The model exists to prove that KV moved through the runtime (offloaded, stored, onboarded,
read from another worker) gives the same logits as KV computed from scratch.  It has
random weights, learned absolute positions, pre-norm blocks with multi-head attention and
an MLP, in float32.

Paged KV: one block holds ``[num_layers, 2, page_size, num_heads * head_dim]`` (K at
outer index 0, V at 1), exactly a runtime block view with ``outer_dim=2`` and
``inner_dim = num_heads * head_dim``.  :meth:`TinyTransformer.forward_paged` computes
positions ``[start, T)`` given the K/V of positions ``[0, start)`` read from block views,
and writes the K/V of every full block it completes into the views it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..block import ImmutableBlock


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Shape of the tiny model.

    Attributes:
        vocab: vocabulary size (token ids in ``[0, vocab)``).
        num_layers: transformer blocks.
        num_heads: attention heads (every head has its own K/V).
        head_dim: per-head width.
        max_positions: longest sequence.
        page_size: tokens per KV block.
    """

    vocab: int = 61
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 8
    max_positions: int = 256
    page_size: int = 4

    @property
    def d_model(self) -> int:
        """Hidden width (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one KV block: ``(num_layers, 2, page_size, d_model)``."""
        return (self.num_layers, 2, self.page_size, self.d_model)


class _Layer(nn.Module):
    def __init__(self, d: int, gen: torch.Generator) -> None:
        super().__init__()

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(shape[0]))

        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = w(d, d), w(d, d), w(d, d), w(d, d)
        self.w1, self.w2 = w(d, 2 * d), w(2 * d, d)


class TinyTransformer(nn.Module):
    """Random-weight decoder (see module doc); deterministic for a given ``seed``.

    Args:
        config: model shape.
        seed: weight seed.
    """

    def __init__(self, config: TinyConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(seed)
        d = config.d_model
        self.embed = nn.Parameter(torch.randn(config.vocab, d, generator=gen))
        self.pos = nn.Parameter(torch.randn(config.max_positions, d, generator=gen) * 0.5)
        self.layers = nn.ModuleList(_Layer(d, gen) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Parameter(torch.randn(d, config.vocab, generator=gen) / math.sqrt(d))
        self.requires_grad_(False)

    # ------------------------------------------------------------------ reference path

    @torch.no_grad()
    def forward_full(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of every position, computed from scratch (no cache)."""
        return self._run(torch.as_tensor(tokens, dtype=torch.long), 0, [], {})

    # ------------------------------------------------------------------ paged path

    @torch.no_grad()
    def forward_paged(
        self,
        tokens: Sequence[int] | torch.Tensor,
        start: int,
        past: Sequence[torch.Tensor],
        out_blocks: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[T - start, vocab]`` of positions ``[start, T)``.

        Args:
            tokens: all ``T`` token ids of the sequence.
            start: first position to compute; a multiple of ``page_size``.
            past: ``start // page_size`` block views holding the K/V of positions
                ``[0, start)`` (each ``[num_layers, 2, page_size, d_model]``).
            out_blocks: block index → view to receive the K/V of that block, for blocks
                fully inside ``[start, T)``; other completed blocks are not written.

        Raises:
            ValueError: ``start`` not block-aligned or ``past`` of the wrong length.
        """
        page = self.config.page_size
        if start % page or len(past) != start // page:
            raise ValueError(f"start={start} needs {start // page} aligned past blocks, got {len(past)}")
        return self._run(torch.as_tensor(tokens, dtype=torch.long), start, past, dict(out_blocks or {}))

    def _run(
        self, tokens: torch.Tensor, start: int, past: Sequence[torch.Tensor], out: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        c = self.config
        total = tokens.numel()
        if total > c.max_positions:
            raise ValueError(f"{total} tokens exceed max_positions={c.max_positions}")
        new = total - start
        x = self.embed[tokens[start:]] + self.pos[start:total]
        h, hd, page = c.num_heads, c.head_dim, c.page_size
        # causal mask of new queries (absolute positions start..total-1) over keys 0..total-1
        q_pos = torch.arange(start, total).unsqueeze(1)
        k_pos = torch.arange(total).unsqueeze(0)
        mask = k_pos > q_pos
        for li, layer in enumerate(self.layers):
            a = layer.ln1(x)
            q = (a @ layer.wq).view(new, h, hd).transpose(0, 1)
            k_new = a @ layer.wk
            v_new = a @ layer.wv
            if past:
                k_past = torch.cat([b[li, 0].to(k_new.device) for b in past], dim=0).to(k_new.dtype)
                v_past = torch.cat([b[li, 1].to(v_new.device) for b in past], dim=0).to(v_new.dtype)
                k_all = torch.cat([k_past, k_new], dim=0)
                v_all = torch.cat([v_past, v_new], dim=0)
            else:
                k_all, v_all = k_new, v_new
            for b, view in out.items():
                lo, hi = b * page - start, (b + 1) * page - start
                if lo < 0 or hi > new:
                    raise ValueError(f"block {b} is not fully inside positions [{start}, {total})")
                view[li, 0].copy_(k_new[lo:hi])
                view[li, 1].copy_(v_new[lo:hi])
            k = k_all.view(total, h, hd).transpose(0, 1)
            v = v_all.view(total, h, hd).transpose(0, 1)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            scores = scores.masked_fill(mask, float("-inf"))
            att = torch.softmax(scores, dim=-1) @ v  # [h, new, hd]
            x = x + att.transpose(0, 1).reshape(new, h * hd) @ layer.wo
            x = x + torch.relu(layer.ln2(x) @ layer.w1) @ layer.w2
        return self.ln_f(x) @ self.head

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate_paged(self, tokens: Sequence[int], blocks: Sequence[torch.Tensor], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy generation after a prompt whose full blocks' K/V are in ``blocks``.

        The partial tail and the generated tokens are recomputed each step (only full
        blocks are ever cached).

        Returns:
            (generated token ids, logits ``[steps, vocab]`` that chose them).
        """
        seq = list(tokens)
        start = len(blocks) * self.config.page_size
        out: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(steps):
            logits = self.forward_paged(seq, start, blocks)[-1]
            nxt = int(torch.argmax(logits))
            rows.append(logits)
            out.append(nxt)
            seq.append(nxt)
        return out, torch.stack(rows)

    @torch.no_grad()
    def generate_full(self, tokens: Sequence[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy generation from scratch (reference for :meth:`generate_paged`)."""
        seq = list(tokens)
        out: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(steps):
            logits = self.forward_full(seq)[-1]
            nxt = int(torch.argmax(logits))
            rows.append(logits)
            out.append(nxt)
            seq.append(nxt)
        return out, torch.stack(rows)


BlockLookup = Callable[[int], ImmutableBlock | None]


def paged_kv_fill(
    model: TinyTransformer, tokens: Sequence[int], hashes: Sequence[int], lookup: BlockLookup
) -> Callable[[int, torch.Tensor], None]:
    """A ``kv_fill`` for :meth:`BlockManager.serve` that runs the model block by block.

    Block ``i`` is computed with ``forward_paged(tokens[:(i+1)·page], i·page, past)`` where
    ``past`` holds blocks ``0..i-1``: blocks filled earlier by this ``kv_fill`` are taken
    from their views, the others (reused or onboarded by ``serve``) through ``lookup``
    (e.g. ``manager.g1.get``), so the computed KV really depends on the reused KV.

    Raises:
        KeyError: a previous block is neither computed here nor found by ``lookup``.
    """
    page = model.config.page_size
    index = {h: i for i, h in enumerate(hashes)}
    filled: dict[int, torch.Tensor] = {}

    def fill(sequence_hash: int, view: torch.Tensor) -> None:
        i = index[sequence_hash]
        past: list[torch.Tensor] = []
        held: list[ImmutableBlock] = []
        try:
            for j in range(i):
                if j in filled:
                    past.append(filled[j])
                    continue
                handle = lookup(hashes[j])
                if handle is None:
                    raise KeyError(f"block {j} ({hashes[j]:#x}) is neither computed nor resident")
                held.append(handle)
                past.append(handle.view())
            model.forward_paged(list(tokens[: (i + 1) * page]), i * page, past, {i: view})
        finally:
            for handle in held:
                handle.release()
        filled[i] = view

    return fill
