"""Optimizers and schedules: each option against the update it should make."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer.training.optim import (current_lr, current_muon_lr, decay_mask, make_optimizer,
                                      make_schedule, muon_labels)

ATOL, RTOL = 1e-12, 1e-12  # float64 throughout (x64 is on in tests)


def _params():
    return {"w": jnp.array([[1.0, -2.0], [3.0, 0.5]]), "b": jnp.array([0.5, -1.0])}


def _grads():
    return {"w": jnp.array([[10.0, -0.5], [0.25, -8.0]]), "b": jnp.array([2.0, -3.0])}


def _one_update(opt, grads=None, params=None):
    params = _params() if params is None else params
    state = opt.init(params)
    updates, state = opt.update(_grads() if grads is None else grads, state, params)
    return updates, state


def _close(a, b, atol=ATOL, rtol=RTOL):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol, rtol=rtol), a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="lion"), "unknown optimizer"),
    (dict(schedule="exp"), "unknown schedule"),
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(lr="big"), "lr must be a finite number"),
    (dict(clip_value=0.0), "clip_value (--clip-value) must be > 0"),
    (dict(clip_norm=-1.0), "clip_norm (--clip-norm) must be > 0"),
    (dict(weight_decay=-0.1), "weight_decay (--weight-decay) must be >= 0"),
    (dict(accum_steps=0), "accum_steps (--accum-steps) must be a positive integer, got 0"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(schedule="cosine"), "needs total_steps"),
    (dict(schedule="cosine", warmup_steps=10, total_steps=10), "total_steps (10) > warmup_steps (10)"),
    (dict(name="muon", muon_lr=-0.02), "muon_lr (--muon-lr) must be >= 0.0, got -0.02"),
    (dict(name="muon", muon_lr=float("nan")), "muon_lr (--muon-lr) must be a finite number"),
    (dict(name="muon", muon_momentum=1.0), "muon_momentum (--muon-momentum) must be < 1"),
    (dict(name="muon", muon_momentum=-0.5), "muon_momentum (--muon-momentum) must be >= 0"),
    (dict(b1=1.0), "beta1 (--beta1) must be < 1, got 1.0"),
    (dict(b2=1.5), "beta2 (--beta2) must be < 1, got 1.5"),
    (dict(b2=-0.1), "beta2 (--beta2) must be >= 0"),
    (dict(eps=0.0), "adam_eps (--adam-eps) must be > 0"),
    (dict(momentum=2.0), "momentum (--momentum) must be <= 1.0"),
])
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        make_optimizer(**kwargs)
    assert message in str(info.value)


def test_sgd_is_minus_lr_times_grad():
    updates, state = _one_update(make_optimizer("sgd", lr=0.1))
    _close(updates, jax.tree_util.tree_map(lambda g: -0.1 * g, _grads()))
    assert float(current_lr(state)) == pytest.approx(0.1)


def test_momentum_matches_optax():
    ours = make_optimizer("momentum", lr=0.1, momentum=0.8)
    ref = optax.sgd(0.1, momentum=0.8)
    p, s1, s2 = _params(), ours.init(_params()), ref.init(_params())
    for _ in range(3):
        u1, s1 = ours.update(_grads(), s1, p)
        u2, s2 = ref.update(_grads(), s2, p)
        _close(u1, u2)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_match_optax(name):
    p = _params()
    if name == "adam":
        ours, ref = make_optimizer("adam", lr=0.01), optax.adam(0.01)
    else:  # decay on weights only, as optax.adamw with the same mask
        ours = make_optimizer("adamw", lr=0.01, weight_decay=0.1)
        ref = optax.adamw(0.01, weight_decay=0.1, mask={"w": True, "b": False})
    s1, s2 = ours.init(p), ref.init(p)
    for _ in range(3):
        u1, s1 = ours.update(_grads(), s1, p)
        u2, s2 = ref.update(_grads(), s2, p)
        _close(u1, u2, atol=1e-12, rtol=1e-10)
        p = optax.apply_updates(p, u1)


def test_clip_value_clips_every_entry():
    updates, _ = _one_update(make_optimizer("sgd", lr=1.0, clip_value=5.0))
    _close(updates, jax.tree_util.tree_map(lambda g: -jnp.clip(g, -5, 5), _grads()))


def test_clip_norm_bounds_the_global_norm():
    updates, _ = _one_update(make_optimizer("sgd", lr=1.0, clip_norm=1.0))
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0)
    scale = 1.0 / float(optax.tree.norm(_grads()))
    _close(updates, jax.tree_util.tree_map(lambda g: -scale * g, _grads()))


def test_weight_decay_for_sgd_adds_to_weights_not_biases():
    updates, _ = _one_update(make_optimizer("sgd", lr=0.1, weight_decay=0.5))
    p, g = _params(), _grads()
    _close(updates["w"], -0.1 * (g["w"] + 0.5 * p["w"]))
    _close(updates["b"], -0.1 * g["b"])


def test_decay_mask_on_model_params():
    from jaxformer import get_preset, init_params

    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), get_preset("tiny")))
    mask = decay_mask(params)
    assert mask["tok_embed"] and mask["pos_embed"] and mask["head"]["w"]
    assert mask["blocks"]["attn"]["wq"] and mask["blocks"]["ffn"]["w_out"]
    assert not mask["head"]["b"] and not mask["blocks"]["ln1"]["scale"]
    assert not mask["blocks"]["attn"]["bq"] and not mask["ln_f"]["bias"]


def test_gradient_accumulation_averages_micro_batches():
    opt = make_optimizer("sgd", lr=1.0, accum_steps=2)
    p = _params()
    g1, g2 = _grads(), jax.tree_util.tree_map(lambda g: -3.0 * g + 1.0, _grads())
    state, update = opt.init(p), jax.jit(opt.update)
    u1, state = update(g1, state, p)
    _close(u1, jax.tree_util.tree_map(jnp.zeros_like, p))  # no update until K micro-batches
    u2, state = update(g2, state, p)
    _close(u2, jax.tree_util.tree_map(lambda a, b: -(a + b) / 2, g1, g2))


def test_schedules():
    const = make_schedule(0.1, "constant")
    assert float(const(0)) == pytest.approx(0.1) and float(const(10**6)) == pytest.approx(0.1)
    warm = make_schedule(1.0, "constant", warmup_steps=4)
    assert [float(warm(i)) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cos = make_schedule(1.0, "cosine", warmup_steps=2, total_steps=12, final_lr_fraction=0.1)
    assert float(cos(0)) == pytest.approx(0.5) and float(cos(1)) == pytest.approx(1.0)
    assert float(cos(2)) == pytest.approx(1.0)
    assert float(cos(7)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert float(cos(12)) == pytest.approx(0.1) and float(cos(100)) == pytest.approx(0.1)
    values = [float(cos(i)) for i in range(2, 13)]
    assert values == sorted(values, reverse=True)
    lin = make_schedule(1.0, "linear", total_steps=10, final_lr_fraction=0.0)
    assert float(lin(5)) == pytest.approx(0.5)


def test_lr_metric_follows_the_schedule_through_accumulation():
    opt = make_optimizer("sgd", lr=1.0, schedule="linear", total_steps=4, final_lr_fraction=0.0,
                         accum_steps=2)
    p = _params()
    state, update = opt.init(p), jax.jit(opt.update)
    lrs = []
    for _ in range(6):
        _, state = update(_grads(), state, p)
        lrs.append(float(current_lr(state)))
    # the lr of the last applied update: updates happen on micro-steps 2, 4, 6
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 0.75, 0.75, 0.5])
    with pytest.raises(ValueError, match="no learning_rate hyperparameter"):
        current_lr(optax.adam(0.1).init(p))


# ---------------------------------------------------------------- muon: Muon for matrices, AdamW for the rest


def test_muon_labels_choose_the_stacked_matrices_by_rule():
    """The blocks' 3-dim leaves (L, in, out) are Muon's, whatever their name (a gated MLP's
    w_gate / w_up / w_down included); embeddings, the head, every norm and bias AdamW's."""
    from jaxformer import get_preset, init_params

    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), get_preset("tiny")))
    L, D, F, Dh = 2, 16, 24, 8
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    params["blocks"]["mlp"] = {"w_gate": leaf(L, D, F), "w_up": leaf(L, D, F), "w_down": leaf(L, F, D)}
    params["blocks"]["attn"]["q_norm"] = {"scale": leaf(L, Dh)}
    params["blocks"]["ln3"] = {"scale": leaf(L, D, 1)}  # 3 dims, yet a norm's
    labels = muon_labels(params)
    flat = {jax.tree_util.keystr(path): label
            for path, label in jax.tree_util.tree_leaves_with_path(labels)}
    muon = sorted(k for k, v in flat.items() if v == "muon")
    assert muon == sorted(f"['blocks']{k}" for k in (
        "['attn']['wq']", "['attn']['wk']", "['attn']['wv']", "['attn']['wo']",
        "['ffn']['w_in']", "['ffn']['w_out']",
        "['mlp']['w_gate']", "['mlp']['w_up']", "['mlp']['w_down']"))
    assert set(flat.values()) == {"muon", "adamw"}
    for name in ("['tok_embed']", "['pos_embed']", "['head']['w']", "['head']['b']",
                 "['ln_f']['scale']", "['blocks']['attn']['bq']", "['blocks']['ln1']['scale']",
                 "['blocks']['attn']['q_norm']['scale']", "['blocks']['ln3']['scale']"):
        assert flat[name] == "adamw", name


def _stacked_tree(key, scales=(1.0, 100.0, 0.01)):
    """{"blocks": {"w": (3, 4, 6), "b": (3, 6)}, "head": {"w": (6, 5)}} with layers of very
    different sizes (orthogonalising the stack as one matrix would mix them)."""
    k1, k2, k3 = jax.random.split(key, 3)
    w = jax.random.normal(k1, (3, 4, 6), jnp.float64) * jnp.asarray(scales)[:, None, None]
    return {"blocks": {"w": w, "b": jax.random.normal(k2, (3, 6), jnp.float64)},
            "head": {"w": jax.random.normal(k3, (6, 5), jnp.float64)}}


def test_muon_orthogonalises_each_layer_of_a_stack_on_its_own():
    """Three steps on a stacked (L, in, out) leaf equal optax's own Muon (2-D, its default)
    on each layer's (in, out) slice; orthogonalising the (L * in, out) stack as one
    matrix would not."""
    params = _stacked_tree(jax.random.PRNGKey(0))
    grads = [_stacked_tree(jax.random.PRNGKey(i)) for i in (1, 2, 3)]
    ours = make_optimizer("muon", lr=0.01, muon_lr=0.05, weight_decay=0.1)
    state, p = ours.init(params), params
    for g in grads:
        updates, state = ours.update(g, state, p)
        p = optax.apply_updates(p, updates)
    for layer in range(3):
        ref = optax.contrib.muon(0.05, beta=0.95, nesterov=True, weight_decay=0.1)
        w = params["blocks"]["w"][layer]
        ref_state = ref.init({"w": w})
        for g in grads:
            u, ref_state = ref.update({"w": g["blocks"]["w"][layer]}, ref_state, {"w": w})
            w = w + u["w"]
        np.testing.assert_allclose(p["blocks"]["w"][layer], w, rtol=1e-10, atol=1e-12)
    # the alternative, one Newton-Schulz over the flattened stack, moves the layers otherwise
    flat = optax.contrib.muon(0.05, beta=0.95, nesterov=True, weight_decay=0.1)
    w = params["blocks"]["w"].reshape(12, 6)
    u, _ = flat.update({"w": grads[0]["blocks"]["w"].reshape(12, 6)}, flat.init({"w": w}), {"w": w})
    first, _ = make_optimizer("muon", lr=0.01, muon_lr=0.05, weight_decay=0.1).update(
        grads[0], ours.init(params), params)
    assert not np.allclose(u["w"].reshape(3, 4, 6), first["blocks"]["w"], rtol=1e-3)


def test_muon_updates_the_other_leaves_as_adamw():
    """The leaves outside Muon's group get exactly make_optimizer("adamw")'s updates
    (same decay rule: the head's w decays, the bias does not)."""
    params = _stacked_tree(jax.random.PRNGKey(0))
    muon = make_optimizer("muon", lr=0.01, weight_decay=0.1, b2=0.95)
    adamw = make_optimizer("adamw", lr=0.01, weight_decay=0.1, b2=0.95)
    s1, s2, p = muon.init(params), adamw.init(params), params
    for i in (1, 2, 3):
        g = _stacked_tree(jax.random.PRNGKey(i))
        u1, s1 = muon.update(g, s1, p)
        u2, s2 = adamw.update(g, s2, p)
        _close({"b": u1["blocks"]["b"], "head": u1["head"]},
               {"b": u2["blocks"]["b"], "head": u2["head"]}, atol=1e-15, rtol=1e-12)
        p = optax.apply_updates(p, u1)


def test_muon_rates_follow_one_schedule():
    """lr (AdamW's) and muon_lr warm up and decay together; min_lr sets both floors as
    the same fraction of their peaks; the step reports both."""
    opt = make_optimizer("muon", lr=0.01, muon_lr=0.04, schedule="linear", warmup_steps=2,
                         total_steps=6, min_lr=0.001)
    params = _stacked_tree(jax.random.PRNGKey(0))
    state, update = opt.init(params), jax.jit(opt.update)
    rates = []
    for _ in range(7):
        _, state = update(params, state, params)
        rates.append((float(current_lr(state)), float(current_muon_lr(state))))
    lr, muon_lr = zip(*rates)
    np.testing.assert_allclose(lr, [0.005, 0.01, 0.01, 0.00775, 0.0055, 0.00325, 0.001], rtol=1e-6)
    np.testing.assert_allclose(muon_lr, 4 * np.array(lr), rtol=1e-6)
    assert current_muon_lr(make_optimizer("adamw").init(params)) is None
