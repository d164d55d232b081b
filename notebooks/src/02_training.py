# Cells of notebooks/02_training.ipynb; rebuild with
# `python notebooks/build_notebooks.py --execute 02` after editing.

# %% [markdown]
# # Training with manual and automatic gradients
#
# A gradient source is any function `(params, batch, key=None) -> (loss, grads)` (the key: dropout's).
# `jaxformer.training.step.make_train_step(grad_fn, optimizer)` turns either source into the
# same jitted optax step, so training from the same seed on the same batches must give the
# same loss curve, to round-off. Here a small model learns the embedded corpus byte by
# byte, once with each source, and then writes some text.
#
# It trains in float64 so that "the same to round-off" is plain to see. In float32 the two
# curves also start equal to about 1e-7, but training amplifies such differences step
# after step (as it would any change of summation order), so after a few hundred steps
# they differ in the third decimal while telling the same story.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from jaxformer import count_params, data, init_params
from jaxformer.model.config import get_preset
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_eval_step, make_train_step

STEPS, BATCH, SEQ = 150, 16, 32

tokenizer = data.ByteTokenizer()
ids = tokenizer.encode(data.load_corpus("default"))
train_ids, val_ids = data.split_train_val(ids, 0.1)
batcher = data.Batcher(train_ids, BATCH, SEQ, seed=0)
val_batches = list(data.sequential_batches(val_ids, BATCH, SEQ, max_batches=4))

config = get_preset("tiny", vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4,
                    d_ff=128, max_seq_len=SEQ)
# one set of initial parameters for both runs, kept on the host (a train step donates
# its input buffers, so each run gets its own device copy)
init = jax.jit(init_params, static_argnums=(1, 2))  # one compiled call instead of many small ones
params0 = jax.tree_util.tree_map(np.array, init(jax.random.PRNGKey(0), config, jnp.float64))
print(config)
print(f"{count_params(params0):,} parameters, {len(train_ids):,} training bytes")

# %% [markdown]
# Both runs start from the same parameters and see the same batches; only the gradient
# source differs.

# %%
def train(kind):
    optimizer = make_optimizer("adam", lr=1e-2, schedule="cosine", warmup_steps=10,
                               total_steps=STEPS, clip_norm=1.0)
    state = init_state(jax.tree_util.tree_map(jnp.array, params0), optimizer)  # a copy
    step = make_train_step(grad_source(kind, config), optimizer)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, batcher.batch(i))
        losses.append(metrics["loss"])
    losses = np.array(jax.device_get(losses))  # one transfer at the end, not one per step
    print(f"{kind:<6} {STEPS} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return state.params, losses


params_manual, losses_manual = train("manual")
params_auto, losses_auto = train("auto")

# %%
evaluate = make_eval_step(config)
for name, params in (("manual", params_manual), ("auto", params_auto)):
    val = np.mean([float(evaluate(params, b)) for b in val_batches])
    print(f"{name:<6} validation loss {val:.4f}")
diff = np.abs(losses_manual - losses_auto)
print(f"max |loss manual - loss auto| over {STEPS} steps: {diff.max():.2e}")

fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(11, 4))
ax.plot(losses_manual, label="manual gradients", lw=2)
ax.plot(losses_auto, "--", label="jax.grad", lw=1.5)
ax.set(xlabel="step", ylabel="cross entropy (nats / byte)", title="training loss")
ax.legend()
ax.grid(alpha=0.3)
ax_diff.semilogy(np.maximum(diff, 1e-17))
ax_diff.set(xlabel="step", ylabel="|difference|", title="manual - automatic (float64)")
ax_diff.grid(alpha=0.3)
plt.show()
assert diff.max() < 1e-9, "the two gradient sources should give the same curve"

# %% [markdown]
# The curves lie on top of each other: what differs is float64 round-off.
#
# ## Sampling
#
# `jaxformer.inference.generate.generate` runs the model autoregressively (one jitted
# loop), drawing each byte from the softmax of its logits at a temperature.

# %%
from jaxformer.inference.generate import generate

prompt = "The "
out = generate(params_manual, config, tokenizer.encode(prompt), 200, temperature=0.8, seed=0)
print(tokenizer.decode(out))

# %% [markdown]
# ## Try this
#
# The temperature divides the logits before the softmax: near 0 the model always picks
# its most likely byte (and soon repeats itself), at 1 it samples its own distribution,
# above 1 it flattens it towards noise. Change the temperatures (or the prompt, or the
# seed) and run the cell; for a better writer, raise `STEPS` at the top and rerun all.

# %%
for temperature in (0.3, 1.5):
    out = generate(params_manual, config, tokenizer.encode(prompt), 200,
                   temperature=temperature, seed=0)
    print(f"--- temperature {temperature}\n{tokenizer.decode(out)}")
