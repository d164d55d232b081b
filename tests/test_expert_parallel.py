"""Expert parallelism (jaxformer/model/moe_parallel.py, manual_grads/moe_parallel.py): on 8 host
devices in float64, the MoE layer with its experts split over an "expert" mesh axis and the tokens
exchanged with all_to_all equals the one-device layer (forward, hand-derived gradients, jax.grad of
the sharded forward) per leaf within 1e-10; tiny-moe trains to the one-device losses with either
gradient source, its experts split over the expert axis; bad meshes are one-line errors. One
subprocess runs every multi-device case.

Random weights make ties between router logits measure-zero: every mesh routes the same way.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_devices_flags, once_per_run
from jax.sharding import AbstractMesh

from jaxformer.model.config import PRESETS
from jaxformer.model.moe_parallel import moe_layer
from jaxformer.training.sharding import leaf_spec, mesh_shape, parse_mesh

pytestmark = pytest.mark.xdist_group("test_expert_parallel")  # one worker: the other goes on while its subprocess runs

# (mesh, router and shared expert): 8 experts, 3 per token; El = 1, 2, 4 experts per device
# (C = N, 2 N, 3 N rows); a shared expert, replicated, runs on each device's own tokens
LAYER_CASES = [("expert=8", dict(router="topk_softmax")),
               ("data=2,expert=4", dict(router="softmax_topk", norm_topk_prob=True, shared_expert_d_ff=6,
                                        shared_expert_gate=False)),
               ("data=2,fsdp=2,expert=2", dict(router="softmax_topk", shared_expert_d_ff=10))]
# (mesh, gradient source, remat): block recompute runs the exchange again in the backward
TRAIN_CASES = [("data=2,expert=4", "auto", "none"), ("data=2,fsdp=2,expert=2", "manual", "none"),
               ("fsdp=2,expert=4", "custom_vjp", "none"), ("expert=4,data=2", "manual", "block")]
STEPS = 3

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, optax
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from helpers import make_params
    from jaxformer.model.config import PRESETS
    from jaxformer.model.moe import MoeStats, moe
    from jaxformer.model.moe_parallel import moe_layer
    from jaxformer.model.params import init_params
    from jaxformer.training.sharding import make_mesh, put_batch, state_shardings
    from jaxformer.training.step import grad_source, init_state, make_eval_step, make_train_step
    from manual_grads import custom_vjp
    from manual_grads.moe_parallel import moe_layer_bwd, moe_layer_fwd

    layer_cases, train_cases, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    assert jax.device_count() == 8, jax.devices()
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(k1, (16, 5, 16), jnp.float64)  # 80 tokens, 10 a device
    dy = jax.random.normal(k2, (16, 5, 16), jnp.float64)
    dstats = MoeStats(jnp.zeros(8), jnp.linspace(-1.0, 2.0, 8), jnp.array(0.7))

    def objective(layer, config):  # <y, dy> + <probs, dstats.probs> + z dstats.z
        def f(p, x):
            y, stats = layer(p, x, config)
            return jnp.sum(y * dy) + jnp.sum(stats.probs * dstats.probs) + stats.z * dstats.z
        return f

    def manual(p, x, config):
        out, res = moe_layer_fwd(p, x, config)
        return out, moe_layer_bwd(res._replace(dstats=dstats), dy)

    def errors(a, b):
        return {jax.tree_util.keystr(k): float(jnp.max(jnp.abs(u - v)))
                for (k, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b))}

    KEYS = ("loss", "grad_norm", "update_norm", "moe/balance_loss", "moe/z_loss", "moe/load0")
    result = {"layer": {}, "train": {}, "errors": {}, "specs": {}}
    for text, router in layer_cases:
        config = PRESETS["tiny-moe"].replace(n_experts=8, experts_per_token=3, **router)
        p = jax.tree_util.tree_map(lambda a: a[0], make_params(config, jnp.float64, 0)["blocks"]["ffn"])
        p = {**p, "router": p["router"] * 5.0}  # gates far from uniform
        one = (moe(p, x, config), jax.grad(objective(moe, config), argnums=(0, 1))(p, x))
        mesh = make_mesh(shape=text)

        def sharded(p, x):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                (y, stats), grads = manual(p, x, config)
                auto = jax.grad(objective(moe_layer, config), argnums=(0, 1))(p, x)
                return (y, stats), grads, auto

        p_on = jax.device_put(p, NamedSharding(mesh, P()))
        x_on = jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))
        step = jax.jit(sharded)
        out, grads, auto = step(p_on, x_on)
        hlo = step.lower(p_on, x_on).as_text()
        result["layer"][text] = {"forward": errors(out, one[0]), "manual": errors(grads, one[1]),
                                 "auto": errors(auto, one[1]), "all_to_all": hlo.count("all_to_all")}

    optimizer = optax.adam(1e-2)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (8, 17), 0, 256)  # one batch, every step
    custom = jax.value_and_grad(custom_vjp.loss_fn)  # jax.grad of the model whose layers are the manual pairs

    def run(grads, text=None, remat="none"):
        config = PRESETS["tiny-moe"].replace(remat=remat)  # 4 experts, 2 per token
        sources = {"auto": grad_source("auto", config), "manual": grad_source("manual", config),
                   "custom_vjp": lambda params, batch, key=None: custom(params, batch, config)}
        state = init_state(init_params(jax.random.PRNGKey(0), config, dtype=jnp.float64), optimizer)
        mesh = make_mesh(jax.devices()[:1] if text is None else None, text)
        layout = state_shardings(state, mesh)
        step = make_train_step(sources[grads], optimizer, mesh=mesh, state_sharding=layout)
        state, records = jax.device_put(state, layout), []
        batch = put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
        for _ in range(steps):
            state, metrics = step(state, batch)
            records.append({k: float(v) for k, v in metrics.items() if k in KEYS})
        evaluate = make_eval_step(config, mesh)  # the trained params' loss, the experts still split
        records.append({"eval": float(evaluate(state.params, batch)),
                        "eval_all_to_all": evaluate.lower(state.params, batch).as_text().count("all_to_all")})
        return state, records

    result["train"]["one"] = run("manual")[1]
    for text, grads, remat in train_cases:
        state, result["train"][f"{text} {grads} {remat}"] = run(grads, text, remat)
        w = state.params["blocks"]["ffn"]["w_gate"]
        moments = [m for k, m in jax.tree_util.tree_leaves_with_path(state.opt_state)
                   if jax.tree_util.keystr(k).endswith("['w_gate']")]
        result["specs"][text] = {"spec": [str(a) for a in w.sharding.spec],
                                 "shards": [list(s.data.shape) for s in w.addressable_shards],
                                 "moments": len(moments) == 2 and all(m.sharding == w.sharding for m in moments)}
    for name, text in [("experts", "data=1,expert=8"), ("devices", "expert=3")]:
        try:
            run("manual", text)
        except ValueError as e:
            result["errors"][name] = str(e)
    print(json.dumps(result))
""")


def _run_in_a_subprocess():
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"  # compiled as the rest of the suite (conftest.py)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(LAYER_CASES), json.dumps(TRAIN_CASES), str(STEPS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return once_per_run(tmp_path_factory, "expert_parallel", _run_in_a_subprocess)  # one run, not one a worker


@pytest.mark.parametrize("text", [t for t, _ in LAYER_CASES])
def test_layer_equals_one_device(sharded, text):
    """Forward, the manual backward and jax.grad of the sharded forward, per leaf within 1e-10 of
    the one-device layer's forward and jax.grad; the exchange is really there (all_to_all in the
    program: the tokens out and back, the counts, and the backward's two)."""
    case = sharded["layer"][text]
    for part in ("forward", "manual", "auto"):
        assert len(case[part]) > 0
        for leaf, err in case[part].items():
            assert err <= 1e-10, (text, part, leaf, err)
    assert set(case["manual"]) == set(case["auto"])
    assert case["all_to_all"] >= 5


def test_training_on_an_expert_mesh_equals_one_device(sharded):
    """3 float64 steps of tiny-moe (4 experts) on expert meshes with each gradient source (jax.grad,
    the manual backward, also with block recompute, and jax.grad of the custom_vjp model): the
    one-device (manual) losses, gradient and update norms and router statistics within 1e-10 (on
    one device the sources agree: test_moe.py)."""
    runs = {name: records[:-1] for name, records in sharded["train"].items()}  # the last: evaluation
    for text, grads, remat in TRAIN_CASES:
        one, records = runs["one"], runs[f"{text} {grads} {remat}"]
        assert len(records) == len(one) == STEPS
        for key in ("loss", "grad_norm", "update_norm") + (("moe/balance_loss", "moe/z_loss", "moe/load0")
                                                           if grads != "custom_vjp" else ()):
            np.testing.assert_allclose([r[key] for r in records], [r[key] for r in one], rtol=1e-10,
                                       err_msg=f"{text} {grads} {remat} {key}")
    assert runs["one"][-1]["loss"] < runs["one"][0]["loss"] - 0.1  # the same batch each step: learned


def test_evaluation_on_an_expert_mesh_exchanges_tokens_and_equals_one_device(sharded):
    """The evaluation step of each expert-mesh run is traced under its mesh: its program holds the
    MoE layers' all_to_all (the experts stay split, none gathered whole), and the trained params'
    loss is the one-device run's within 1e-10."""
    runs = sharded["train"]
    one = runs["one"][-1]
    assert one["eval_all_to_all"] == 0  # one device: the plain layer
    for text, grads, remat in TRAIN_CASES:
        evaluation = runs[f"{text} {grads} {remat}"][-1]
        assert evaluation["eval_all_to_all"] > 0, text
        np.testing.assert_allclose(evaluation["eval"], one["eval"], rtol=1e-10, err_msg=text)


def test_experts_are_split_over_the_expert_axis(sharded):
    """w_gate (L, E, D, F) = (2, 4, 16, 12): E over expert, D over fsdp; AdamW's moments alike."""
    specs = sharded["specs"]
    assert specs["data=2,expert=4"]["spec"] == ["None", "expert"]
    assert specs["data=2,expert=4"]["shards"] == [[2, 1, 16, 12]] * 8
    assert specs["data=2,fsdp=2,expert=2"]["spec"] == ["None", "expert", "fsdp"]
    assert specs["data=2,fsdp=2,expert=2"]["shards"] == [[2, 2, 8, 12]] * 8
    assert all(s["moments"] for s in specs.values())


def test_bad_expert_meshes(sharded):
    errors = sharded["errors"]
    assert "n_experts 4 does not divide over the mesh's expert axis (expert=8)" in errors["experts"]
    assert "expert=3 does not divide the 8 devices" in errors["devices"]
    assert all("\n" not in e for e in errors.values())


def test_mesh_text_with_an_expert_axis():
    assert parse_mesh("data=2,fsdp=2,expert=2") == {"data": 2, "fsdp": 2, "expert": 2}
    assert mesh_shape("expert=4", 8) == (2, 1, 4)
    assert mesh_shape("fsdp=2,expert=2", 8) == (2, 2, 2)
    assert mesh_shape("data=2,fsdp=4", 8) == (2, 4)  # no expert axis named: the two-axis mesh
    with pytest.raises(ValueError, match="data x fsdp x expert = 2 x 1 x 2 = 4 devices, but 8 devices are in use"):
        mesh_shape("data=2,expert=2", 8)
    with pytest.raises(ValueError, match="mesh axis expert must have a positive size"):
        parse_mesh("expert=0")


def test_leaf_spec_with_an_expert_axis():
    assert tuple(leaf_spec((2, 64, 2048, 1024), 4, expert_axis=1)) == (None, "expert", "fsdp")
    assert tuple(leaf_spec((2, 64, 2048, 1024), 1, expert_axis=1)) == (None, "expert")
    assert tuple(leaf_spec((2, 8, 3, 5), 4, expert_axis=1)) == (None, "expert")  # nothing else divides


def test_layer_refuses_experts_that_do_not_divide_over_the_expert_axis():
    config = PRESETS["tiny-moe"].replace(n_experts=6)
    p = {"router": jnp.zeros((16, 6)), "w_gate": jnp.zeros((6, 16, 12)), "w_up": jnp.zeros((6, 16, 12)),
         "w_down": jnp.zeros((6, 12, 16))}
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 4), ("data", "expert"))):
        with pytest.raises(ValueError, match=r"n_experts 6 does not divide over the mesh's expert axis \(expert=4\)"):
            moe_layer(p, jnp.zeros((8, 4, 16)), config)
