"""jaxformer used as a library: the README's "Manual gradients in code" example, and
training with plain optax optimizers, through make_train_step and through a loop of the
user's own, with either gradient source; a jitted step exports with jax.export.

The model is the tiny preset in float32, on one fixed batch that ten steps of AdamW
at 1e-3 start to memorise.
"""

import contextlib
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer
import manual_grads
from jaxformer.training.step import grad_source, init_state, make_train_step

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = jaxformer.get_preset("tiny")  # V 256, D 16, 2 heads, 2 layers, F 24, max_seq_len 16
STEPS = 10


def readme_block(heading: str) -> str:
    """The first ```python block after the README's section ``## heading``."""
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)
    assert len(section) == 2, f"README.md has no section {heading!r}"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block, f"README.md's section {heading!r} has no Python example"
    return block.group(1)


def test_readme_manual_gradients_in_code_runs():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_block("Manual gradients in code"), str(README), "exec"), {})
    assert re.fullmatch(r"loss \d+\.\d{6}, [\d,]+ params; layer norm backward: dx \(2, 8, \d+\), "
                        r"dscale \(\d+,\)\n", out.getvalue()), out.getvalue()


@pytest.fixture(scope="module")
def start():
    """(params float32, the fixed batch (B 4, T 16))."""
    params = jaxformer.init_params(jax.random.PRNGKey(0), CONFIG, dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (4, 17)).astype(np.int32)
    return params, {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}


def losses_of(step, state, batch, steps=STEPS):
    """(the losses of ``steps`` calls of ``step`` on ``batch``, the last metrics)."""
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), metrics


def fresh(params):
    """A copy of ``params``: the step donates its state's buffers."""
    return jax.tree_util.tree_map(jnp.array, params)


OPTIMIZERS = {  # (optimizer, the least the loss falls in ten steps)
    "adamw": (lambda: optax.adamw(1e-3), 0.2),
    "clip+adamw": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 0.2),
    "multisteps": (lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2), 0.1),  # 5 updates
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_plain_optax_trains_with_either_gradient_source(start, name):
    """make_train_step takes any optax optimizer; no injected rate, so no lr metric. The
    manual and the automatic gradients give the same loss curve to float32 round-off."""
    params, batch = start
    make, fall = OPTIMIZERS[name]
    curves = {}
    for source in ("manual", "auto"):
        optimizer = make()
        step = make_train_step(grad_source(source, CONFIG), optimizer)
        curves[source], metrics = losses_of(step, init_state(fresh(params), optimizer), batch)
        assert "loss" in metrics and "lr" not in metrics
        assert {"grad_norm", "update_norm"} <= set(metrics)
        assert curves[source][-1] < curves[source][0] - fall, curves[source]
    np.testing.assert_allclose(curves["manual"], curves["auto"], rtol=1e-5)


def test_injected_learning_rate_is_reported(start):
    params, batch = start
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    step = make_train_step(grad_source("manual", CONFIG), optimizer)
    losses, metrics = losses_of(step, init_state(fresh(params), optimizer), batch, steps=3)
    assert float(metrics["lr"]) == pytest.approx(1e-3)
    assert losses[-1] < losses[0]


def test_injected_learning_rate_is_found_where_it_nests(start):
    """The rate of an inject_hyperparams state inside a chain, MultiSteps or a
    partition; none in a state without one."""
    from jaxformer.training.optim import injected_lr

    params, _ = start
    inject = lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=2e-3)  # noqa: E731
    labels = jax.tree_util.tree_map(lambda _: "a", params)
    nested = {
        "chain": optax.chain(optax.clip_by_global_norm(1.0), inject()),
        "multisteps": optax.MultiSteps(inject(), every_k_schedule=2),
        "partition": optax.partition({"a": inject(), "b": optax.sgd(0.1)}, labels),
    }
    for name, optimizer in nested.items():
        assert float(injected_lr(optimizer.init(params))) == pytest.approx(2e-3), name
    for optimizer in (optax.adamw(1e-3), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)):
        assert injected_lr(optimizer.init(params)) is None


def test_own_loop_with_manual_gradients(start):
    """No make_train_step: the user's jitted step around manual_grads.value_and_grad."""
    params, batch = start
    opt = optax.adamw(1e-3)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = manual_grads.value_and_grad(params, batch, CONFIG)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.2, losses


def test_jitted_step_exports(start):
    """jax.export of make_train_step's step, from shapes alone; the exported step's call
    gives the jitted step's state and metrics."""
    params, batch = start
    optimizer = optax.adamw(1e-3)
    step = make_train_step(grad_source("manual", CONFIG), optimizer)
    state = init_state(fresh(params), optimizer)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    exported = jax.export.export(step)(*shapes)
    new_state, metrics = exported.call(state, batch)
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    assert int(new_state.step) == 1 and "lr" not in metrics
    ref_state, ref = step(state, batch)  # the last use of state: this call donates it
    np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                           new_state.params, ref_state.params)
