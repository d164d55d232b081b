"""init_params(key, config) -> the parameter pytree of DESIGN.md.

Weights are drawn from N(0, 0.02^2) (GPT-2's init), the two projections that
write into the residual stream (attention ``wo``, feed-forward ``w_out``) are
scaled down by 1/sqrt(2 * n_layers) so the stream's variance does not grow with
depth; biases start at zero, layer-norm scales at one. The options of ModelConfig
leave leaves out: ``bias=False`` every linear and layer-norm bias, ``head_bias=False``
head.b, ``tie_embeddings`` head.w (the head reads tok_embed); a head with neither leaf
is no "head" key at all; ``qkv_bias``, ``out_bias``, ``mlp_bias`` (None: as ``bias``) keep or drop
bq bk bv, bo and the feed-forward's b_* apart. The modern block's options (docs/design.md, "The modern block"):
``norm_type="rms"`` norms hold only a scale ({} with ``norm_scale=False``); positions
"rope" have no pos_embed; ``mlp="gated"`` has w_gate, w_up (D, F) and w_down (F, D);
``head_dim`` sets Dh apart from D / n_heads: wq (D, n_heads * Dh), wo (n_heads * Dh, D);
``n_kv_heads`` narrows wk, wv to (D, n_kv_heads * Dh); ``qk_norm`` adds attn.q_norm and
attn.k_norm, each {"scale": (Dh,)} per layer (qk_norm_scope "projection": (H Dh,) and (Hkv Dh,)).
The layouts ``norm`` "output" and "sandwich" add ln1_post and ln2_post to the blocks ("output"
has no ln1, ln2); every layout but "post" has ln_f. With ``norm_offset`` an RMS scale w is
applied as (norm_offset + w), so it starts at 1 - norm_offset (Gemma's: 0).
attn.k_norm, each {"scale": (Dh,)} per layer. ``n_experts`` > 0 puts the MoE layer in the ffn slot:
router (L, D, E), w_gate, w_up (L, E, D, F), w_down (L, E, F, D) (jaxformer/model/moe.py); with
shared_expert_d_ff Fs also shared {w_gate, w_up (L, D, Fs), w_down (L, Fs, D)} and shared_gate (L, D, 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.quantized import is_quantized

INIT_STD = 0.02


def init_params(key: jax.Array, config: ModelConfig, dtype=jnp.float32) -> dict:
    """Random parameters for ``config``; every leaf has dtype ``dtype``.

    Jitted as one program (config and dtype static): drawn op by op, the many
    small random draws would each compile on their own.
    """
    return _init_params(key, config, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_params(key, config: ModelConfig, dtype) -> dict:
    V, D, F, L, S = (config.vocab_size, config.d_model, config.d_ff,
                     config.n_layers, config.max_seq_len)
    keys = iter(jax.random.split(key, 9))

    def normal(shape, std=INIT_STD):
        return (std * jax.random.normal(next(keys), shape)).astype(dtype)

    zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    ones = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    out_std = INIT_STD / (2 * L) ** 0.5

    params = {"tok_embed": normal((V, D))}
    if config.positions == "learned":
        params["pos_embed"] = normal((S, D))
    bias, biases = config.bias, config.linear_biases
    Dq = config.n_heads * config.d_head  # the width of q: D unless head_dim sets another Dh
    Dkv = config.kv_heads * config.d_head  # the width of k and v: Dq unless grouped-query
    attn = {"wq": normal((L, D, Dq)), "wk": normal((L, D, Dkv)), "wv": normal((L, D, Dkv)),
            "wo": normal((L, Dq, D), out_std)}
    ffn = {"w_in": normal((L, D, F)), "w_out": normal((L, F, D), out_std)}
    if config.mlp == "gated":  # w_gate and w_up from their own key, so the other draws do not move
        gate_up = jax.random.split(jax.random.fold_in(key, 1), 2)
        ffn = {"w_gate": (INIT_STD * jax.random.normal(gate_up[0], (L, D, F))).astype(dtype),
               "w_up": (INIT_STD * jax.random.normal(gate_up[1], (L, D, F))).astype(dtype),
               "w_down": ffn["w_out"]}
    if config.n_experts:  # the experts (E, ...) and the router, from their own key
        ffn = moe_params(jax.random.fold_in(key, 2), config, dtype, out_std)
    if biases.qkv:
        attn.update(bq=zeros(L, Dq), bk=zeros(L, Dkv), bv=zeros(L, Dkv))
    if biases.out:
        attn.update(bo=zeros(L, D))
    if biases.mlp:
        if config.mlp == "gated":
            ffn.update(b_gate=zeros(L, F), b_up=zeros(L, F), b_down=zeros(L, D))
        else:
            ffn.update(b_in=zeros(L, F), b_out=zeros(L, D))

    def norm(*shape, rms=False):
        if config.norm_type == "rms" or rms:  # no bias; no scale with norm_scale False; w = 1 - norm_offset
            return {"scale": ones(*shape) * (1 - config.norm_offset)} if config.norm_scale else {}
        return {"scale": ones(*shape), "bias": zeros(*shape)} if bias else {"scale": ones(*shape)}

    if config.qk_norm:  # an RMS norm over each head's width Dh (or all of q's and k's), for q and for k
        whole = config.qk_norm_scope == "projection"
        qw, kw = (config.n_heads * config.d_head, config.kv_heads * config.d_head) if whole else (config.d_head,) * 2
        attn.update(q_norm=norm(L, qw, rms=True), k_norm=norm(L, kw, rms=True))
    blocks = {"ln1": norm(L, D), "attn": attn, "ln2": norm(L, D), "ffn": ffn}
    if config.norm == "output":  # the sublayers' outputs normed only
        del blocks["ln1"], blocks["ln2"]
    if config.norm in ("output", "sandwich"):
        blocks.update(ln1_post=norm(L, D), ln2_post=norm(L, D))
    params["blocks"] = blocks
    if config.norm != "post":
        params["ln_f"] = norm(D)
    head_w = normal((D, V))  # drawn in every case, so the other leaves' draws do not move
    head = {}
    if not config.tie_embeddings:
        head["w"] = head_w
    if config.head_bias:
        head["b"] = zeros(V)
    if head:
        params["head"] = head
    return params


def moe_params(key, config: ModelConfig, dtype, out_std: float) -> dict:
    """The MoE feed-forward's leaves: router (L, D, E), w_gate, w_up (L, E, D, F), w_down (L, E, F, D);
    the shared expert's (shared_expert_d_ff Fs): shared {w_gate, w_up (L, D, Fs), w_down (L, Fs, D)},
    shared_gate (L, D, 1)."""
    L, D, E, F = config.n_layers, config.d_model, config.n_experts, config.expert_width
    k = jax.random.split(key, 4)
    normal = lambda i, shape, std=INIT_STD: (std * jax.random.normal(k[i], shape)).astype(dtype)  # noqa: E731
    ffn = {"router": normal(0, (L, D, E)), "w_gate": normal(1, (L, E, D, F)),
           "w_up": normal(2, (L, E, D, F)), "w_down": normal(3, (L, E, F, D), out_std)}
    if config.shared_expert_d_ff:  # Qwen2-MoE's shared expert, from its own key: the draws above do not move
        Fs, ks = config.shared_expert_d_ff, jax.random.split(jax.random.fold_in(key, 4), 4)
        shared = lambda i, shape, std=INIT_STD: (std * jax.random.normal(ks[i], shape)).astype(dtype)  # noqa: E731
        ffn["shared"] = {"w_gate": shared(0, (L, D, Fs)), "w_up": shared(1, (L, D, Fs)),
                         "w_down": shared(2, (L, Fs, D), out_std)}
        if config.shared_expert_gate:
            ffn["shared_gate"] = shared(3, (L, D, 1))
    return ffn


def head_weights(params, config: ModelConfig):
    """The head's (w (D, V), b (V,) or None): w = tok_embed^T when the embeddings are tied."""
    head = params.get("head", {})
    w = params["tok_embed"].T if config.tie_embeddings else head["w"]
    return w, head.get("b")


def count_params(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


@functools.lru_cache(maxsize=32)
def expected_shapes(config: ModelConfig) -> dict[str, tuple]:
    """{leaf path (keystr, e.g. "['blocks']['attn']['wq']"): shape} of ``config``'s params."""
    expected = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    return {jax.tree_util.keystr(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}


def validate_params(params, config: ModelConfig) -> None:
    """Raise ValueError naming the first leaf that is missing, unexpected or of the
    wrong shape for ``config`` (e.g. a tok_embed with fewer rows than vocab_size).
    Looks only at the tree and the shapes, so it costs nothing under jit."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict (the params pytree), got {type(params).__name__}")
    expected = expected_shapes(config)
    got = {jax.tree_util.keystr(path): leaf
           for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
           if "['lora']" not in jax.tree_util.keystr(path)}  # attached LoRA adapters (lora.py)
    for path, shape in expected.items():
        if path not in got:
            raise ValueError(f"params{path} is missing (the config needs shape {shape})")
        leaf_shape = tuple(getattr(got[path], "shape", ()))
        if leaf_shape != shape:
            raise ValueError(f"params{path} has shape {leaf_shape}, the config needs {shape}")
    extra = [path for path in got if path not in expected]
    if extra:
        raise ValueError(f"params{extra[0]} is not a parameter of this config")


def check_params(params, config: ModelConfig) -> None:
    """Raise ValueError naming the first leaf whose path or shape does not fit ``config``
    (the same check as ``validate_params``)."""
    validate_params(params, config)
