# Cells of notebooks/04_memory_and_recompute.ipynb; rebuild with
# `python notebooks/build_notebooks.py --execute 04` after editing.

# %% [markdown]
# # What each backward keeps: memory and recompute
#
# A backward pass needs, for every layer, what its forward saw: the residuals. How much
# of that is kept, and how much is recomputed instead, decides the memory of a training
# step. jaxformer's hand-derived backward has three options that trade compute for
# memory, each a `ModelConfig` field that `jax.grad` of the configured model honours too:
#
# | option | the forward keeps | the backward recomputes |
# |---|---|---|
# | plain | q, k, v and the probabilities P (B, H, T, T) of every layer; the softmax (B, T, V) of the loss | nothing |
# | `attention_impl="blockwise"` | q, k, v, the output O and one log-sum-exp per row (B, H, T) | each block of P, from its scores and the log-sum-exp |
# | `loss_chunk=C` | the head's input (B, T, D) and one log-sum-exp per position | each chunk of C positions' logits |
# | `remat="block"` | each block's input (L, B, T, D) | the whole block's forward, inside the backward |
#
# The memory figures here are XLA's own plan for each compiled gradient, read without
# running it: `jax.jit(f).lower(params, batch).compile().memory_analysis()`, whose
# `temp_size_in_bytes` counts the scratch buffers the program needs alive at once
# (`jaxformer.tools.memory` and `experiments/memory.py` do the same at a larger size).

# %%
import time

import jax
import matplotlib.pyplot as plt
import numpy as np

import manual_grads
from jaxformer import loss_fn
from jaxformer.tools import memory

B, LENGTHS = 2, (128, 512)  # batch, and two lengths 4x apart
# 2 blocks of width 64, 4 heads, float32; a vocabulary of 2048 so that the loss's
# (B, T, V) arrays matter next to attention's (B, H, T, T)
config = memory.memory_config(seq_len=max(LENGTHS), d_model=64, n_heads=4, n_layers=2,
                              vocab_size=2048, attention_block=32)

# each backward adds one option to the one before
SOURCES = {
    "autodiff (jax.grad)": ("auto", {}),
    "manual": ("manual", {}),
    "+ blockwise attention": ("manual", dict(attention_impl="blockwise")),
    "+ chunked loss": ("manual", dict(attention_impl="blockwise", loss_chunk=64)),
    "+ recompute (all three)": ("manual", dict(attention_impl="blockwise", loss_chunk=64,
                                               remat="block")),
}


def gradient(kind, cfg):
    """(params, batch) -> (loss, grads)."""
    if kind == "auto":
        return jax.value_and_grad(lambda params, batch: loss_fn(params, batch, cfg))
    return lambda params, batch: manual_grads.value_and_grad(params, batch, cfg)


print(config)

# %% [markdown]
# One compilation per backward and length, from shapes alone (`memory.abstract_inputs`
# gives `ShapeDtypeStruct`s: nothing is allocated). The memory plan comes from XLA's
# graph passes (fusion, buffer assignment); the machine-code optimisation that follows
# changes no buffer, so the longer length skips it (`FAST`) and compiles in half the
# time. The shorter one, timed below, gets a fully optimised compilation; its plan would
# be the same either way.

# %%
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
TIMED = LENGTHS[0]  # the length the step time is measured at

temp, compiled = {}, {}
for name, (kind, options) in SOURCES.items():
    cfg = config.replace(**options)
    for T in LENGTHS:
        lowered = jax.jit(gradient(kind, cfg)).lower(*memory.abstract_inputs(cfg, B, T))
        exe = lowered.compile() if T == TIMED else lowered.compile(FAST)
        temp[name, T] = exe.memory_analysis().temp_size_in_bytes
        if T == TIMED:
            compiled[name] = exe

mib = lambda n: n / 2**20  # noqa: E731
print(f"XLA temp memory of one gradient, MiB (B={B}, float32)")
print(f"{'':<24}" + "".join(f"{f'T={T}':>9}" for T in LENGTHS) + f"{'growth per 2x T':>17}")
for name in SOURCES:
    row = [temp[name, T] for T in LENGTHS]
    growth = (row[-1] / row[0]) ** (1 / np.log2(LENGTHS[-1] / LENGTHS[0]))
    print(f"{name:<24}" + "".join(f"{mib(t):>9.2f}" for t in row) + f"{growth:>16.2f}x")

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
for name, marker in zip(SOURCES, "osD^v"):
    ax.plot(LENGTHS, [mib(temp[name, T]) for T in LENGTHS], marker=marker, label=name)
T0, y0 = LENGTHS[0], mib(temp["autodiff (jax.grad)", LENGTHS[0]])
for power, style in ((1, ":"), (2, "--")):  # guides through autodiff's first point
    ax.plot(LENGTHS, [y0 * (T / T0) ** power for T in LENGTHS], style, color="gray", lw=1)
    ax.text(LENGTHS[-1], y0 * (LENGTHS[-1] / T0) ** power, f" ∝ T{'²' if power == 2 else ''}",
            va="center", color="gray")
ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="XLA temp memory (MiB)",
       title=f"what one gradient needs at once (B={B}, D=64, 2 layers, V=2048)")
ax.set_xlim(110, 720)
ax.minorticks_off()
ax.set_xticks(LENGTHS, [str(T) for T in LENGTHS])
ax.set_yticks([2, 5, 10, 20, 50, 100], ["2", "5", "10", "20", "50", "100"])
ax.legend()
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# Read the growth column. The plain backwards grow faster than T (2.3x and 2.8x per
# doubling here, on their way to 4x as the (T, T) probabilities take over from the
# (T, D) and (T, V) activations); with blockwise attention the growth is 2x: linear in
# T. The manual backward already keeps less than autodiff: it saves exactly the
# residuals its formulas read, where autodiff keeps what its transposition rules ask
# for. Then each option removes its own term: blockwise attention the probabilities,
# the chunked loss the (B, T, V) arrays of the loss (large here: V = 2048), and
# recompute every block's inner activations, at the price of running each block's
# forward twice.
#
# ## What it costs in time
#
# The same compiled gradients at T = 128 on real (random) inputs: the median of 5
# interleaved calls after a warm-up, as a ratio to the plain manual backward, rounded to
# the nearest half. Times on a shared CPU move from run to run, so this cell is tagged
# "nondeterministic": its output is saved but not compared by the test that checks the
# notebooks are up to date.

# %% tags=["nondeterministic"]
params, batch = memory.random_inputs(config, B, TIMED)
seconds = {name: [] for name in compiled}
for r in range(6):
    for name, exe in compiled.items():
        t0 = time.perf_counter()
        jax.block_until_ready(exe(params, batch))
        if r:  # the first round warms up
            seconds[name].append(time.perf_counter() - t0)
base = np.median(seconds["manual"])
print(f"{'':<24} {'step time / manual':>18} {'temp memory / manual':>21}")
for name in compiled:
    ratio = round(2 * np.median(seconds[name]) / base) / 2  # to the nearest half
    print(f"{name:<24} {ratio:>17.1f}x {temp[name, TIMED] / temp['manual', TIMED]:>20.2f}x")

# %% [markdown]
# ## Try this
#
# Check the table against the sizes of the arrays each option removes: the probabilities
# P of every layer (B, H, T, T), and one (B, T, V) array of the loss. Blockwise attention
# saves about the probabilities; the chunked loss saves more than two (B, T, V) arrays,
# because without chunks the logits, their softmax and the gradient of the logits each
# exist whole, and the plan's peak holds more than one of them. Change the shape in the
# first code cell (`vocab_size`, `n_layers`, `LENGTHS`) and run the notebook again.

# %%
for T in LENGTHS:
    probs = config.n_layers * B * config.n_heads * T * T * 4  # bytes, float32
    loss_array = B * T * config.vocab_size * 4
    saved_blockwise = temp["manual", T] - temp["+ blockwise attention", T]
    saved_chunks = temp["+ blockwise attention", T] - temp["+ chunked loss", T]
    print(f"T={T}: blockwise saves {mib(saved_blockwise):5.2f} MiB, P of all layers is "
          f"{mib(probs):5.2f}; the chunked loss saves {mib(saved_chunks):5.2f} MiB, "
          f"{saved_chunks / loss_array:.1f} arrays of (B, T, V)")
