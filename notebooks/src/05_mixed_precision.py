# Cells of notebooks/05_mixed_precision.ipynb; rebuild with
# `python notebooks/build_notebooks.py --execute 05` after editing.

# %% [markdown]
# # Mixed precision: where bfloat16 rounding enters
#
# With `ModelConfig(compute_dtype="bfloat16")` the parameters stay float32 (the master
# copy the optimizer updates) but every matrix product reads its two inputs rounded to
# bfloat16, and accumulates and returns in float32. Where only elementwise work and
# another product read a product's result (the q/k/v and feed-forward input projections),
# that result is rounded to bfloat16 too, as PyTorch's autocast returns it. Everything
# else stays in float32: the residual stream, biases, layer-norm statistics, softmax,
# activations, log-sum-exp and the cross entropy. Both gradient sources follow the same
# policy: `jax.grad` of the configured model, and the hand-derived backward, whose every
# product (dW = x^T dy, dx = dy W^T, ...) also rounds its inputs to bfloat16, and which
# returns dx, the cotangent of a bfloat16 input, in bfloat16 as `jax.grad` does.
#
# bfloat16 keeps float32's 8-bit exponent (the same range) but only 8 bits of
# significand (float32 has 24), so one rounding moves a number by up to $2^{-8}$
# relative: about 0.4%.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

# Every program here runs once: compile it fast rather than make it run fast.
jax.config.update("jax_disable_most_optimizations", True)

import manual_grads
from jaxformer import data, init_params, loss_fn
from jaxformer.model.config import get_preset
from jaxformer.model.precision import matmul

x = jnp.float32(1 / 3)
print(f"1/3 in float32  {float(x):.10f}")
print(f"1/3 in bfloat16 {float(x.astype(jnp.bfloat16)):.10f}   relative error "
      f"{abs(float(x.astype(jnp.bfloat16)) - float(x)) / float(x):.1e}")
print(f"machine epsilon: float32 {float(jnp.finfo(jnp.float32).eps):.1e}, "
      f"bfloat16 {float(jnp.finfo(jnp.bfloat16).eps):.1e}")

rng = np.random.default_rng(0)
a = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
b = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
for name, product in (("float32", matmul(a, b)), ("bfloat16 inputs", matmul(a, b, "bfloat16"))):
    err = np.linalg.norm(np.asarray(product, np.float64) - exact) / np.linalg.norm(exact)
    print(f"64x256 @ 256x64, {name:<16} -> {product.dtype}, relative error {err:.1e}")

# %% [markdown]
# The product with bfloat16 inputs is off by about 0.2%: each input entry moves by up to
# $2^{-8}$ of itself when rounded (0.16% on average, root mean square), the two inputs'
# errors add up, and accumulating the length-256 sums in float32 adds almost nothing
# (the float32 product alone is off by 3e-7).
#
# ## Where the roundings are
#
# Every product of the model is a `dot_general` in its jaxpr, JAX's program before
# compilation. Listing them with their input and output types shows where bfloat16
# enters: in the forward (`loss_fn`), and in the hand-derived forward + backward
# (`manual_grads.value_and_grad`). The forward's per-layer products appear once each,
# inside the `scan` over the layers; the hand-derived pass writes its two layers out one
# after the other (a model of at most four layers is unrolled, not scanned), so each
# layer's products appear there twice.

# %%
tokenizer = data.ByteTokenizer()
ids = tokenizer.encode(data.load_corpus("default"))
batch = {k: jnp.asarray(v) for k, v in data.Batcher(ids, 4, 32, seed=0).batch(0).items()}
config = get_preset("loopos", vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_layers=2,
                    d_ff=256, max_seq_len=32)
mixed = config.replace(compute_dtype="bfloat16")
params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), config, jnp.float32)


def products(jaxpr):
    """Every dot_general of a jaxpr, inside scans and jits too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from products(getattr(sub, "jaxpr", sub))


def describe(eqn):
    a, b = (v.aval.str_short() for v in eqn.invars)
    return f"{a:>16} @ {b:<16} -> {eqn.outvars[0].aval.str_short()}"


forward = jax.make_jaxpr(lambda p: loss_fn(p, batch, mixed))(params)
both = jax.make_jaxpr(lambda p: manual_grads.value_and_grad(p, batch, mixed))(params)
print("forward (loss_fn), B=4 T=32 D=64 H=4 F=256 V=256:")
for eqn in products(forward.jaxpr):
    print("  " + describe(eqn))
eqns = list(products(both.jaxpr))
print(f"\nhand-derived forward + backward: {len(eqns)} products, input dtypes "
      f"{sorted({str(v.aval.dtype) for e in eqns for v in e.invars})}, output dtypes "
      f"{sorted({str(e.outvars[0].aval.dtype) for e in eqns})}; the backward's:")
for eqn in eqns[len(list(products(forward.jaxpr))):]:
    print("  " + describe(eqn))

# %% [markdown]
# Forward: q|k|v in one product, the scores $QK^\top$, $PV$, the output projection, the
# feed-forward's two, and the head. Backward: two products for each forward product of
# a weight ($\bar W = x^\top \bar y$ and $\bar x = \bar y W^\top$), and four for the two
# products inside attention ($\bar P$, $\bar V$, $\bar Q$, $\bar K$). All read bfloat16,
# all write float32 (a cast after some rounds the result: the input projections', dx).
#
# ## How far the gradients move
#
# The reference: `jax.grad` of the same float32 parameters with no compute dtype. Against
# it, each source's bfloat16 gradient, leaf by leaf, as a relative error
# $\lVert g - g_\text{ref}\rVert / \max(\lVert g_\text{ref}\rVert, 10^{-4}\,\lVert\text{all of } g_\text{ref}\rVert)$
# (the floor keeps a leaf whose true gradient is near zero, the attention key bias, from
# being judged against zero; `manual_grads.check.compare_trees` computes the same).

# %%
auto_vg = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)
manual_vg = jax.jit(manual_grads.value_and_grad, static_argnums=2)
loss_ref, ref = auto_vg(params, batch, config)
loss_auto, grads_auto = auto_vg(params, batch, mixed)
loss_manual, grads_manual = manual_vg(params, batch, mixed)
print(f"loss: float32 {float(loss_ref):.5f}, bfloat16 autodiff {float(loss_auto):.5f}, "
      f"bfloat16 manual {float(loss_manual):.5f}")


def flat(tree):
    return {".".join(k.key for k in path): np.asarray(leaf, np.float64)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def rel_errors(ref, got):
    ref, got = flat(ref), flat(got)
    floor = 1e-4 * np.sqrt(sum(np.sum(r * r) for r in ref.values()))
    return {k: np.linalg.norm(got[k] - r) / max(np.linalg.norm(r), floor) for k, r in ref.items()}


err_auto, err_manual = rel_errors(ref, grads_auto), rel_errors(ref, grads_manual)
print(f"\n{'leaf':<18} {'autodiff':>9} {'manual':>9} {'manual / autodiff':>18}")
for leaf in err_auto:
    print(f"{leaf:<18} {err_auto[leaf]:>9.1e} {err_manual[leaf]:>9.1e} "
          f"{err_manual[leaf] / err_auto[leaf]:>18.2f}")

# %%
leaves = list(err_auto)
pos = np.arange(len(leaves))
fig, ax = plt.subplots(figsize=(11, 4.2))
ax.bar(pos - 0.2, [err_auto[k] for k in leaves], 0.4, label="jax.grad, bfloat16 products")
ax.bar(pos + 0.2, [err_manual[k] for k in leaves], 0.4, label="manual, bfloat16 products")
ax.axhline(2.0 ** -8, color="gray", ls=":", lw=1)
ax.text(len(leaves) - 0.5, 2.0 ** -8, "one bfloat16 rounding, $2^{-8}$", ha="right", va="bottom",
        color="gray")
ax.set_xticks(pos, leaves, rotation=60, ha="right")
ax.set(yscale="log", ylabel="relative error vs float32 reference",
       title="per-leaf gradient error under compute_dtype='bfloat16'")
ax.set_ylim(top=0.05)
ax.legend(loc="upper left", ncols=2)
ax.grid(alpha=0.3, axis="y")
plt.tight_layout()
plt.show()
assert all(err_manual[k] <= 2 * max(err_auto[k], 2.0 ** -11) for k in leaves)

# %% [markdown]
# Every leaf's gradient moves by about one bfloat16 rounding (0.2% to 0.6%; the head's
# bias, a sum of softmax probabilities minus one-hot targets, hardly moves), and the
# hand-derived backward lands as close to the float32 reference as `jax.grad` does: the
# two make the same roundings, on the same products, though not always of the same
# numbers (autodiff transposes the forward's products where the manual backward writes
# its own), so the errors agree in size rather than in every digit. `jaxformer
# compare-grads --compute-dtype bfloat16` applies this test to every leaf: the manual
# error may be at most twice autodiff's (or twice a floor of $2^{-11}$).
#
# ## Try this
#
# The same comparison with `compute_dtype="float32"`: products in float32, as without a
# compute dtype. The errors fall to float32's round-off, thousands of times smaller
# (change it to `"bfloat16"` on a longer sequence, or a wider model, and see whether the
# error grows with the length of the sums).

# %%
err = rel_errors(ref, manual_vg(params, batch, config.replace(compute_dtype="float32"))[1])
worst32, worst16 = max(err.values()), max(err_manual.values())
print(f"worst leaf, float32 products:  about 1e{np.floor(np.log10(worst32)):.0f}")
times = 10 ** np.floor(np.log10(worst16 / worst32))
print(f"worst leaf, bfloat16 products: {worst16:.1e}, over {times:,.0f} times larger")
