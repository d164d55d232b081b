"""Write the notebooks of this folder from the cells below (run it after editing them).

    python notebooks/build_notebooks.py

The .ipynb files are written without outputs; tests/test_notebooks.py executes them.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# ----------------------------------------------------------------------------
# 01: backprop by hand

BACKPROP = [
    md(r"""
# Backpropagation by hand

Every layer of jaxformer has a forward in `jaxformer/model/` and, in `manual_grads/`,
a pair `y, res = layer_fwd(p, x)` / `dp, dx = layer_bwd(res, dy)` written out by hand.
This notebook derives each backward in a few lines, shows its code, and compares it with
`jax.vjp` of the jaxformer layer in float64. At the end the whole model's hand-derived
gradient is compared with `jax.grad`, leaf by leaf.

Notation: $\bar y = \partial L / \partial y$ is the gradient flowing back into $y$
(the cotangent `dy`); sums run over every leading (batch and time) index.
"""),
    code(r"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)  # compare in float64: round-off ~1e-16

from jaxformer.model.activations import activation
from jaxformer.model.attention import attention
from jaxformer.model.embedding import token_embedding
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy

rng = np.random.default_rng(0)
rand = lambda *shape: jnp.asarray(rng.standard_normal(shape))  # noqa: E731  float64 test data


def max_err(manual, auto):
    # largest absolute difference over every leaf of two pytrees
    diffs = jax.tree_util.tree_map(lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))),
                                   manual, auto)
    return float(max(jax.tree_util.tree_leaves(diffs)))


def check(manual_fwd, manual_bwd, layer, primals, dy):
    # The manual pair against jax.vjp of the jaxformer layer, both in one jitted call.
    # manual_bwd returns one gradient per differentiable input, like vjp.
    @jax.jit
    def both(primals, dy):
        y, res = manual_fwd(*primals)
        y_ref, vjp = jax.vjp(layer, *primals)
        return (y, manual_bwd(res, dy)), (y_ref, vjp(dy))

    (y, grads), (y_ref, grads_ref) = both(primals, dy)
    print(f"forward  max error {max_err(y, y_ref):.1e}")
    print(f"backward max error {max_err(grads, grads_ref):.1e}")


def show(fn):
    print(inspect.getsource(fn))
"""),
    md(r"""
## Linear: $y = x W + b$

With $x$ of shape $(N, I)$, $W$ $(I, O)$, $b$ $(O,)$ and $\bar y$ $(N, O)$:

$$\bar W = x^\top \bar y, \qquad \bar b = \textstyle\sum_n \bar y_n, \qquad \bar x = \bar y\, W^\top.$$
"""),
    code(r"""
from manual_grads.linear import linear_bwd, linear_fwd

show(linear_bwd)
p = {"w": rand(5, 3), "b": rand(3)}
x, dy = rand(2, 4, 5), rand(2, 4, 3)  # (B, T, I) and (B, T, O)
check(linear_fwd, linear_bwd, lambda p, x: linear(x, p["w"], p["b"]), (p, x), dy)
"""),
    md(r"""
## Activations

Elementwise, so $\bar x = \bar y \odot f'(x)$. For the exact GELU, $f(x) = x\,\Phi(x)$
with $\Phi$ the standard normal CDF and $\varphi$ its density:

$$f'(x) = \Phi(x) + x\,\varphi(x).$$

ReLU's derivative is 1 for $x>0$, 0 for $x<0$ (and 1/2 at a tie, as `jax.grad` of
`jnp.maximum` picks); tanh's is $1 - \tanh^2 x$, computed from the kept output.
"""),
    code(r"""
from manual_grads.activations import activation_bwd, activation_fwd, gelu_bwd

show(gelu_bwd)
x, dy = rand(3, 7), rand(3, 7)
for name in ("gelu", "gelu_tanh", "relu", "tanh"):
    print(name)
    check(lambda x: activation_fwd(name, x), lambda res, dy: (activation_bwd(res, dy),),
          lambda x: activation(name, x), (x,), dy)
"""),
    md(r"""
## Layer norm

$\hat x = (x - \mu)\, r$ with $r = 1/\sqrt{\sigma^2 + \epsilon}$ over the last axis of width $D$,
then $y = \hat x \odot \gamma + \beta$. So $\bar\gamma = \sum \bar y \odot \hat x$,
$\bar\beta = \sum \bar y$, and with $\bar{\hat x} = \bar y \odot \gamma$ the gradient reaches
$x$ directly and through $\mu$ and $\sigma^2$:

$$\bar x = r\left(\bar{\hat x} - \operatorname{mean}(\bar{\hat x}) - \hat x\,\operatorname{mean}(\bar{\hat x} \odot \hat x)\right).$$
"""),
    code(r"""
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd

show(layer_norm_bwd)
p = {"scale": rand(6), "bias": rand(6)}
x, dy = jnp.asarray(3.0 * rng.standard_normal((2, 5, 6)) + 1.0), rand(2, 5, 6)
check(lambda p, x: layer_norm_fwd(p, x, 1e-5), layer_norm_bwd,
      lambda p, x: layer_norm(p, x, 1e-5), (p, x), dy)
"""),
    md(r"""
## Attention: the softmax

Per row, $P = \operatorname{softmax}(S)$ has Jacobian $\operatorname{diag}(P) - P P^\top$, so

$$\bar S = P \odot \left(\bar P - \textstyle\sum_j \bar P_j P_j\right).$$

Causally masked scores have $P = 0$ and get no gradient. The rest of attention is
matrix products: with $S = Q K^\top/\sqrt{d_h}$ and $A = P V$,
$\bar V = P^\top \bar A$, $\bar P = \bar A V^\top$, $\bar Q = \bar S K / \sqrt{d_h}$,
$\bar K = \bar S^\top Q / \sqrt{d_h}$, and the four projections are linear layers whose
$\bar x$ add up, because $q$, $k$ and $v$ all read $x$.
"""),
    code(r"""
from manual_grads.attention import attention_bwd, attention_fwd, softmax_bwd

show(softmax_bwd)
softmax = lambda s: jax.nn.softmax(s, axis=-1)  # noqa: E731
print("softmax")
check(lambda s: (softmax(s), softmax(s)), lambda P, dP: (softmax_bwd(P, dP),), softmax,
      (rand(2, 4, 4),), rand(2, 4, 4))

print("attention, causal, 2 heads")
D, H = 8, 2
p = {f"{w}{n}": rand(D, D) if w == "w" else rand(D) for n in "qkvo" for w in "wb"}
check(lambda p, x: attention_fwd(p, x, H, True), attention_bwd,
      lambda p, x: attention(p, x, H, True), (p, rand(2, 5, D)), rand(2, 5, D))
"""),
    md(r"""
## Blockwise attention: the FlashAttention-2 backward

With `attention_impl="blockwise"` the forward never forms the $(T, T)$ matrix $P$: for each
block of $K$ queries it runs an online softmax over the key blocks (skipping, when causal,
the blocks above the diagonal) and keeps only $O = PV$ and each row's log-sum-exp
$\ell_i = \log\sum_j e^{S_{ij}}$. The backward recomputes any block of probabilities as
$P_{ij} = e^{S_{ij} - \ell_i}$, and needs one more number per row: since $O_i = \sum_j P_{ij} V_j$,

$$D_i = \textstyle\sum_j \bar P_{ij} P_{ij} = \sum_j (\bar O_i \cdot V_j) P_{ij} = \bar O_i \cdot O_i .$$

Then, one (query block, key block) pair at a time: $\bar V_j \mathrel{+}= P_{ij}^\top \bar O_i$,
$\bar P_{ij} = \bar O_i V_j^\top$, $\bar S_{ij} = P_{ij} \odot (\bar P_{ij} - D_i)$ (the softmax
backward above, with $D$ in place of the row sum), $\bar Q_i \mathrel{+}= \bar S_{ij} K_j/\sqrt{d_h}$ and
$\bar K_j \mathrel{+}= \bar S_{ij}^\top Q_i/\sqrt{d_h}$. Memory falls from $O(T^2)$ to $O(T)$ per head.
"""),
    code(r"""
from manual_grads.blockwise import pair_bwd, blockwise_attention_bwd, blockwise_attention_fwd

show(pair_bwd)
D, H, T, block = 8, 2, 13, 4  # 13 positions: 4 blocks of 4, the last one padded
p = {f"{w}{n}": rand(D, D) if w == "w" else rand(D) for n in "qkvo" for w in "wb"}
x, dy = rand(2, T, D), rand(2, T, D)
for causal in (True, False):
    print("blockwise against full attention,", "causal" if causal else "bidirectional")
    check(lambda p, x: blockwise_attention_fwd(p, x, H, causal, block), blockwise_attention_bwd,
          lambda p, x: attention(p, x, H, causal), (p, x), dy)
"""),
    md(r"""
## Embedding

$x_{b,t} = E_{\text{id}_{b,t}}$ reads rows of the table, so the backward adds each
$\bar x_{b,t}$ into the row it was read from (a scatter-add; a token seen $n$ times
collects $n$ rows). The integer ids get no gradient.
"""),
    code(r"""
from manual_grads.embedding import token_embed_bwd, token_embed_fwd

show(token_embed_bwd)
table = rand(10, 4)
ids = jnp.array([[1, 3, 3], [0, 1, 9]])  # token 3 twice, token 1 in both rows
check(lambda t: token_embed_fwd(t, ids), lambda res, dx: token_embed_bwd(res, dx)[:1],
      lambda t: token_embedding(t, ids), (table,), rand(2, 3, 4))
"""),
    md(r"""
## Cross entropy

The loss is the mean over $N$ positions of $\log\sum_v e^{z_v} - z_{\text{target}}$, so

$$\bar z = \frac{1}{N}\left(\operatorname{softmax}(z) - \operatorname{onehot}(\text{target})\right)$$

(with a mask, $1/N$ becomes $\text{mask}/\sum \text{mask}$).
"""),
    code(r"""
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd

show(cross_entropy_bwd)
logits = jnp.asarray(4.0 * rng.standard_normal((2, 5, 11)))  # (B, T, V)
targets = jnp.asarray(rng.integers(0, 11, (2, 5)))  # (B, T)
check(lambda z: cross_entropy_fwd(z, targets), lambda res, d: cross_entropy_bwd(res, d)[:1],
      lambda z: cross_entropy(z, targets), (logits,), jnp.float64(1.0))
"""),
    md(r"""
## The whole model

`manual_grads.model.value_and_grad` runs the forward keeping each layer's residuals,
then the backwards in reverse order: loss, head, final layer norm, the blocks (a
reverse `lax.scan`; inside a block the residual connections add their gradients),
the embeddings. `jaxformer.tools.compare` compares it with `jax.value_and_grad(loss_fn)`
on a batch of the embedded corpus, leaf by leaf (relative error of each leaf).
"""),
    code(r"""
import tempfile
from pathlib import Path

from IPython.display import Image, display

from jaxformer.model.config import PRESETS
from jaxformer.model.params import init_params
from jaxformer.tools import compare
from jaxformer.tools.compare_plot import plot_report
from jaxformer.tools.compare_report import build_report, format_preset

config = PRESETS["tiny"]
params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), config, jnp.float64)
batch = compare.make_batch(config, batch_size=4, seq_len=16, seed=0)
report = compare.run_comparison(config, params, batch, name="tiny", repeats=2)
print(format_preset(report))
png = Path(tempfile.mkdtemp()) / "rel_errors.png"
plot_report(build_report([report], {}), png)
display(Image(filename=str(png)))
assert report.passed
"""),
]


# ----------------------------------------------------------------------------
# 02: training

TRAINING = [
    md(r"""
# Training with manual and automatic gradients

A gradient source is any function `(params, batch) -> (loss, grads)`.
`jaxformer.training.step.make_train_step(grad_fn, optimizer)` turns either source into
the same jitted optax step, so training from the same seed on the same batches must give
the same loss curve, to round-off. Here a small model learns the embedded corpus byte by
byte, once with each source, and then writes some text.

It trains in float64 so that "the same to round-off" is plain to see. In float32 the two
curves also start equal to about 1e-7, but training amplifies such differences step
after step (as it would any change of summation order), so after a few hundred steps
they differ in the third decimal while telling the same story.
"""),
    code(r"""
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from jaxformer import data
from jaxformer.model.config import get_preset
from jaxformer.training.optim import make_optimizer
from jaxformer.model.params import count_params, init_params
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
params0 = jax.tree_util.tree_map(np.asarray, init(jax.random.PRNGKey(0), config, jnp.float64))
print(config)
print(f"{count_params(params0):,} parameters, {len(train_ids):,} training bytes")
"""),
    md(r"""
Both runs start from the same parameters and see the same batches; only the gradient
source differs.
"""),
    code(r"""
def train(kind):
    optimizer = make_optimizer("adam", lr=1e-2, schedule="cosine", warmup_steps=10,
                               total_steps=STEPS, clip_norm=1.0)
    state = init_state(jax.tree_util.tree_map(jnp.asarray, params0), optimizer)
    step = make_train_step(grad_source(kind, config), optimizer)
    losses, t0 = [], time.perf_counter()
    for i in range(STEPS):
        state, metrics = step(state, batcher.batch(i))
        losses.append(float(metrics["loss"]))
    print(f"{kind:<6} {STEPS} steps in {time.perf_counter() - t0:.1f} s (compile included), "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return state.params, np.array(losses)


params_manual, losses_manual = train("manual")
params_auto, losses_auto = train("auto")
"""),
    code(r"""
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
ax_diff.semilogy(np.maximum(diff, 1e-12))
ax_diff.set(xlabel="step", ylabel="|difference|", title="manual - automatic (float64)")
ax_diff.grid(alpha=0.3)
plt.show()
assert diff.max() < 1e-9, "the two gradient sources should give the same curve"
"""),
    md(r"""
The curves lie on top of each other: what differs is float64 round-off.

## Sampling

`jaxformer.inference.generate.generate` runs the model autoregressively (one jitted loop),
drawing each byte from the softmax of its logits at a temperature.
"""),
    code(r"""
from jaxformer.inference.generate import generate

prompt = "The "
out = generate(params_manual, config, tokenizer.encode(prompt), 200, temperature=0.8, seed=0)
print(tokenizer.decode(out))
"""),
]


NOTEBOOKS = {
    "01_backprop_by_hand.ipynb": BACKPROP,
    "02_training.ipynb": TRAINING,
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells)
        for i, cell in enumerate(nb.cells):  # stable ids: regenerating changes nothing
            cell.id = f"{name.split('_')[0]}-{i:02d}"
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        path = Path(out_dir) / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for path in build():
        print(f"wrote {path}")
