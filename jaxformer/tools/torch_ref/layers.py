"""The layers of the PyTorch model (torch_ref.py), one nn.Module per kind (needs ``torch``).

Each is the PyTorch twin of a jaxformer/model/ layer, written as a PyTorch user would:

    norm(config, width)   nn.LayerNorm (bias per config.bias) or nn.RMSNorm (scale per norm_scale)
    Rotary                cos / sin tables as buffers; Hugging Face's rotate-half layout (rotary.py)
    Attention             q|k|v as one nn.Linear of width (H + 2 Hkv) Dh, QK-norm, rotary
                          positions, F.scaled_dot_product_attention (enable_gqa for Hkv < H)
    FeedForward           act(x w_in) w_out, or gated: gate|up as one nn.Linear of width 2F,
                          (act(gate) * up) w_down (SwiGLU with silu)

Shapes: B batch, T positions, D width, H query heads, Hkv key/value heads, Dh = D / H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxformer.model.config import ModelConfig

ACTIVATIONS = {
    "gelu": lambda h: F.gelu(h, approximate="none"),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": torch.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
    "relu2": lambda h: torch.relu(h).square(),
}


def sinusoidal_positions(T: int, D: int, dtype) -> torch.Tensor:
    """(T, D): sin(t / 10000^(2i/D)) at feature 2i, cos at 2i+1 (embedding.sinusoidal_positions)."""
    t = torch.arange(T, dtype=torch.float64)[:, None]
    i = torch.arange(0, D, 2, dtype=torch.float64)[None, :]
    angle = t / (10000.0 ** (i / D))  # (T, ceil(D/2))
    table = torch.zeros(T, D, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : D // 2])
    return table.to(dtype)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """t in float32 or wider: the norms' statistics under bfloat16 autocast (precision.upcast)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def norm(config: ModelConfig, width: int, dtype) -> nn.Module:
    """The residual stream's norm over ``width`` features: nn.RMSNorm with norm_type "rms"
    (a learnable scale unless norm_scale is False), else nn.LayerNorm (no bias with bias False)."""
    if config.norm_type == "rms":
        return nn.RMSNorm(width, eps=config.ln_eps, elementwise_affine=config.norm_scale, dtype=dtype)
    return nn.LayerNorm(width, eps=config.ln_eps, bias=config.bias, dtype=dtype)


class Rotary(nn.Module):
    """Rotary positions: y = x * cos + rotate_half(x) * sin, the pair (i, i + Dh/2) turned by
    t * theta^(-2i/Dh) at position t. The tables are buffers (max_seq_len, Dh), built in float64."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, dtype):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (Dh/2,)
        angle = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (S, Dh/2)
        angle = torch.cat([angle, angle], dim=-1)  # (S, Dh): each angle twice, [a, a]
        self.register_buffer("cos", angle.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angle.sin().to(dtype), persistent=False)

    @staticmethod
    def rotate_half(x):  # (..., Dh) -> [-x2, x1]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def forward(self, x):  # x (B, H, T, Dh)
        T = x.shape[-2]
        return x * self.cos[:T] + self.rotate_half(x) * self.sin[:T]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype):
        super().__init__()
        D, H, Hkv, Dh = config.d_model, config.n_heads, config.kv_heads, config.d_head
        self.config, self.H, self.Hkv, self.Dh = config, H, Hkv, Dh
        kw = {"dtype": dtype, "bias": config.bias}
        self.qkv = nn.Linear(D, (H + 2 * Hkv) * Dh, **kw)  # q | k | v in one product (nanoGPT's c_attn)
        self.o = nn.Linear(D, D, **kw)
        if config.qk_norm:  # an RMS norm over each head's Dh features, own scales for q and k
            self.q_norm = nn.RMSNorm(Dh, eps=config.ln_eps, elementwise_affine=config.norm_scale, dtype=dtype)
            self.k_norm = nn.RMSNorm(Dh, eps=config.ln_eps, elementwise_affine=config.norm_scale, dtype=dtype)
        if config.positions == "rope":
            self.rotary = Rotary(Dh, config.max_seq_len, config.rope_theta, dtype)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):  # x (B, T, D) -> (B, T, D)
        B, T, D = x.shape
        H, Hkv, Dh = self.H, self.Hkv, self.Dh
        q, k, v = self.qkv(x).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=2)
        q = q.view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, Hkv, Dh).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = v.view(B, T, Hkv, Dh).transpose(1, 2)  # (B, Hkv, T, Dh)
        if self.config.qk_norm:  # q, k are bfloat16 under autocast: normalized in float32
            q, k = self.q_norm(upcast(q)), self.k_norm(upcast(k))
        if self.config.positions == "rope":
            q, k = self.rotary(q), self.rotary(k)
        att = F.scaled_dot_product_attention(  # query head h reads key/value head h // (H / Hkv)
            q, k, v, is_causal=self.config.causal, enable_gqa=Hkv != H,
            dropout_p=self.config.dropout if self.training else 0.0)  # (B, H, T, Dh)
        return self.drop(self.o(att.transpose(1, 2).reshape(B, T, D)))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, dtype):
        super().__init__()
        D, F_ = config.d_model, config.d_ff
        kw = {"dtype": dtype, "bias": config.bias}
        self.act = ACTIVATIONS[config.activation]
        self.gated = config.mlp == "gated"
        if self.gated:
            self.gate_up = nn.Linear(D, 2 * F_, **kw)  # gate | up in one product
            self.w_down = nn.Linear(F_, D, **kw)
        else:
            self.w_in, self.w_out = nn.Linear(D, F_, **kw), nn.Linear(F_, D, **kw)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):  # x (B, T, D) -> (B, T, D)
        if self.gated:
            gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, F) each
            return self.drop(self.w_down(self.act(gate) * up))
        return self.drop(self.w_out(self.act(self.w_in(x))))
