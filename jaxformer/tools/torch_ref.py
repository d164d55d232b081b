"""The jaxformer model written in PyTorch, for the benchmark (needs ``torch``).

Same math as jaxformer/model/: pre-LN or post-LN blocks, gelu / gelu_tanh /
relu / tanh, learned or sinusoidal positions, causal or not, linear layers
``x @ w + b``. It is written the way a PyTorch user would (nanoGPT's model.py):
``nn.Linear`` layers (weight stored transposed, (O, I)) with q|k|v as one fused
projection, ``nn.LayerNorm``, ``F.scaled_dot_product_attention(is_causal=...)``,
``F.cross_entropy``; AdamW with ``foreach=True`` (``fused=True`` on CUDA); bfloat16
``torch.autocast`` when the JAX side computes in bfloat16.

    model = TorchTransformer.from_jax(params, config, device)   # copies the weights
    loss = model.loss(inputs, targets)                           # torch tensors (B, T)
    grads = model.grads_as_jax()                                 # the params pytree layout, numpy
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxformer.model.config import ModelConfig

GELU_APPROX = {"gelu": "none", "gelu_tanh": "tanh"}


def activation(name: str, h):
    if name in GELU_APPROX:
        return F.gelu(h, approximate=GELU_APPROX[name])
    return torch.relu(h) if name == "relu" else torch.tanh(h)


def sinusoidal_positions(T: int, D: int, dtype) -> torch.Tensor:
    """(T, D): sin(t / 10000^(2i/D)) at feature 2i, cos at 2i+1 (layers.sinusoidal_positions)."""
    t = torch.arange(T, dtype=torch.float64)[:, None]
    i = torch.arange(0, D, 2, dtype=torch.float64)[None, :]
    angle = t / (10000.0 ** (i / D))  # (T, ceil(D/2))
    table = torch.zeros(T, D, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : D // 2])
    return table.to(dtype)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, dtype):
        super().__init__()
        D, F_ = config.d_model, config.d_ff
        self.config = config
        kw = {"dtype": dtype}
        self.ln1 = nn.LayerNorm(D, eps=config.ln_eps, **kw)
        self.qkv = nn.Linear(D, 3 * D, **kw)  # q | k | v in one product (nanoGPT's c_attn)
        self.o = nn.Linear(D, D, **kw)
        self.ln2 = nn.LayerNorm(D, eps=config.ln_eps, **kw)
        self.w_in, self.w_out = nn.Linear(D, F_, **kw), nn.Linear(F_, D, **kw)

    def attention(self, x):  # x (B, T, D)
        B, T, D = x.shape
        H = self.config.n_heads

        def heads(t):  # (B, T, D) -> (B, H, T, Dh)
            return t.view(B, T, H, D // H).transpose(1, 2)

        q, k, v = self.qkv(x).split(D, dim=2)  # (B, T, D) each
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v),
                                             is_causal=self.config.causal)  # (B, H, T, Dh)
        return self.o(att.transpose(1, 2).reshape(B, T, D))

    def feed_forward(self, x):
        return self.w_out(activation(self.config.activation, self.w_in(x)))

    def forward(self, x):
        if self.config.norm == "pre":
            x = x + self.attention(self.ln1(x))
            return x + self.feed_forward(self.ln2(x))
        x = self.ln1(x + self.attention(x))
        return self.ln2(x + self.feed_forward(x))


class TorchTransformer(nn.Module):
    def __init__(self, config: ModelConfig, dtype=torch.float32):
        super().__init__()
        self.config = config
        D = config.d_model
        self.tok_embed = nn.Embedding(config.vocab_size, D, dtype=dtype)
        if config.positions == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(config.max_seq_len, D, dtype=dtype))
        else:
            self.register_buffer("sin_table", sinusoidal_positions(config.max_seq_len, D, dtype))
        self.blocks = nn.ModuleList(Block(config, dtype) for _ in range(config.n_layers))
        if config.norm == "pre":
            self.ln_f = nn.LayerNorm(D, eps=config.ln_eps, dtype=dtype)
        self.head = nn.Linear(D, config.vocab_size, dtype=dtype)

    def forward(self, inputs):  # inputs int64 (B, T) -> logits (B, T, V)
        T = inputs.shape[1]
        pos = self.pos_embed[:T] if self.config.positions == "learned" else self.sin_table[:T]
        x = self.tok_embed(inputs) + pos
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
        block leaves carry the layer index last in the path."""
        D = self.config.d_model
        out = [(("tok_embed",), self.tok_embed.weight, None, False)]
        if self.config.positions == "learned":
            out.append((("pos_embed",), self.pos_embed, None, False))
        for l, b in enumerate(self.blocks):
            for ln in ("ln1", "ln2"):
                m = getattr(b, ln)
                out += [(("blocks", ln, "scale", l), m.weight, None, False),
                        (("blocks", ln, "bias", l), m.bias, None, False)]
            for i, name in enumerate("qkv"):  # rows i*D:(i+1)*D of the fused projection
                rows = slice(i * D, (i + 1) * D)
                out += [(("blocks", "attn", "w" + name, l), b.qkv.weight, rows, True),
                        (("blocks", "attn", "b" + name, l), b.qkv.bias, rows, False)]
            out += [(("blocks", "attn", "wo", l), b.o.weight, None, True),
                    (("blocks", "attn", "bo", l), b.o.bias, None, False)]
            for name in ("in", "out"):
                m = getattr(b, "w_" + name)
                out += [(("blocks", "ffn", "w_" + name, l), m.weight, None, True),
                        (("blocks", "ffn", "b_" + name, l), m.bias, None, False)]
        if self.config.norm == "pre":
            out += [(("ln_f", "scale"), self.ln_f.weight, None, False),
                    (("ln_f", "bias"), self.ln_f.bias, None, False)]
        out += [(("head", "w"), self.head.weight, None, True), (("head", "b"), self.head.bias, None, False)]
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
                value = np.asarray(_get(params, path))
                target = tensor if rows is None else tensor[rows]  # a view: the copy lands in tensor
                target.copy_(torch.from_numpy(np.array(value.T if transpose else value)))
        return model.to(device) if device is not None else model

    def grads_as_jax(self) -> dict:
        """The ``.grad`` of every parameter, as numpy arrays in the params pytree layout."""
        tree: dict = {}
        for path, tensor, rows, transpose in self._pairs():
            g = tensor.grad.detach().cpu().numpy()
            g = g if rows is None else g[rows]
            _set(tree, path, g.T if transpose else g)
        return _stack_layers(tree)


def _get(params, path):
    if path[0] == "blocks":
        _, group, leaf, layer = path
        return np.asarray(params["blocks"][group][leaf])[layer]
    node = params
    for key in path:
        node = node[key]
    return node


def _set(tree, path, value):
    if path[0] == "blocks":
        _, group, leaf, layer = path
        tree.setdefault("blocks", {}).setdefault(group, {}).setdefault(leaf, {})[layer] = value
        return
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _stack_layers(tree):
    for group in tree.get("blocks", {}).values():
        for leaf, by_layer in group.items():
            group[leaf] = np.stack([by_layer[l] for l in sorted(by_layer)])
    return tree


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

