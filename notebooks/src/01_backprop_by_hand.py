# Cells of notebooks/01_backprop_by_hand.ipynb; rebuild with
# `python notebooks/build_notebooks.py --execute 01` after editing.

# %% [markdown]
# # Backpropagation by hand
#
# Every layer of jaxformer has a forward in `jaxformer/model/` and, in `manual_grads/`,
# a pair `y, res = layer_fwd(p, x)` / `dp, dx = layer_bwd(res, dy)` written out by hand.
# This notebook derives each backward in a few lines, shows its code, and puts the
# hand-derived gradient next to the one `jax.vjp` computes from the jaxformer layer, in
# float64. At the end the whole model's hand-derived gradient meets `jax.grad`, leaf by leaf.
#
# Notation: $\bar y = \partial L / \partial y$ is the gradient flowing back into $y$
# (the cotangent `dy`); sums run over every leading (batch and time) index.
#
# Each comparison prints one line per gradient, as in the "becoming a backprop ninja"
# exercises: **exact** (every entry bit-for-bit equal), **approximate** (equal to float64
# round-off: `np.allclose` with `rtol=1e-10, atol=1e-12`) and **maxdiff** (the largest
# absolute difference). Exact is a matter of luck (the same sum in another order differs
# in the last bit); approximate is the one that must hold.

# %%
import inspect

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)  # compare in float64: round-off ~1e-16
# Every program here runs once: compile it fast rather than make it run fast.
jax.config.update("jax_disable_most_optimizations", True)

from jaxformer.model import layers

rng = np.random.default_rng(0)
rand = lambda *shape: jnp.asarray(rng.standard_normal(shape))  # noqa: E731  float64 test data


def cmp(name, manual, auto):
    """One line: exact | approximate | maxdiff of a hand-derived gradient against jax's."""
    manual, auto = np.asarray(manual), np.asarray(auto)
    exact = bool(np.array_equal(manual, auto))
    approximate = bool(np.allclose(manual, auto, rtol=1e-10, atol=1e-12))
    maxdiff = float(np.max(np.abs(manual - auto))) if manual.size else 0.0
    print(f"{name:<16} | exact: {exact!s:<5} | approximate: {approximate!s:<5} "
          f"| maxdiff: {maxdiff:.1e}")
    return approximate


def grad_names(grads, names):
    """Labels of the leaves of a tuple of gradients: "dw" for p["w"], "dx" for x."""
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    return [("d" + str(path[1].key)) if len(path) > 1 else "d" + names[path[0].idx]
            for path, _ in paths]


def check(manual_fwd, manual_bwd, layer, primals, dy, names=("p", "x")):
    """The manual pair against jax.vjp of the jaxformer layer, both in one jitted call.
    manual_bwd returns one gradient per differentiable input, as vjp does. Prints a few
    entries of the last gradient (the one that flows on, towards the input) from both,
    then the exact | approximate | maxdiff line of the output and of every gradient."""

    @jax.jit
    def both(primals, dy):
        y, res = manual_fwd(*primals)
        y_ref, vjp = jax.vjp(layer, *primals)
        return (y, tuple(manual_bwd(res, dy))), (y_ref, vjp(dy))

    (y, grads), (y_ref, grads_ref) = both(primals, dy)
    labels = grad_names(grads, names)
    last, last_ref = jax.tree_util.tree_leaves(grads)[-1], jax.tree_util.tree_leaves(grads_ref)[-1]
    fmt = dict(precision=6, floatmode="fixed", sign=" ")
    print(f"{labels[-1]}, first entries:")
    print(f"  by hand   {np.array2string(np.ravel(last)[:4], **fmt)}")
    print(f"  jax.vjp   {np.array2string(np.ravel(last_ref)[:4], **fmt)}")
    ok = cmp("output", y, y_ref)
    for label, g, g_ref in zip(labels, jax.tree_util.tree_leaves(grads),
                               jax.tree_util.tree_leaves(grads_ref)):
        ok &= cmp(label, g, g_ref)
    return ok


def show(fn):
    print(inspect.getsource(fn))

# %% [markdown]
# ## Linear: $y = x W + b$
#
# With $x$ of shape $(N, I)$, $W$ $(I, O)$, $b$ $(O,)$ and $\bar y$ $(N, O)$:
#
# $$\bar W = x^\top \bar y, \qquad \bar b = \textstyle\sum_n \bar y_n, \qquad \bar x = \bar y\, W^\top.$$

# %%
from manual_grads.linear import linear_bwd, linear_fwd

show(linear_bwd)
p = {"w": rand(5, 3), "b": rand(3)}
x, dy = rand(2, 4, 5), rand(2, 4, 3)  # (B, T, I) and (B, T, O)
assert check(linear_fwd, linear_bwd, lambda p, x: layers.linear(x, p["w"], p["b"]), (p, x), dy)

# %% [markdown]
# ## Activations
#
# Elementwise, so $\bar x = \bar y \odot f'(x)$. For the exact GELU, $f(x) = x\,\Phi(x)$
# with $\Phi$ the standard normal CDF and $\varphi$ its density:
#
# $$f'(x) = \Phi(x) + x\,\varphi(x).$$
#
# ReLU's derivative is 1 for $x>0$, 0 for $x<0$ (and 1/2 at a tie, as `jax.grad` of
# `jnp.maximum` picks); tanh's is $1 - \tanh^2 x$, computed from the kept output.
# SiLU, $f(x) = x\,\sigma(x)$ with $\sigma' = \sigma(1 - \sigma)$, and ReLU², $f(x) = \max(x, 0)^2$:
#
# $$\operatorname{silu}'(x) = \sigma(x)\,\bigl(1 + x\,(1 - \sigma(x))\bigr), \qquad (\operatorname{relu}^2)'(x) = 2\max(x, 0).$$

# %%
from manual_grads.activations import activation_bwd, activation_fwd, gelu_bwd

show(gelu_bwd)
x, dy = rand(3, 7), rand(3, 7)
for name in ("gelu", "gelu_tanh", "relu", "tanh", "silu", "relu2"):
    print(f"--- {name}")
    assert check(lambda x: activation_fwd(name, x), lambda res, dy: (activation_bwd(res, dy),),
                 lambda x: layers.activation(name, x), (x,), dy, names=("x",))

# %% [markdown]
# ## Layer norm
#
# $\hat x = (x - \mu)\, r$ with $r = 1/\sqrt{\sigma^2 + \epsilon}$ over the last axis of width $D$,
# then $y = \hat x \odot \gamma + \beta$. So $\bar\gamma = \sum \bar y \odot \hat x$,
# $\bar\beta = \sum \bar y$, and with $\bar{\hat x} = \bar y \odot \gamma$ the gradient reaches
# $x$ directly and through $\mu$ and $\sigma^2$:
#
# $$\bar x = r\left(\bar{\hat x} - \operatorname{mean}(\bar{\hat x}) - \hat x\,\operatorname{mean}(\bar{\hat x} \odot \hat x)\right).$$

# %%
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd

show(layer_norm_bwd)
p = {"scale": rand(6), "bias": rand(6)}
x, dy = jnp.asarray(3.0 * rng.standard_normal((2, 5, 6)) + 1.0), rand(2, 5, 6)
assert check(lambda p, x: layer_norm_fwd(p, x, 1e-5), layer_norm_bwd,
             lambda p, x: layers.layer_norm(p, x, 1e-5), (p, x), dy)

# %% [markdown]
# ## Attention: the softmax
#
# Per row, $P = \operatorname{softmax}(S)$ has Jacobian $\operatorname{diag}(P) - P P^\top$, so
#
# $$\bar S = P \odot \left(\bar P - \textstyle\sum_j \bar P_j P_j\right).$$
#
# Causally masked scores have $P = 0$ and get no gradient. The rest of attention is
# matrix products: with $S = Q K^\top/\sqrt{d_h}$ and $A = P V$,
# $\bar V = P^\top \bar A$, $\bar P = \bar A V^\top$, $\bar Q = \bar S K / \sqrt{d_h}$,
# $\bar K = \bar S^\top Q / \sqrt{d_h}$, and the q, k, v projections are one linear layer
# whose $\bar x$ adds the three paths, because $q$, $k$ and $v$ all read $x$.

# %%
from jaxformer.model.config import ModelConfig
from manual_grads.attention import attention_bwd, attention_fwd, softmax_bwd

show(softmax_bwd)
softmax = lambda s: jax.nn.softmax(s, axis=-1)  # noqa: E731
print("--- softmax")
assert check(lambda s: (softmax(s), softmax(s)), lambda P, dP: (softmax_bwd(P, dP),), softmax,
             (rand(2, 4, 4),), rand(2, 4, 4), names=("s",))

print("--- attention, causal, 2 heads")
D, H = 8, 2
config = ModelConfig(d_model=D, n_heads=H)  # what the layer reads: heads, causal, the core ("full")
p = {f"{w}{n}": rand(D, D) if w == "w" else rand(D) for n in "qkvo" for w in "wb"}
assert check(lambda p, x: attention_fwd(p, x, config), attention_bwd,
             lambda p, x: layers.attention(p, x, config), (p, rand(2, 5, D)), rand(2, 5, D))

# %% [markdown]
# What the softmax backward does, seen on one head: the probabilities $P$ (lower
# triangle: causal), the gradient $\bar P$ arriving from $A = PV$ (defined everywhere,
# even where $P = 0$), and $\bar S$. Masked entries get exactly zero, and each row of
# $\bar S$ sums to zero: adding a constant to a row of scores changes no probability.

# %%
T = 8
p_soft = {k: 0.3 * v for k, v in p.items()}  # smaller weights: scores of order 1, a softer softmax
x, dy = rand(1, T, D), rand(1, T, D)
y, res = attention_fwd(p_soft, x, config)
P = res.core.probs[0, 0]  # (T, T) head 0: the full core keeps the probabilities
datt = layers.split_heads(dy @ p_soft["wo"].T, H)  # undoes y = merge_heads(P v) @ wo + bo
dP = (datt @ jnp.swapaxes(res.core.v, -1, -2))[0, 0]  # (T, T)
dS = softmax_bwd(P, dP)
print(f"dS where masked: max |dS| = {float(jnp.max(jnp.abs(jnp.triu(dS, 1)))):.1e}")
print(f"row sums of dS:  max |sum| = {float(jnp.max(jnp.abs(dS.sum(-1)))):.1e}")

fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
for ax, (title, m, cmap) in zip(axes, [("P = softmax(S)", P, "viridis"), ("dP", dP, "RdBu_r"),
                                       ("dS = P * (dP - rowsum(dP * P))", dS, "RdBu_r")]):
    m = np.asarray(m)
    lim = np.abs(m).max()
    im = ax.imshow(m, cmap=cmap, vmin=0 if cmap == "viridis" else -lim, vmax=lim)
    ax.set(title=title, xlabel="key position", ylabel="query position")
    fig.colorbar(im, ax=ax, shrink=0.8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Blockwise attention: the FlashAttention-2 backward
#
# With `attention_impl="blockwise"` the forward never forms the $(T, T)$ matrix $P$: for each
# block of $K$ queries it runs an online softmax over the key blocks (skipping, when causal,
# the blocks above the diagonal) and keeps only $O = PV$ and each row's log-sum-exp
# $\ell_i = \log\sum_j e^{S_{ij}}$. The backward recomputes any block of probabilities as
# $P_{ij} = e^{S_{ij} - \ell_i}$, and needs one more number per row: since $O_i = \sum_j P_{ij} V_j$,
#
# $$D_i = \textstyle\sum_j \bar P_{ij} P_{ij} = \sum_j (\bar O_i \cdot V_j) P_{ij} = \bar O_i \cdot O_i .$$
#
# Then, one (query block, key block) pair at a time: $\bar V_j \mathrel{+}= P_{ij}^\top \bar O_i$,
# $\bar P_{ij} = \bar O_i V_j^\top$, $\bar S_{ij} = P_{ij} \odot (\bar P_{ij} - D_i)$ (the softmax
# backward above, with $D$ in place of the row sum), $\bar Q_i \mathrel{+}= \bar S_{ij} K_j/\sqrt{d_h}$ and
# $\bar K_j \mathrel{+}= \bar S_{ij}^\top Q_i/\sqrt{d_h}$. Memory falls from $O(T^2)$ to $O(T)$ per head.

# %%
from manual_grads.blockwise import pair_bwd

show(pair_bwd)
T, block = 13, 4  # 13 positions: 4 blocks of 4, the last one padded
x, dy = rand(2, T, D), rand(2, T, D)
for causal in (True, False):
    print("--- blockwise against full attention,", "causal" if causal else "bidirectional")
    full = config.replace(causal=causal)
    blockwise = full.replace(attention_impl="blockwise", attention_block=block)
    assert check(lambda p, x: attention_fwd(p, x, blockwise), attention_bwd,
                 lambda p, x: layers.attention(p, x, full), (p, x), dy)

# %% [markdown]
# ## Grouped-query attention
#
# Llama-family models give $k$ and $v$ fewer heads than $q$: $H_{kv} = H / G$ key/value
# heads, so $W_k$ and $W_v$ are $(D, H_{kv} d_h)$, and query head $h$ reads key/value head
# $\lfloor h/G \rfloor$. $G = 1$ is the attention above; $H_{kv} = 1$ is multi-query
# attention. The forward copies each key/value head $G$ times (`repeat_kv`, Hugging Face's
# name), then runs the same core on $H$ heads:
#
# $$K'_h = K_{\lfloor h/G \rfloor}, \qquad V'_h = V_{\lfloor h/G \rfloor}, \qquad h = 0, \dots, H - 1.$$
#
# A copy sends one value to $G$ places, so its transpose adds the $G$ gradients that come
# back (the embedding's scatter-add below is the same rule). The core's backward gives
# $\bar K'$ and $\bar V'$ on $H$ heads, as before, and
#
# $$\bar K_j = \sum_{h:\ \lfloor h/G \rfloor = j} \bar K'_h, \qquad \bar V_j = \sum_{h:\ \lfloor h/G \rfloor = j} \bar V'_h$$
#
# (`sum_groups`: the head axis reshaped to $(H_{kv}, G)$, then summed over $G$). Everything
# before the copy, $k$'s and $v$'s projections and QK-norm and rotary positions on $k$
# (derived below), runs on the $H_{kv}$ heads, so $\bar W_k$ has $W_k$'s shape
# $(D, H_{kv} d_h)$. Below: $H = 4$ query heads over $H_{kv} = 2$ ($G = 2$) and over one
# ($H_{kv} = 1$), no biases, with QK-norm and rotary positions as in `llama-tiny`.

# %%
from manual_grads.attention import sum_groups

show(layers.repeat_kv)
show(sum_groups)
D, H, Dh = 16, 4, 4
x, dy = rand(2, 6, D), rand(2, 6, D)
for Hkv in (2, 1):
    print(f"--- causal, H = {H} query heads over Hkv = {Hkv} key/value heads (G = {H // Hkv})")
    p = {"wq": rand(D, D), "wk": rand(D, Hkv * Dh), "wv": rand(D, Hkv * Dh), "wo": rand(D, D),
         "q_norm": {"scale": rand(Dh)}, "k_norm": {"scale": rand(Dh)}}
    gqa = ModelConfig(d_model=D, n_heads=H, n_kv_heads=Hkv, qk_norm=True, ln_eps=1e-6,
                      positions="rope", rope_theta=10000.0)
    assert check(lambda p, x: attention_fwd(p, x, gqa), attention_bwd,
                 lambda p, x: layers.attention(p, x, gqa), (p, x), dy)

# %% [markdown]
# What it saves: decoding keeps every past token's keys and values, and the cache holds
# them with $H_{kv}$ heads, $(L, B, H_{kv}, S, d_h)$ each (`kv_cache.init_cache`). The
# `smollm` preset (SmolLM-135M's shape: 30 layers, 9 query heads over 3 key/value heads of
# width 64, 2048 positions), one sequence in bfloat16:

# %%
from jaxformer.model.config import get_preset
from jaxformer.model.kv_cache import init_cache

smollm = get_preset("smollm")
mib = {}  # Hkv -> MiB of k and v
for n in (smollm.n_heads, smollm.kv_heads):
    cache = jax.eval_shape(lambda: init_cache(smollm.replace(n_kv_heads=n), 1, jnp.bfloat16))
    mib[n] = sum(a.size * a.dtype.itemsize for a in cache.values()) / 2**20  # shapes only
L, B, _, S, Dh = cache["k"].shape
print(f"k and v (L, B, Hkv, S, Dh) = ({L}, {B}, Hkv, {S}, {Dh}): {mib[smollm.n_heads]:.1f} MiB with "
      f"Hkv = H = {smollm.n_heads}, {mib[smollm.kv_heads]:.1f} MiB with Hkv = {smollm.kv_heads}")

# %% [markdown]
# ## Embedding
#
# $x_{b,t} = E_{\text{id}_{b,t}}$ reads rows of the table, so the backward adds each
# $\bar x_{b,t}$ into the row it was read from (a scatter-add; a token seen $n$ times
# collects $n$ rows). The integer ids get no gradient.

# %%
from manual_grads.embedding import token_embed_bwd, token_embed_fwd

show(token_embed_bwd)
table = rand(10, 4)
ids = jnp.array([[1, 3, 3], [0, 1, 9]])  # token 3 twice, token 1 in both rows
assert check(lambda t: token_embed_fwd(t, ids), lambda res, dx: token_embed_bwd(res, dx)[:1],
             lambda t: layers.token_embedding(t, ids), (table,), rand(2, 3, 4), names=("table",))

# %% [markdown]
# ## Cross entropy
#
# The loss is the mean over $N$ positions of $\log\sum_v e^{z_v} - z_{\text{target}}$, so
#
# $$\bar z = \frac{1}{N}\left(\operatorname{softmax}(z) - \operatorname{onehot}(\text{target})\right)$$
#
# (with a mask, $1/N$ becomes $\text{mask}/\sum \text{mask}$).

# %%
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd

show(cross_entropy_bwd)
logits = jnp.asarray(4.0 * rng.standard_normal((2, 5, 11)))  # (B, T, V)
targets = jnp.asarray(rng.integers(0, 11, (2, 5)))  # (B, T)
assert check(lambda z: cross_entropy_fwd(z, targets), lambda res, d: cross_entropy_bwd(res, d)[:1],
             lambda z: layers.cross_entropy(z, targets), (logits,), jnp.float64(1.0), names=("z",))

# %% [markdown]
# ## RMS norm
#
# Llama's norm drops layer norm's mean and bias: $\hat x = x\, r$ with
# $r = 1/\sqrt{\operatorname{mean}(x^2) + \epsilon}$ over the last axis of width $D$, then
# $y = \hat x \odot \gamma$. So $\bar\gamma = \sum \bar y \odot \hat x$, and with
# $\bar{\hat x} = \bar y \odot \gamma$ and $\partial r / \partial x_j = -r^3 x_j / D$:
#
# $$\bar x = r\left(\bar{\hat x} - \hat x\,\operatorname{mean}(\bar{\hat x} \odot \hat x)\right),$$
#
# layer norm's $\bar x$ without its $\operatorname{mean}(\bar{\hat x})$ term. The same pair
# normalizes the residual stream $(B, T, D)$ and, with QK-norm, each head's $q$ and $k$
# $(B, H, T, d_h)$ with a scale $(d_h,)$ summed over $B$, $H$ and $T$.

# %%
from manual_grads.rms_norm import rms_norm_bwd, rms_norm_fwd

show(rms_norm_bwd)
print("--- scale (4,), over each head's q (B, H, T, Dh)")
q, dq = jnp.asarray(2.0 * rng.standard_normal((2, 3, 5, 4)) + 1.0), rand(2, 3, 5, 4)
assert check(lambda p, x: rms_norm_fwd(p, x, 1e-6), rms_norm_bwd,
             lambda p, x: layers.rms_norm(p, x, 1e-6), ({"scale": rand(4)}, q), dq)
print("--- no scale (p = {}), over the residual stream (B, T, D)")
x, dy = jnp.asarray(3.0 * rng.standard_normal((2, 5, 6)) + 1.0), rand(2, 5, 6)
assert check(lambda p, x: rms_norm_fwd(p, x, 1e-6), rms_norm_bwd,
             lambda p, x: layers.rms_norm(p, x, 1e-6), ({}, x), dy)

# %% [markdown]
# ## Rotary position embeddings
#
# Each head's features form pairs $(x_i, x_{i + d_h/2})$, and at position $t$ the pair
# turns by the angle $a_{t,i} = t\,\theta^{-2i/d_h}$ (Hugging Face Llama's layout). With
# $x = [x_1, x_2]$ split into halves and the tables $c = [\cos a, \cos a]$, $s = [\sin a, \sin a]$:
#
# $$y = x \odot c + R x \odot s, \qquad R = \begin{pmatrix} 0 & -I \\ I & 0 \end{pmatrix},\quad R\,[x_1, x_2] = [-x_2, x_1].$$
#
# $y$ is linear in $x$, so $\bar x$ is the transpose applied to $\bar y$, and $R^\top = -R$
# sends $[g_1, g_2]$ to $[g_2, -g_1]$:
#
# $$\bar x = \bar y \odot c + R^\top (\bar y \odot s).$$
#
# That is the rotation by $-a$: the backward of a rotation is its inverse. The tables are
# functions of the integer positions, so nothing gets a gradient through them.

# %%
from manual_grads.rotary import rope_bwd, rope_fwd

show(rope_bwd)
cos, sin = layers.rope_tables(jnp.arange(5, 12), 8, 10000.0, jnp.float64)  # positions 5..11, Dh 8
x, dy = rand(2, 3, 7, 8), rand(2, 3, 7, 8)  # (B, H, T, Dh)
assert check(lambda x: rope_fwd(x, cos, sin), lambda res, dy: (rope_bwd(res, dy),),
             lambda x: layers.apply_rope(x, cos, sin), (x,), dy, names=("x",))
y, res = rope_fwd(x, cos, sin)
print(f"the backward undoes the rotation: max |rope_bwd(res, y) - x| = "
      f"{float(jnp.max(jnp.abs(rope_bwd(res, y) - x))):.1e}")

# %% [markdown]
# ## The gated MLP: SwiGLU
#
# Llama's feed-forward gates one projection of $x$ with another:
# $g = x W_g$, $u = x W_u$, $h = \operatorname{silu}(g) \odot u$, $y = h W_d$.
# Read backwards, one line per forward line, with the linear and activation pairs above:
#
# $$\bar W_d = h^\top \bar y,\quad \bar h = \bar y W_d^\top,\quad
# \bar u = \bar h \odot \operatorname{silu}(g),\quad \bar g = \operatorname{silu}'(g) \odot \bar h \odot u,$$
#
# $$\bar W_u = x^\top \bar u,\quad \bar W_g = x^\top \bar g,\quad \bar x = \bar g W_g^\top + \bar u W_u^\top$$
#
# ($x$ feeds both projections, so its two gradients add).

# %%
def swiglu_fwd(p, x):
    g, res_g = linear_fwd({"w": p["w_gate"]}, x)  # (B, T, F)
    u, res_u = linear_fwd({"w": p["w_up"]}, x)  # (B, T, F)
    a, res_a = activation_fwd("silu", g)  # (B, T, F)
    y, res_d = linear_fwd({"w": p["w_down"]}, a * u)  # (B, T, D)
    return y, (res_g, res_u, res_a, res_d, a, u)


def swiglu_bwd(res, dy):
    res_g, res_u, res_a, res_d, a, u = res
    dp_d, dh = linear_bwd(res_d, dy)  # y = h W_d
    da, du = dh * u, dh * a  # h = silu(g) * u
    dg = activation_bwd(res_a, da)  # a = silu(g)
    dp_u, dx_u = linear_bwd(res_u, du)  # u = x W_u
    dp_g, dx_g = linear_bwd(res_g, dg)  # g = x W_g
    return {"w_gate": dp_g["w"], "w_up": dp_u["w"], "w_down": dp_d["w"]}, dx_g + dx_u


D, F = 6, 10
p = {"w_gate": rand(D, F), "w_up": rand(D, F), "w_down": rand(F, D)}
x, dy = rand(2, 4, D), rand(2, 4, D)
assert check(swiglu_fwd, swiglu_bwd, lambda p, x: layers.feed_forward(p, x, "silu"), (p, x), dy)

# %% [markdown]
# ## Mixture of experts: grouped matmuls and the router through top-k
#
# A mixture-of-experts layer sends each of its $N$ tokens to $k$ of $E$ expert MLPs. The
# router scores the experts, $\ell = x R$ and $P = \operatorname{softmax}(\ell)$; top-k picks
# $k$ of them per token with gate weights $g_{nj}$; the $Nk$ (token, choice) slots are sorted
# by expert, so that expert $e$'s slots form one contiguous group of rows $X_e$; each group
# goes through its own gated MLP as *grouped matmuls* (`jax.lax.ragged_dot`); the slots are
# un-sorted and each token sums its $k$ outputs, $y_n = \sum_j g_{nj}\, y_{nj}$.
#
# **A grouped matmul** $Y_e = X_e W_e$ is a linear layer per group of rows, so its backward
# is the linear backward per group: $\bar X_e = \bar Y_e W_e^\top$, again a grouped matmul,
# with the weights transposed, and $\bar W_e = X_e^\top \bar Y_e$, the per-group product
# (`ragged_dot_general` contracting the ragged row axis). An expert that receives no rows
# gets $\bar W_e = 0$.

# %%
from jaxformer.model.moe import grouped_matmul
from manual_grads.moe import grouped_matmul_t

show(grouped_matmul_t)
sizes = jnp.array([3, 0, 4, 2])  # rows per expert, in order; expert 1 receives none
w, x, dy = rand(4, 5, 3), rand(9, 5), rand(9, 3)  # w (E, I, O), x (M, I), dy (M, O)


def grouped_fwd(w, x):
    return grouped_matmul(x, w, sizes), (w, x)


def grouped_bwd(res, dy):
    w, x = res
    return grouped_matmul_t(x, dy, sizes), grouped_matmul(dy, jnp.swapaxes(w, 1, 2), sizes)


assert check(grouped_fwd, grouped_bwd, lambda w, x: grouped_matmul(x, w, sizes), (w, x), dy,
             names=("w", "x"))

# %% [markdown]
# **The router** learns only through the gates. Top-k is a selection: its transpose
# scatters the chosen entries' gradients back to their places and leaves zeros
# everywhere else. Mixtral's router (`topk_softmax`) takes the softmax over the $k$ chosen
# logits, $g = \operatorname{softmax}(t)$ with $t, i = \operatorname{topk}(\ell)$, so
#
# $$\bar g_{nj} = \langle \bar y_n, y_{nj}\rangle, \qquad
# \bar t = g \odot \bigl(\bar g - \textstyle\sum_j g_j \bar g_j\bigr), \qquad
# \bar\ell = \operatorname{scatter}_i(\bar t):$$
#
# an expert a token did not choose gets no gradient from that token. OLMoE and Qwen3-MoE
# (`softmax_topk`) take the top $k$ of the full softmax, $g = t$ with $t, i = \operatorname{topk}(P)$;
# the scatter then lands in $\bar P$, and the softmax's backward
# $\bar\ell = P \odot (\bar P - \sum_e P_e \bar P_e)$ spreads it over every logit of the
# row: the experts a token passed over are pushed down. (Qwen3-MoE renormalises,
# $g = t / \sum t$ with `norm_topk_prob`; that cancels the softmax's denominator, so it is
# Mixtral's router again and its $\bar\ell$ is zero off the chosen experts.) Top-k has no derivative where two scores tie, but with random weights a tie has
# probability zero, so the choice is unique and fixed near the point. The layer's whole
# backward (`manual_grads/moe.py` `moe_bwd`: combine, un-sort, the experts' grouped
# matmuls, the router) meets `jax.vjp` of `jaxformer.model.moe.moe` for both routers.

# %%
import dataclasses

from jaxformer.model.config import get_preset
from jaxformer.model.moe import moe
from manual_grads.moe import moe_bwd, moe_fwd, router_bwd

show(router_bwd)
for router in ("topk_softmax", "softmax_topk"):
    print(f"--- {router}")
    config = dataclasses.replace(get_preset("tiny-moe"), router=router, norm_topk_prob=False)
    E, D, F = config.n_experts, config.d_model, config.expert_d_ff
    p = {"router": rand(D, E), "w_gate": rand(E, D, F), "w_up": rand(E, D, F),
         "w_down": rand(E, F, D)}
    x, dy = rand(2, 3, D), rand(2, 3, D)
    moe_pair = lambda p, x: (lambda out: (out[0][0], out[1]))(moe_fwd(p, x, config))  # noqa: E731  y only
    assert check(moe_pair, moe_bwd, lambda p, x: moe(p, x, config)[0], (p, x), dy)
    _, res = moe_fwd(p, x, config)
    dgates = jnp.einsum("nd,nkd->nk", dy.reshape(-1, D), res.y_slots)  # the combine's transpose
    d_logits = np.asarray(router_bwd(res, dgates)[0])  # the first token's row of dlogits
    chosen = sorted(np.asarray(res.idx[0]).tolist())
    print(f"token 0 chose experts {chosen} of {E}; its dlogits: "
          f"{np.array2string(d_logits, precision=4, floatmode='fixed', sign=' ')}")
    if router == "topk_softmax":  # the experts it did not choose get exactly zero
        assert np.all(np.delete(d_logits, chosen) == 0)
    else:  # through the full softmax every expert's logit moves
        assert np.all(d_logits != 0)

# %% [markdown]
# ## The whole model
#
# `manual_grads.value_and_grad` runs the forward keeping each layer's residuals,
# then the backwards in reverse order: loss, head, final layer norm, the blocks (a
# reverse `lax.scan`; inside a block the residual connections add their gradients),
# the embeddings. Here it meets `jax.value_and_grad(jaxformer.loss_fn)` on a batch of
# the embedded corpus, for every leaf of the parameter tree (the per-layer leaves are
# stacked over the layers, so `blocks.attn.wq` holds both layers' $W_q$). Two presets:
# `tiny`, GPT-2's block (layer norm, learned positions, GELU, biases), and `llama-tiny`,
# the modern one (RMS norm, rotary positions, SwiGLU, QK-norm, 4 query heads over 2
# key/value heads, no biases).

# %%
import manual_grads
from jaxformer import data, init_params, loss_fn
from jaxformer.model.config import get_preset

ids = data.ByteTokenizer().encode(data.load_corpus("default"))
batch = {k: jnp.asarray(v) for k, v in data.Batcher(ids, 4, 16, seed=0).batch(0).items()}
order = ["tok_embed", "pos_embed", "blocks", "ln1", "attn", "ln2", "ffn", "ln_f", "head"]
for preset in ("tiny", "llama-tiny"):
    print(f"--- {preset}")
    config = get_preset(preset)
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), config, jnp.float64)
    manual = jax.jit(lambda p, b: manual_grads.value_and_grad(p, b, config))
    auto = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, config)))
    (loss_m, grads_m), (loss_a, grads_a) = manual(params, batch), auto(params, batch)
    print(f"loss: by hand {float(loss_m):.10f}, jax.grad {float(loss_a):.10f}")
    ok = cmp(f"{'loss':<24}", loss_m, loss_a)
    leaves = {".".join(k.key for k in path): (g_m, g_a) for (path, g_m), g_a in zip(
        jax.tree_util.tree_flatten_with_path(grads_m)[0], jax.tree_util.tree_leaves(grads_a))}
    for path in sorted(leaves, key=lambda path: [(order.index(k) if k in order else 99, k)
                                                 for k in path.split(".")]):  # the model's order
        ok &= cmp(f"{path:<24}", *leaves[path])
    assert ok

# %% [markdown]
# ## Try this
#
# Break a backward on purpose and watch the check catch it. The most common mistake in
# a hand-written softmax backward is to treat it as elementwise, $\bar S = P \odot \bar P$,
# forgetting that every score moves every probability of its row. Edit the line below
# (or `linear_bwd` above, say $\bar x = \bar y\,W$ instead of $\bar y\,W^\top$ on a square
# $W$) and run the cell.

# %%
naive_softmax_bwd = lambda P, dP: P * dP  # noqa: E731  the row-sum term is missing
assert not check(lambda s: (softmax(s), softmax(s)), lambda P, dP: (naive_softmax_bwd(P, dP),),
                 softmax, (rand(2, 4, 4),), rand(2, 4, 4), names=("s",))
