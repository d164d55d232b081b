"""LoRA: low-rank adapters beside frozen projections.

    y = x W + b + s (drop(x) A) B        s = alpha / r;  A (I, r), B (r, O)

The adapters are their own pytree, with the paths of the weights they adapt, each leaf
stacked over the layers like params["blocks"]:

    adapters = {"blocks": {"attn": {"wq": {"a": (L, D, r), "b": (L, r, H Dh)}, ...},
                           "ffn": {"w_up": {"a": (L, D, r), "b": (L, r, F)}, ...}}}

A starts as PEFT draws it (kaiming-uniform with a = sqrt(5): U(-1/sqrt(I), 1/sqrt(I))),
B at zeros, so a fresh adapter leaves the model's output as it was. ``attach`` puts them
into the params the model runs on, under a "lora" key of the layer groups, with the scale
s (L,), and where dropout is on its rate (L,) and a key per layer (L, 2); the
projections (attention.py, mlp.py) add ``adapted``'s term where that key is there. The
frozen base params are never changed; the gradient tree is the adapters' own
(``adapter_grads``). The hand-derived backward is manual_grads/lora.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxformer.model.checks import check_int, check_number, is_number, refuse
from jaxformer.model.dropout import dropout, fold
from jaxformer.model.params import init_params
from jaxformer.model.precision import matmul
from jaxformer.model.quantized import dequantize_params

# target name -> (the layer group, the weight) in params["blocks"]
TARGETS = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("ffn", "w_gate"), "up": ("ffn", "w_up"), "down": ("ffn", "w_down"),
           "in": ("ffn", "w_in"), "out": ("ffn", "w_out")}
LORA = "lora"  # the key attach adds to params["blocks"]["attn"] and ["ffn"]
LORA_SALT = 0x4C6F5241  # folded into a step's dropout key for the adapters' dropout
WEIGHT_INDEX = {w: i for i, (_, w) in enumerate(TARGETS.values())}  # each adapter's own dropout key


def parse_targets(spec) -> tuple[str, ...]:
    """"v,q" or ("q", "v") -> ("q", "v") (TARGETS' order); "all": every projection. ValueError
    names a bad one."""
    names = tuple(t.strip() for t in spec.split(",") if t.strip()) if isinstance(spec, str) else tuple(spec)
    if names == ("all",):
        return tuple(TARGETS)
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise ValueError(f"lora_targets must name projections among {', '.join(TARGETS)} "
                         f"(or 'all'), got {spec!r}")
    return tuple(t for t in TARGETS if t in names)  # TARGETS' order, once each


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the scale is alpha / r), dropout on the adapters' input, and the
    projections adapted (TARGETS' names; the plain MLP's are in/out, the gated one's
    gate/up/down). ``check_targets`` refuses a name the model lacks (a run's settings do);
    ``init_adapters`` skips it while another name is there, and "all" takes what there is."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    def __post_init__(self):
        object.__setattr__(self, "rank", check_int("lora_rank", self.rank))
        if not is_number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            refuse("lora_alpha", "a positive number", self.alpha)
        check_number("lora_dropout", self.dropout, 0, 1, high_open=True)
        object.__setattr__(self, "targets", parse_targets(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def sites(params, lora: LoraConfig) -> list[tuple[str, str]]:
    """The (group, weight) pairs of params["blocks"] that ``lora`` adapts, in TARGETS' order: the
    named projections the model has, as (L, in, out) weights (an MoE layer's experts, (L, E, in,
    out), take no adapters; its attention's do)."""
    blocks = params["blocks"]
    return [TARGETS[t] for t in TARGETS if t in lora.targets and TARGETS[t][1] in blocks[TARGETS[t][0]]
            and blocks[TARGETS[t][0]][TARGETS[t][1]].ndim == 3]


def check_targets(config, lora: LoraConfig) -> None:
    """ValueError naming each of ``lora``'s targets the model of ``config`` (a ModelConfig)
    has no adaptable projection for, and those it has; "all" (every name) takes what there is."""
    if set(lora.targets) == set(TARGETS):
        return
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    has = [t for t in TARGETS if TARGETS[t] in sites(shapes, LoraConfig(targets=tuple(TARGETS)))]
    missing = [t for t in lora.targets if t not in has]
    if missing:
        experts = "; an MoE layer's experts take no adapters" if config.n_experts else ""
        raise ValueError(f"lora_targets {','.join(missing)} name no projection of this model (its projections: "
                         f"{', '.join(has)}{experts})")


def init_adapters(key, params, lora: LoraConfig, dtype=None) -> dict:
    """Fresh adapters for ``params``: A ~ U(-1/sqrt(I), 1/sqrt(I)) (L, I, r), B zeros (L, r, O)."""
    out = {}
    for i, (group, name) in enumerate(sites(params, lora)):
        w = params["blocks"][group][name]  # (L, I, O)
        L, I, O = w.shape
        dt = dtype or w.dtype
        bound = 1.0 / math.sqrt(I)
        a = jax.random.uniform(jax.random.fold_in(key, i), (L, I, lora.rank), dt, -bound, bound)
        out.setdefault(group, {})[name] = {"a": a, "b": jnp.zeros((L, lora.rank, O), dt)}
    if not out:
        raise ValueError(f"lora_targets {','.join(lora.targets)} name no projection of this model")
    return {"blocks": out}


def attach(params, adapters, lora: LoraConfig, key=None) -> dict:
    """params with the adapters under params["blocks"][group]["lora"], beside the scale s
    (L,), and with dropout (a ``key`` and lora.dropout > 0) its rate (L,) and a key per
    layer (L, 2). The base leaves are the same arrays."""
    blocks = dict(params["blocks"])
    for group, ads in adapters["blocks"].items():
        L = next(iter(ads.values()))["a"].shape[0]
        dt = next(iter(ads.values()))["a"].dtype
        site = {**ads, "scale": jnp.full((L,), lora.scale, dt)}
        if key is not None and lora.dropout:
            gkey = jax.random.fold_in(jax.random.fold_in(key, LORA_SALT), group == "ffn")
            site.update(rate=jnp.full((L,), lora.dropout, dt), key=jax.random.split(gkey, L))
        blocks[group] = {**blocks[group], LORA: site}
    return {**params, "blocks": blocks}


def adapter_grads(grads) -> dict:
    """The adapters' part of a gradient of attached params: {"blocks": {group: {w: {"a", "b"}}}}."""
    out = {}
    for group, g in grads["blocks"].items():
        if isinstance(g, dict) and LORA in g:
            out[group] = {k: v for k, v in g[LORA].items() if isinstance(v, dict)}
    return {"blocks": out}


def site_key(site, name):
    """The dropout key of weight ``name``'s adapter in one layer's site, or None (no dropout): the
    adapter's own where it has one (a tensor-parallel device's piece, parallel/tensor.py's
    local_adapters), else the site's folded with the weight's index (a dropout.PieceKey stays one)."""
    if "key" in site[name]:
        return site[name]["key"]
    if "key" not in site:
        return None
    return fold(site["key"], WEIGHT_INDEX[name])


def lora_down(site, name, x, compute_dtype=None):
    """x (..., I) -> (drop(x) (..., I), u = drop(x) @ A (..., r))."""
    xd = dropout(x, site.get("rate", 0.0), site_key(site, name))
    return xd, matmul(xd, site[name]["a"], compute_dtype)


def lora_up(site, name, u, compute_dtype=None):
    """u (..., r) -> s u @ B (..., O)."""
    return site["scale"] * matmul(u, site[name]["b"], compute_dtype)


def adapted(p, names, x, y, compute_dtype=None):
    """y (..., sum of the widths of p[names]) = x @ [p[n] for n in names] (+ b), plus each
    adapted name's s (drop(x) A) B in its columns; y as it is where p has no adapters."""
    site = p.get(LORA)
    if site is None or not any(n in site for n in names):
        return y
    parts = []
    for n in names:
        if n in site:
            parts.append(lora_up(site, n, lora_down(site, n, x, compute_dtype)[1], compute_dtype))
        else:
            parts.append(jnp.zeros(y.shape[:-1] + (p[n].shape[-1],), y.dtype))
    delta = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return y + delta.astype(y.dtype)


def merge(params, adapters, lora: LoraConfig) -> dict:
    """The base params with each adapted W replaced by W + s A B (no dropout): the same model
    in the base layout (export --merge); a base held quantized comes out dequantized (float)."""
    params = dequantize_params(params)
    blocks = {g: dict(v) if isinstance(v, dict) else v for g, v in params["blocks"].items()}
    for group, ads in adapters["blocks"].items():
        for name, ab in ads.items():
            w = blocks[group][name]
            delta = lora.scale * jnp.einsum("lir,lro->lio", ab["a"], ab["b"])
            blocks[group][name] = (w + delta.astype(w.dtype)).astype(w.dtype)
    return {**params, "blocks": blocks}

