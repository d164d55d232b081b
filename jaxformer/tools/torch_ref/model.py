"""The jaxformer model written in PyTorch, for the benchmark (needs ``torch``).

Same math as jaxformer/model/, for every ModelConfig option that changes it: pre-LN or
post-LN blocks, layer norm or RMS norm (with or without a scale), gelu / gelu_tanh / relu /
tanh / silu / relu2, the plain or the gated feed-forward, learned, sinusoidal or rotary
positions, embed_scale, grouped-query attention, QK-norm, causal or not, with or without
biases, the head tied or not, dropout; linear layers ``x @ w + b``. (The attention
implementation, loss chunking and remat do not change the math; the compute dtype is
``torch.autocast``'s.) A field it does not know, at a value other than its default, is
refused with a ValueError naming it (``check_config``).

It is written the way a PyTorch user would (nanoGPT's model.py, Hugging Face's Llama for the
modern block): ``nn.Linear`` layers (weight stored transposed, (O, I)) with q|k|v as one
fused projection, ``nn.LayerNorm`` / ``nn.RMSNorm``, ``F.scaled_dot_product_attention``,
``F.cross_entropy``, the tied head sharing ``tok_embed.weight``; the layers are in
torch_ref_layers.py. AdamW with ``foreach=True`` (``fused=True`` on CUDA); bfloat16
``torch.autocast`` when the JAX side computes in bfloat16.

    model = TorchTransformer.from_jax(params, config, device)   # copies the weights
    loss = model.loss(inputs, targets)                           # torch tensors (B, T)
    grads = model.grads_as_jax()                                 # the params pytree layout, numpy
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxformer.model.config import ModelConfig
from jaxformer.tools.torch_ref.layers import ACTIVATIONS, Attention, FeedForward, norm, sinusoidal_positions

# The ModelConfig fields this model implements, with the values it knows (None: any value).
SUPPORTED = {
    "vocab_size": None, "d_model": None, "n_heads": None, "n_layers": None, "d_ff": None,
    "max_seq_len": None, "activation": tuple(ACTIVATIONS), "norm": ("pre", "post"),
    "positions": ("learned", "sinusoidal", "rope"), "embed_scale": None, "causal": None,
    "ln_eps": None, "tie_embeddings": None, "bias": None, "head_bias": None, "dropout": None,
    "norm_type": ("layer", "rms"), "norm_scale": None, "rope_theta": None,
    "mlp": ("plain", "gated"), "n_kv_heads": None, "qk_norm": None,
    # how JAX computes, not what: any value gives this model's math
    "attention_impl": None, "attention_block": None, "pallas_block_q": None, "pallas_block_k": None,
    "loss_chunk": None, "remat": None, "compute_dtype": None,
}


def check_config(config: ModelConfig) -> None:
    """Raise ValueError naming the first field of ``config`` this model does not implement:
    a value it does not know, or a field it does not know set to other than its default."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name not in SUPPORTED:
            if value != field.default:
                raise ValueError(f"the PyTorch model does not implement ModelConfig.{field.name} "
                                 f"(got {value!r}, only its default {field.default!r})")
        elif SUPPORTED[field.name] is not None and value not in SUPPORTED[field.name]:
            raise ValueError(f"the PyTorch model does not implement ModelConfig.{field.name} "
                             f"{value!r} (only {', '.join(map(repr, SUPPORTED[field.name]))})")


class Block(nn.Module):
    def __init__(self, config: ModelConfig, dtype):
        super().__init__()
        self.config = config
        self.ln1, self.ln2 = norm(config, config.d_model, dtype), norm(config, config.d_model, dtype)
        self.attn = Attention(config, dtype)
        self.ffn = FeedForward(config, dtype)

    def forward(self, x):
        if self.config.norm == "pre":
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class TorchTransformer(nn.Module):
    def __init__(self, config: ModelConfig, dtype=torch.float32):
        super().__init__()
        check_config(config)
        self.config = config
        D = config.d_model
        self.tok_embed = nn.Embedding(config.vocab_size, D, dtype=dtype)
        if config.positions == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(config.max_seq_len, D, dtype=dtype))
        elif config.positions == "sinusoidal":
            self.register_buffer("sin_table", sinusoidal_positions(config.max_seq_len, D, dtype))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, dtype) for _ in range(config.n_layers))
        if config.norm == "pre":
            self.ln_f = norm(config, D, dtype)
        self.head = nn.Linear(D, config.vocab_size, bias=config.head_bias, dtype=dtype)
        if config.tie_embeddings:  # one tensor, both roles (nanoGPT's weight tying)
            self.head.weight = self.tok_embed.weight

    def forward(self, inputs):  # inputs int64 (B, T) -> logits (B, T, V)
        T = inputs.shape[1]
        x = self.tok_embed(inputs)
        if self.config.embed_scale:
            x = x * math.sqrt(self.config.d_model)
        if self.config.positions == "learned":
            x = x + self.pos_embed[:T]
        elif self.config.positions == "sinusoidal":
            x = x + self.sin_table[:T]
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if self.config.norm == "pre":
            x = self.ln_f(x)
        return self.head(x)

    def loss(self, inputs, targets):
        logits = self.forward(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # ------------------------------------------------------------------
    # the params pytree of DESIGN.md <-> this module's tensors

    def _pairs(self):
        """(path in the params pytree, parameter, rows, transpose?) for every leaf: the
        leaf is ``parameter[rows]`` (rows None: all of it), transposed for a weight matrix;
        block leaves carry the layer index last in the path. A norm without params is its
        node's path with parameter None (the empty dict of the pytree)."""
        c = self.config
        D, F_, Dkv = c.d_model, c.d_ff, c.kv_heads * c.d_head

        def norm_leaves(path, m, *layer):  # LayerNorm: scale, bias?; RMSNorm: scale? (None: no scale)
            found = (("scale", m.weight), ("bias", getattr(m, "bias", None)))
            leaves = [(path + (leaf,) + layer, t, None, False) for leaf, t in found if t is not None]
            return leaves or [(path, None, None, False)]  # no params: the empty node {}

        def linear_leaves(group, names, m, widths, l):  # one nn.Linear holding leaves side by side
            out, start = [], 0
            for (w, b), width in zip(names, widths):
                rows = slice(start, start + width)
                out.append((("blocks", group, w, l), m.weight, rows, True))
                if m.bias is not None:
                    out.append((("blocks", group, b, l), m.bias, rows, False))
                start += width
            return out

        out = [(("tok_embed",), self.tok_embed.weight, None, False)]
        if c.positions == "learned":
            out.append((("pos_embed",), self.pos_embed, None, False))
        for l, b in enumerate(self.blocks):
            out += norm_leaves(("blocks", "ln1"), b.ln1, l) + norm_leaves(("blocks", "ln2"), b.ln2, l)
            qkv = (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
            out += linear_leaves("attn", qkv, b.attn.qkv, (D, Dkv, Dkv), l)
            out += linear_leaves("attn", (("wo", "bo"),), b.attn.o, (D,), l)
            if c.qk_norm:
                out += (norm_leaves(("blocks", "attn", "q_norm"), b.attn.q_norm, l)
                        + norm_leaves(("blocks", "attn", "k_norm"), b.attn.k_norm, l))
            if c.mlp == "gated":
                gate_up = (("w_gate", "b_gate"), ("w_up", "b_up"))
                out += linear_leaves("ffn", gate_up, b.ffn.gate_up, (F_, F_), l)
                out += linear_leaves("ffn", (("w_down", "b_down"),), b.ffn.w_down, (D,), l)
            else:
                out += linear_leaves("ffn", (("w_in", "b_in"),), b.ffn.w_in, (F_,), l)
                out += linear_leaves("ffn", (("w_out", "b_out"),), b.ffn.w_out, (D,), l)
        if c.norm == "pre":
            out += norm_leaves(("ln_f",), self.ln_f)
        if not c.tie_embeddings:  # tied: head.weight is tok_embed.weight, one leaf
            out.append((("head", "w"), self.head.weight, None, True))
        if c.head_bias:
            out.append((("head", "b"), self.head.bias, None, False))
        return out

    @classmethod
    def from_jax(cls, params, config: ModelConfig, device=None) -> TorchTransformer:
        """A model on ``device`` (default CPU) holding a copy of the jaxformer ``params``
        (their dtype kept)."""
        dtype = {np.dtype("float32"): torch.float32, np.dtype("float64"): torch.float64}[
            np.asarray(params["tok_embed"]).dtype]
        model = cls(config, dtype)
        with torch.no_grad():
            for path, tensor, rows, transpose in model._pairs():
                if tensor is None:
                    continue
                value = np.asarray(_get(params, path))
                target = tensor if rows is None else tensor[rows]  # a view: the copy lands in tensor
                target.copy_(torch.from_numpy(np.array(value.T if transpose else value)))
        return model.to(device) if device is not None else model

    def grads_as_jax(self) -> dict:
        """The ``.grad`` of every parameter, as numpy arrays in the params pytree layout."""
        tree: dict = {}
        for path, tensor, rows, transpose in self._pairs():
            if tensor is None:
                _set(tree, path, None)
                continue
            g = tensor.grad.detach().cpu().numpy()
            g = g if rows is None else g[rows]
            _set(tree, path, g.T if transpose else g)
        return _stack_layers(tree)


def _is_block(path) -> bool:
    """Whether ``path`` names a block leaf (its last entry the layer index)."""
    return path[0] == "blocks" and isinstance(path[-1], int)


def _get(params, path):
    node = params
    for key in path[:-1] if _is_block(path) else path:
        node = node[key]
    return np.asarray(node)[path[-1]] if _is_block(path) else node


def _set(tree, path, value):
    """Put ``value`` at ``path`` of ``tree`` (a block leaf under its layer index); value
    None: an empty node (a norm without params)."""
    *parents, last = path
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.setdefault(last, {})
    else:
        node[last] = value


def _stack_layers(node):
    """{layer index: array} -> the arrays stacked along a leading layer axis, everywhere in ``node``."""
    if not isinstance(node, dict) or not node:
        return node
    if all(isinstance(k, int) for k in node):
        return np.stack([node[l] for l in sorted(node)])
    return {k: _stack_layers(v) for k, v in node.items()}


def to_torch_batch(batch, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) int64 tensors on ``device`` (default CPU) from a jaxformer batch dict."""
    return tuple(torch.from_numpy(np.asarray(batch[k]).astype(np.int64)).to(device or "cpu")
                 for k in ("inputs", "targets"))


def adamw(model: nn.Module, lr: float, weight_decay: float, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8):
    """torch.optim.AdamW with jaxformer.optim's settings: decoupled weight decay on the
    weight matrices and embeddings only (optim.decay_mask), not on biases or norms; the
    fused CUDA kernel when the model is on a GPU, else the multi-tensor (foreach) one."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    cuda = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps,
                             **({"fused": True} if cuda else {"foreach": True}))


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device_type: str, compute_dtype: str | None):
    """The context a step runs in: ``torch.autocast`` to bfloat16 / float16 when the JAX
    side computes in it (matmuls in the low dtype; layer norm, softmax and cross entropy
    in float32, as jaxformer's precision policy), else no change."""
    if compute_dtype in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[compute_dtype])
    return contextlib.nullcontext()

