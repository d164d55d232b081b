# Cells of notebooks/03_the_seed_story.ipynb; rebuild with
# `python notebooks/build_notebooks.py --execute 03` after editing.

# %% [markdown]
# # The seed story: how far back the gradient goes
#
# The systems jaxformer grew from learned in stages. The very first trained with
# backpropagation switched off; the first that worked let the gradient reach only the
# embeddings and the output layer (the head); the next let it reach the feed-forward
# layers too; the last backpropagated through everything: attention, layer norms and
# residual connections.
#
# Here the four scopes train side by side: the same model, the same initial parameters,
# the same batches, the same budget, all with the hand-derived gradients. The gradient is
# always the whole model's exact one; a scope only decides which parts of it are *applied*.
# That is one optax transformation, `optax.multi_transform`, which sends every parameter
# leaf to the transformation its label names: "learn" (clip, then Adam) or "frozen"
# (`set_to_zero`). Weight decay then applies to every leaf, so a frozen leaf only shrinks,
# by a factor (1 - lr * wd) per step. (`experiments/reproduce_seeds.py` runs the same
# recipe on the full-size `loopos` model, with SGD and Adam, and with `jax.grad` too.)

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import manual_grads
from jaxformer import count_params, data, init_params, loss_fn
from jaxformer.model.config import get_preset

STEPS, BATCH, SEQ, LR = 200, 16, 32, 3e-3

tokenizer = data.ByteTokenizer()
ids = tokenizer.encode(data.load_corpus("default"))
train_ids, val_ids = data.split_train_val(ids, 0.1)
batcher = data.Batcher(train_ids, BATCH, SEQ, seed=0)  # batch i is a pure function of (seed, i)
val_batch = {k: jnp.asarray(np.concatenate([b[k] for b in data.sequential_batches(
    val_ids, BATCH, SEQ, max_batches=8)])) for k in ("inputs", "targets")}

# loopos's shape (pre-LN, GELU, learned positions), smaller: 2 blocks of width 32
config = get_preset("loopos", vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=2,
                    d_ff=128, max_seq_len=SEQ)
params0 = jax.tree_util.tree_map(np.array, jax.jit(init_params, static_argnums=(1, 2))(
    jax.random.PRNGKey(0), config, jnp.float32))  # host copies: each run makes its own device copy
print(f"{count_params(params0):,} parameters; {STEPS} steps of {BATCH} x {SEQ} bytes; "
      f"validation on {val_batch['inputs'].size:,} bytes")

# %% [markdown]
# ## What learns in each scope
#
# A scope is the set of parameter names that learn (`blocks.ffn` names a sub-layer of
# every block); `labels` turns it into the tree of "learn" / "frozen" labels that
# `optax.multi_transform` reads.

# %%
SCOPES = {
    "no backprop": set(),
    "embedding + head": {"tok_embed", "pos_embed", "head"},
    "+ feed-forward": {"tok_embed", "pos_embed", "head", "blocks.ffn"},
    "full backprop": None,  # everything
}


def labels(params, scope):
    """"learn" or "frozen" at every leaf of params."""
    def label(path, _):
        names = [k.key for k in path]  # e.g. ["blocks", "ffn", "w_in"]
        learns = scope is None or names[0] in scope or ".".join(names[:2]) in scope
        return "learn" if learns else "frozen"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(params, scope, lr=LR, clip=5.0, weight_decay=0.01):
    return optax.chain(
        optax.multi_transform({"learn": optax.chain(optax.clip(clip), optax.scale_by_adam()),
                               "frozen": optax.set_to_zero()}, labels(params, scope)),
        optax.add_decayed_weights(weight_decay),  # every leaf, learning or not
        optax.scale_by_learning_rate(lr),
    )


GROUPS = ["tok_embed", "pos_embed", "blocks.ln1", "blocks.attn", "blocks.ln2", "blocks.ffn",
          "ln_f", "head"]


def subtree(tree, group):
    """The part of a params-shaped tree a group names, e.g. "blocks.ffn"."""
    for key in group.split("."):
        tree = tree[key]
    return tree


tables = {name: labels(params0, scope) for name, scope in SCOPES.items()}
print(f"{'':<12}" + "".join(f"{name:>18}" for name in SCOPES))
for group in GROUPS:  # all leaves of a group share its label
    print(f"{group:<12}" + "".join(f"{jax.tree_util.tree_leaves(subtree(t, group))[0]:>18}"
                                  for t in tables.values()))

# %% [markdown]
# ## Training the four side by side
#
# The gradient is compiled once and shared: it does not depend on the scope. Each scope
# compiles only its small optimizer update. (`jaxformer.training.step.make_train_step`
# would compile gradient and update together, once per scope; here that would be four
# compilations of the same backward.)

# %%
value_and_grad = jax.jit(lambda params, batch: manual_grads.value_and_grad(params, batch, config))
evaluate = jax.jit(lambda params: loss_fn(params, val_batch, config))


def train(scope):
    params = jax.tree_util.tree_map(jnp.array, params0)  # a copy
    optimizer = make_optimizer(params, scope)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state, losses = optimizer.init(params), []
    for i in range(STEPS):
        loss, grads = value_and_grad(params, batcher.batch(i))
        params, opt_state = update(params, opt_state, grads)
        losses.append(loss)
    return params, np.array(jax.device_get(losses)), update


val_first = float(evaluate(params0))
runs = {name: train(scope) for name, scope in SCOPES.items()}
print(f"{'scope':<18} {'train, last 20 steps':>21} {'validation':>11}")
print(f"{'(before training)':<18} {'':>21} {val_first:>11.3f}")
for name, (params, losses, _) in runs.items():
    print(f"{name:<18} {losses[-20:].mean():>21.3f} {float(evaluate(params)):>11.3f}")

# %%
def smooth(y, k=20):
    """Running mean over the last k values (fewer at the start)."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    i = np.arange(1, len(y) + 1)
    return (c[i] - c[np.maximum(i - k, 0)]) / np.minimum(i, k)


fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.2))
colors = plt.cm.viridis([0.85, 0.6, 0.35, 0.05])
for (name, (params, losses, _)), color in zip(runs.items(), colors):
    ax.plot(losses, color=color, alpha=0.25, lw=0.8)
    ax.plot(smooth(losses), color=color, lw=2, label=name)
    zoom.plot(np.arange(STEPS // 2, STEPS), smooth(losses)[STEPS // 2:], color=color, lw=2)
    zoom.plot(STEPS, float(evaluate(params)), "o", color=color, ms=7)
ax.axhline(np.log(256), color="gray", ls=":", lw=1)
ax.text(STEPS, np.log(256), "uniform guess, ln 256 ", ha="right", va="top", color="gray")
ax.set(xlabel="step", ylabel="cross entropy (nats / byte)", ylim=(2.0, 5.8),
       title="training loss: raw (faint), mean of the last 20 steps")
ax.legend()
zoom.set(xlabel="step", ylim=(2.3, 2.75), title="second half, mean of the last 20 steps; "
         "dots: validation")
for a in (ax, zoom):
    a.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# Without backpropagation nothing learns: the loss stays at that of the random
# initialisation, a little above the uniform guess. With the gradient applied to the
# embeddings and the head the model quickly learns which byte tends to follow which; the
# frozen random blocks still mix some context in, but nothing tunes them. Letting the
# feed-forward layers learn too does not help within this budget (it even ends a little
# higher), while full backpropagation, which also tunes attention (where to look) and
# the layer norms, pulls ahead once the easy statistics are learned, and keeps going.
#
# ## What NaNs did to the first system
#
# A non-finite value anywhere in the forward poisons everything after it: the loss, then
# every gradient, then, after one optimizer step, every parameter that learns. Put one
# infinity into a weight the first working system never trained (block 1's feed-forward
# input projection, frozen in the "embedding + head" scope) and take one more step:

# %%
params, _, update = runs["embedding + head"]
bad = jax.tree_util.tree_map(np.array, jax.device_get(params))  # writable host copies
bad["blocks"]["ffn"]["w_in"][1, 0, 0] = np.inf
batch = batcher.batch(STEPS)
optimizer = make_optimizer(bad, SCOPES["embedding + head"])
loss, grads = value_and_grad(bad, batch)
after, _ = update(jax.tree_util.tree_map(jnp.asarray, bad), optimizer.init(bad), grads)
print(f"loss {float(loss)}")
learning = labels(after, SCOPES["embedding + head"])
print(f"{'':<12} {'label':<7} non-finite entries after one step")
for group in GROUPS:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(subtree(after, group))]
    n_bad = sum(int((~np.isfinite(x)).sum()) for x in leaves)
    label = jax.tree_util.tree_leaves(subtree(learning, group))[0]
    print(f"{group:<12} {label:<7} {n_bad:>6,} of {sum(x.size for x in leaves):,}")

# %% [markdown]
# The frozen layers keep their values (their update is zero, and the decay of a finite
# value is finite; only the poisoned weight itself stays infinite), but what learns is
# wrecked: the head and the position table entirely, and the embedding of every byte
# that occurs in the batch (a byte absent from it gets a zero gradient, and Adam a zero
# update).
#
# Where did it start? `jaxformer.training.diagnose.diagnose_batch(params, batch, config)`
# runs the batch eagerly through the hand-derived forward and backward, one layer at a
# time, and records each stage's value range and gradient norm. `.table()` lists them;
# `.first` names the first non-finite value. (The training loop calls it by itself when a
# step goes non-finite: it replays the run from its last healthy checkpoint.)

# %%
from jaxformer.training.diagnose import diagnose_batch

# The diagnosis runs op by op, and each op's small program runs once: compile them fast.
jax.config.update("jax_disable_most_optimizations", True)
diagnosis = diagnose_batch(bad, batch, config)
print(diagnosis.table())
print()
print(diagnosis.first)

# %% [markdown]
# Everything up to block 1's layer norm is finite and in range; block 1's feed-forward
# output is the first non-finite value, and the diagnosis says why: its input is fine,
# its parameter `w_in` holds the infinity. Every stage after it, and every gradient
# (the backward runs from the loss down), is NaN.
#
# ## Try this
#
# - Give the runs a longer budget (`STEPS = 600` in the first cell, about three times the
#   training time) and see how far full backpropagation pulls ahead, and whether the
#   feed-forward scope ever overtakes "embedding + head".
# - Put the bad value elsewhere (a NaN in the head, an infinity in a layer-norm scale,
#   one in the embedding row of a byte the batch does not use) and see what the
#   diagnosis names. Edit the cell below and run it.

# %%
bad = jax.tree_util.tree_map(np.array, jax.device_get(params))
bad["blocks"]["attn"]["wq"][0, 3, 1] = np.nan  # block 0's query projection, one entry
print(diagnose_batch(bad, batch, config).first)
