"""A small decoder-only MoE transformer that computes exactly what llama.cpp computes for the GGUF
architectures `olmoe` and `qwen3moe` (torch is imported here; this module is training-only).

Per layer (pre-norm, RMSNorm everywhere, no biases):
    h = x + Wo · attn(rope(qnorm(Wq·n(x))), rope(knorm(Wk·n(x))), Wv·n(x))
    y = h + Σ_{e ∈ topk} w_e · Wd_e( silu(Wg_e·n(h)) * Wu_e·n(h) )
  * olmoe:    q/k RMSNorm over the whole projection (size n_embd, before splitting heads);
              gate weights w = softmax(router logits) at the top-k, NOT renormalised.
  * qwen3moe: q/k RMSNorm per head (size head_dim); w renormalised to sum to 1 over the top-k.
  * RoPE is the NEOX variant for both archs in llama.cpp: dimension i pairs with i + head_dim/2.
Logits = output · RMSNorm(x_L); the output matrix is tied to the token embedding in training and written
twice in GGUF (olmoe requires an `output` tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# One MoE layer's routing of a batch: router logits, chosen experts, load-balancing and z losses, counts
LayerStats = dict[str, torch.Tensor]


@dataclass
class MoEConfig:
    arch: str = "olmoe"  # "olmoe" | "qwen3moe"
    vocab_size: int = 4096
    n_layer: int = 6
    n_embd: int = 128
    n_head: int = 4
    head_dim: int = 32
    n_expert: int = 64
    k: int = 8  # experts used per token
    expert_ff: int = 128
    ctx: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def norm_topk(self) -> bool:
        return self.arch == "qwen3moe"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: MoEConfig, T: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float32, device=device) * 2.0 / cfg.head_dim)
    ang = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv[None, :]  # [T, half]
    return ang.cos(), ang.sin()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; rotates (x[i], x[i + D/2]) by angle pos * base^(-2i/D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.n_head * cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, inner, bias=False)
        self.wk = nn.Linear(cfg.n_embd, inner, bias=False)
        self.wv = nn.Linear(cfg.n_embd, inner, bias=False)
        self.wo = nn.Linear(inner, cfg.n_embd, bias=False)
        qk_dim = inner if cfg.arch == "olmoe" else cfg.head_dim
        self.q_norm = RMSNorm(qk_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(qk_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.cfg.n_head, self.cfg.head_dim
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.cfg.arch == "olmoe":  # norm over the full projection, then split heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        if self.cfg.arch != "olmoe":  # per-head norm
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(B, T, H * D))
        return out


class MoE(nn.Module):
    """Token-choice top-k MoE, no capacity limit. The (token, expert) slots are sorted by expert so each
    expert runs three dense matmuls on exactly its own tokens (no dense compute of all experts)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, d, f = cfg.n_expert, cfg.n_embd, cfg.expert_ff
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, f, d) * 0.02)  # [E, out, in] = GGUF ffn_gate_exps
        self.w_up = nn.Parameter(torch.randn(E, f, d) * 0.02)
        self.w_down = nn.Parameter(torch.randn(E, d, f) * 0.02)

    def forward(
        self, x: torch.Tensor, k: int | None = None, force_topi: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, LayerStats]:
        """x: [N, d]. Returns (y, stats) with stats = dict(logits, topi, aux, z)."""
        cfg = self.cfg
        k = k or cfg.k
        N, d = x.shape
        E = cfg.n_expert
        logits = self.router(x)  # [N, E]
        probs = logits.float().softmax(-1)
        if force_topi is None:
            topw, topi = probs.topk(k, dim=-1)  # [N, k]
        else:
            topi = force_topi
            topw = probs.gather(-1, topi)
        if cfg.norm_topk:
            topw = topw / topw.sum(-1, keepdim=True).clamp_min(6.103515625e-5)

        flat_e = topi.reshape(-1)  # [N*k] slot -> expert
        order = flat_e.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(flat_e, minlength=E)
        tok = order // k  # token of each grouped slot
        xs = x[tok]
        outs = []
        for e, seg in enumerate(torch.split(xs, counts.tolist())):
            if seg.shape[0]:
                h = F.silu(seg @ self.w_gate[e].t()) * (seg @ self.w_up[e].t())
                outs.append(h @ self.w_down[e].t())
        out = torch.cat(outs)  # [N*k, d], grouped order
        contrib = out * topw.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, tok, contrib)

        # Switch/OLMoE load-balancing loss: E * Σ_e (share of routed slots to e) * (mean router prob of e)
        frac = counts.float() / (N * k)
        aux = E * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits.float(), -1).pow(2).mean()  # router z-loss (keeps logits small)
        return y, {"logits": logits, "topi": topi, "aux": aux, "z": z, "counts": counts}


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k: int | None = None,
        force_topi: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LayerStats]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        B, T, d = x.shape
        y, st = self.moe(self.ffn_norm(x).reshape(B * T, d), k=k, force_topi=force_topi)
        return x + y.view(B, T, d), st


class MoELM(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]  # as Blocks: a ModuleList yields them as Modules
        self.blocks = nn.ModuleList(blocks)
        self.out_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.apply(self._init)
        for b in blocks:  # scale residual-branch outputs down with depth (GPT-2 style)
            nn.init.normal_(b.attn.wo.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(b.moe.w_down, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, k: int | None = None, force_topi: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[LayerStats]]:
        """idx: [B, T] -> logits [B, T, V], per-layer stats. force_topi: per-layer list of [B*T, k] ids."""
        T = idx.shape[1]
        cos, sin = rope_tables(self.cfg, T, idx.device)
        x = self.embed(idx)
        stats: list[LayerStats] = []
        for i, b in enumerate(self.blocks):
            x, st = b(x, cos, sin, k=k, force_topi=None if force_topi is None else force_topi[i])
            stats.append(st)
        logits = F.linear(self.out_norm(x), self.embed.weight)
        return logits, stats

    def n_params(self) -> tuple[int, int]:
        """Parameters in all, and those one token uses (its k experts of each layer, not the rest)."""
        total = sum(p.numel() for p in self.parameters())
        c = self.cfg
        inactive = c.n_layer * (c.n_expert - c.k) * 3 * c.n_embd * c.expert_ff
        return total, total - inactive
