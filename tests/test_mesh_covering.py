"""Every pair of mesh axes together: a pairwise covering set of (data, fsdp, expert, tensor,
context) meshes, each equal to one device for both gradient sources.

Each axis has size 1 or 2; every two axes appear with sizes (2, 2), (2, 1) and (1, 2) in some
mesh of MESHES, and (1, 1) in the one-device run they are all compared with (checked here,
``test_meshes_cover_every_pair_of_axes``). One subprocess on 8 forced CPU devices, float64: the
Llama-like mixture of experts (rotary positions, 2 key/value heads for 4 query heads, QK-norm,
SwiGLU experts, 4 of them, 2 a token, the load-balancing loss) with packed documents and dropout
0.1, its params and batch laid out as the train step lays them (training.sharding's
``tree_shardings``: fsdp-split leaves, experts over expert, the matrices over tensor;
``put_batch``), under ``jax.set_mesh``: the loss and every gradient leaf of
manual_grads.value_and_grad and of jax.grad of loss_fn, with one step key, against one device's
manual ones, to 1e-10. The axes' own proofs (their collectives, their refusals, more options) are
the tensor, context and expert tests'; this one is their combinations'."""

import itertools

import numpy as np
import pytest
from helpers import once_per_run, run_cases_on_8_devices

from jaxformer.training.sharding import AXES, parse_mesh

pytestmark = pytest.mark.xdist_group("test_mesh_covering")  # one worker: the other goes on while its subprocess runs

TOL = 1e-10
B, T = 4, 16
MESHES = ["data=2,fsdp=2,tensor=2", "data=2,fsdp=2,context=2", "data=2,expert=2,tensor=2",
          "fsdp=2,expert=2,context=2", "expert=2,tensor=2,context=2"]  # 5: the fewest three-axis meshes that cover
DOCUMENTS = [[0] * 5 + [1] * 11, [0] * 11 + [1] * 5, [0] * 3 + [1] * 6 + [2] * 7, [0] * 16]


def config():
    from jaxformer.model.config import ModelConfig

    return ModelConfig(vocab_size=11, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=T, norm_type="rms",
                       mlp="gated", activation="silu", positions="rope", n_kv_heads=2, qk_norm=True, bias=False,
                       n_experts=4, experts_per_token=2, moe_aux_loss_coef=0.1, dropout=0.1)


def run_cases() -> dict:
    """The subprocess' body: {name: number}."""
    import jax
    import jax.numpy as jnp

    import manual_grads
    from jaxformer import loss_fn
    from jaxformer.model.params import init_params
    from jaxformer.training.sharding import make_mesh, put_batch, tree_shardings

    cfg, out, leaves = config(), {}, jax.tree_util.tree_leaves
    diff = lambda a, b: max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(leaves(a), leaves(b), strict=True))  # noqa: E731
    rng = np.random.default_rng(2)
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), shapes)
    inputs = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1), "segments": jnp.asarray(DOCUMENTS)}
    key = jax.random.PRNGKey(7)  # one step's dropout key, every source's
    sources = {"manual": lambda p, b, c: manual_grads.value_and_grad(p, b, c, key),
               "jax.grad": jax.value_and_grad(lambda p, b, c: loss_fn(p, b, c, key=key))}
    loss1, grads1 = jax.jit(sources["manual"], static_argnums=2)(params, batch, cfg)
    out["leaves"] = len(leaves(grads1))
    out["dropout's effect"] = abs(float(loss1) - float(jax.jit(loss_fn, static_argnums=2)(params, batch, cfg)))
    devices = np.array(jax.devices())
    for text in MESHES:
        mesh = make_mesh(devices, shape=text)
        p, b = jax.device_put(params, tree_shardings(params, mesh)), put_batch(batch, mesh)
        out[f"{text}: fsdp-split leaves"] = sum(
            "fsdp" in str(s.spec) for s in leaves(tree_shardings(params, mesh)))  # the layout is the train step's
        with jax.set_mesh(mesh):
            for what, f in sources.items():
                loss, grads = jax.jit(f, static_argnums=2)(p, b, cfg)
                out[f"{text}: {what} loss"] = abs(float(loss) - float(loss1))
                out[f"{text}: {what} = one device"] = diff(grads, grads1)
                out[f"{text}: {what} leaves"] = len(leaves(grads))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return once_per_run(tmp_path_factory, "mesh_covering", lambda: run_cases_on_8_devices("test_mesh_covering"))  # one run, not one a worker


def test_meshes_cover_every_pair_of_axes():
    """Every two of the five axes take sizes (2, 2), (2, 1) and (1, 2) in some mesh; (1, 1) is the
    one-device run. Each mesh uses all 8 devices."""
    sizes = [{a: parse_mesh(m).get(a, 1) for a in AXES} for m in MESHES]
    assert set(AXES) == {"data", "fsdp", "expert", "tensor", "context"}
    for a, b in itertools.combinations(AXES, 2):
        assert {(s[a], s[b]) for s in sizes} >= {(2, 2), (2, 1), (1, 2)}, (a, b)
    assert all(np.prod(list(s.values())) == 8 for s in sizes)


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_equals_one_device(results, mesh):
    """Loss and every gradient leaf, by hand and by jax.grad, equal one device's manual ones to
    1e-10, with one step's dropout masks (which change the loss)."""
    n = results["leaves"]
    assert results["dropout's effect"] > 1e-4
    if "fsdp" in mesh:
        assert results[f"{mesh}: fsdp-split leaves"] > 0
    for what in ("manual", "jax.grad"):
        assert results[f"{mesh}: {what} leaves"] == n
        assert results[f"{mesh}: {what} loss"] <= TOL, (what, results[f"{mesh}: {what} loss"])
        assert results[f"{mesh}: {what} = one device"] <= TOL, (what, results[f"{mesh}: {what} = one device"])
