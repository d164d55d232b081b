"""Data x FSDP (x tensor) sharding through jax.sharding: on 8 host devices, every mesh gives the
single-device losses (both gradient sources; with a tensor axis the blocks run tensor parallel,
their weights split over it), and a run resumed on another mesh
continues with the same losses. One subprocess runs every sharded case."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxformer.training.sharding import leaf_spec, make_mesh, mesh_shape, parse_mesh
from jaxformer.training.loop import train
from helpers import host_devices_flags, tiny_settings

STEPS = 3
# Each gradient source on each kind of axis, in the loop. Not here, as proven elsewhere: data=2 x
# fsdp=4 with jax.grad (the resumed run's first steps; its layout is the manual case's), data=8 by
# hand (the manual backward has no data or fsdp code: jit splits it), data=2 x fsdp=2 x tensor=2
# with jax.grad (test_mesh_covering.py: both sources, in the train step's layout; the loop's own
# code is the same on every mesh)
CASES = [("data=8", "auto", ""), ("data=2,fsdp=4", "manual", ""), ("data=2,fsdp=4", "manual", "modern"),
         ("data=2,fsdp=4", "manual", "pallas"),
         # tensor parallel blocks (model/parallel/tensor.py); modern's one key/value head is replicated
         ("data=4,tensor=2", "manual", ""), ("data=2,fsdp=2,tensor=2", "manual", "modern"),
         # context parallel blocks (model/parallel/context.py): ring attention over T split in two (with
         # a tensor axis beside: the blocks tensor parallel too, the head's vocabulary split)
         ("data=2,tensor=2,context=2", "auto", ""), ("data=2,fsdp=2,context=2", "manual", "modern"),
         ("fsdp=2,tensor=2,context=2", "manual", "modern")]
# the modern block on the tiny preset: multi-query attention, rotary positions, RMS norm, SwiGLU, QK-norm
MODERN = dict(norm_type="rms", positions="rope", mlp="gated", activation="silu", n_kv_heads=1,
              qk_norm=True, bias=False)
# model overrides of each case's kind; "pallas": the kernel runs per shard of the batch (shard_map)
KINDS = {"": {}, "modern": MODERN, "pallas": dict(attention_impl="pallas", pallas_block_q=8, pallas_block_k=8)}

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    jax.config.update("jax_enable_x64", True)  # as in the test process
    from jaxformer.training.loop import train
    from jaxformer.training.sharding import make_mesh, put_batch
    from helpers import tiny_settings

    corpus, out, steps, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    kinds = json.loads(sys.argv[5])
    assert jax.device_count() == 8, jax.devices()
    batch = put_batch({"inputs": np.zeros((8, 16), np.int32)}, make_mesh(shape="data=2,fsdp=4"))
    assert [s.data.shape for s in batch["inputs"].addressable_shards] == [(1, 16)] * 8
    errors = {}
    try:  # 6 rows over 8 devices: never silently replicated
        put_batch({"inputs": np.zeros((6, 16), np.int32)}, make_mesh(shape="data=2,fsdp=4"))
    except ValueError as e:
        errors["rows"] = str(e)
    for name, kwargs in [("batch", dict(batch_size=12)), ("product", dict(mesh="data=3,fsdp=2")),
                         ("fsdp", dict(mesh="fsdp=3")), ("context", dict(mesh="context=2", model={"attention_impl": "blockwise", "attention_block": 3}))]:
        try:
            train(tiny_settings(corpus, steps=1, **kwargs), out + "-bad", progress=False)
        except ValueError as e:
            errors[name] = str(e)
    out_records = {}
    for mesh, grads, kind in cases:
        model = kinds[kind]
        result = train(tiny_settings(corpus, steps=steps, eval_every=steps, mesh=mesh, grads=grads, model=model),
                       f"{out}/{mesh}-{grads}{kind}", progress=False)
        params = result.state.params
        out_records[f"{mesh} {grads}{kind}"] = result.records
        if "tensor=2" in mesh:  # (L, D, F) = (2, 16, 24): F split over tensor (column parallel), D over fsdp
            w = params["blocks"]["ffn"]["w_up" if kind == "modern" else "w_in"]
            fsdp = 2 if "fsdp=2" in mesh else 1
            assert [s.data.shape for s in w.addressable_shards] == [(2, 16 // fsdp, 12)] * 8
            w_out = params["blocks"]["ffn"]["w_down" if kind == "modern" else "w_out"]  # (2, 24, 16): rows
            assert w_out.sharding.spec[1] == "tensor"
            head = params["head"]["w"]  # (D, V) = (16, 256): V split over tensor (the vocab-parallel head)
            assert [s.data.shape for s in head.addressable_shards] == [(16 // fsdp, 128)] * 8
            table = params["tok_embed"]  # (V, D) = (256, 16): its rows split over tensor (the embedding's)
            assert [s.data.shape for s in table.addressable_shards] == [(128, 16 // fsdp)] * 8
        elif kind == "modern":  # the gated MLP's (L, D, F) = (2, 16, 24) is split along F too (over
            w_up = params["blocks"]["ffn"]["w_up"]  # fsdp alone: the params are replicated over context)
            fsdp = 2 if "fsdp=2" in mesh else 4
            assert [s.data.shape for s in w_up.addressable_shards] == [(2, 16, 24 // fsdp)] * 8
        elif "fsdp=4" in mesh:  # (V, D) = (256, 16): split along V; ln_f scale (16,): along D
            assert [s.data.shape for s in params["tok_embed"].addressable_shards] == [(64, 16)] * 8
            assert [s.data.shape for s in params["ln_f"]["scale"].addressable_shards] == [(4,)] * 8
            w_in = params["blocks"]["ffn"]["w_in"]  # (L, D, F) = (2, 16, 24): split along F
            assert [s.data.shape for s in w_in.addressable_shards] == [(2, 16, 6)] * 8
            moments = [x for x in jax.tree_util.tree_leaves(result.state.opt_state) if x.shape == w_in.shape]
            assert len(moments) == 2 and all(x.sharding == w_in.sharding for x in moments)
        else:
            assert params["tok_embed"].sharding.is_fully_replicated
    # a run checkpointed on one mesh resumes on another
    # (jax.grad's: the loop's one run of it on an fsdp mesh; the default would be the manual step)
    first = train(tiny_settings(corpus, steps=steps - 1, mesh="data=2,fsdp=4", ckpt_every=1, grads="auto"),
                  f"{out}/resumed", progress=False).records
    rest = train(tiny_settings(corpus, steps=steps, eval_every=steps, mesh="data=1,fsdp=8", grads="auto"),
                 f"{out}/resumed", resume=True, progress=False).records
    out_records["resumed"] = first + rest
    print(json.dumps({"errors": errors, "records": out_records}))
""")


@pytest.mark.slow
def test_meshes_match_one_device(corpus, tmp_path):
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    # compiled like the rest of the suite (conftest.py): faster, and the same on both sides
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, corpus, str(tmp_path / "sharded"), str(STEPS),
                           json.dumps(CASES), json.dumps(KINDS)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = result["errors"]
    assert "batch_size 12 must be divisible by the number of devices (8" in errors["batch"]
    assert "data x fsdp = 3 x 2 = 6 devices, but 8 devices are in use" in errors["product"]
    assert "fsdp=3 does not divide the 8 devices" in errors["fsdp"]
    assert "has 6 rows, which do not divide over the 8 devices" in errors["rows"]
    assert errors["context"] == ("mesh axis context=2: context parallelism does not run attention_block 3 with "
                                 "pieces of 4 tokens (the ring's visits fold 4 or 8 keys: the block must divide 4, or "
                                 "be at least 8) yet; use context=1")
    sharded = result["records"]
    for grads, kind in (("auto", ""), ("manual", ""), ("manual", "modern"), ("manual", "pallas")):
        single = train(tiny_settings(corpus, steps=STEPS, eval_every=STEPS, grads=grads, model=KINDS[kind]),
                       tmp_path / f"single-{grads}{kind}", progress=False).records
        runs = [f"{mesh} {g}{k}" for mesh, g, k in CASES if (g, k) == (grads, kind)] + (
            ["resumed"] if grads == "auto" else [])
        for run in runs:
            records = sharded[run]
            assert [r["step"] for r in records] == [r["step"] for r in single] == list(range(1, STEPS + 1))
            for key in ("loss", "grad_norm", "update_norm", "val_loss"):
                a = {r["step"]: r[key] for r in single if key in r}
                b = {r["step"]: r[key] for r in records if key in r}  # resumed: also at its first end
                assert len(a) > 0 and set(a) <= set(b)
                np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=2e-5,
                                           err_msg=f"{run}: {key}")  # float32 round-off


@pytest.mark.parametrize("text, message", [
    ("data2", "malformed mesh 'data2'"),
    ("data=2;fsdp=4", "malformed mesh"),
    ("data=x", "malformed mesh"),
    ("model=2", "unknown mesh axis 'model'"),
    ("data=1,data=1", "mesh axis 'data' given twice"),
    ("data=0", "mesh axis data must have a positive size"),
])
def test_bad_mesh_text(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(text)


def test_mesh_shape():
    assert mesh_shape("", 8) == (8, 1)
    assert mesh_shape(None, 1) == (1, 1)
    assert mesh_shape("fsdp=4", 8) == (2, 4)
    assert mesh_shape(" data = 2 , fsdp = 4 ", 8) == (2, 4)
    with pytest.raises(ValueError, match="data x fsdp = 2 x 1 = 2 devices, but 1 device is in use"):
        mesh_shape("data=2", 1)
    mesh = make_mesh(shape="data=1,fsdp=1")
    assert mesh.axis_names == ("data", "fsdp")
    # a tensor axis brings an expert axis of 1 along: the sizes stay positional (sharding.AXES)
    assert mesh_shape("tensor=2", 8) == (4, 1, 1, 2)
    assert mesh_shape("fsdp=2,tensor=2", 8) == (2, 2, 1, 2)
    with pytest.raises(ValueError, match="data x fsdp x expert x tensor = 2 x 1 x 1 x 2 = 4 devices, but 8"):
        mesh_shape("data=2,tensor=2", 8)
    with pytest.raises(ValueError, match="tensor=3 does not divide the 8 devices"):
        mesh_shape("tensor=3", 8)
    # so does a context axis, and the axes between
    assert mesh_shape("context=2", 8) == (4, 1, 1, 1, 2)
    assert mesh_shape("fsdp=2,context=2", 8) == (2, 2, 1, 1, 2)
    assert make_mesh(shape="context=1").axis_names == ("data", "fsdp", "expert", "tensor", "context")


def test_leaf_spec_picks_the_largest_divisible_dimension():
    P = leaf_spec
    assert tuple(P((12, 768, 3072), 4)) == (None, None, "fsdp")
    assert tuple(P((256, 16), 4)) == ("fsdp",)
    assert tuple(P((3, 10), 4)) == ()  # nothing divides: replicated
    assert tuple(P((2, 16, 16), 8)) == (None, "fsdp")  # equal sizes: the first
    assert tuple(P((), 4)) == ()
    assert tuple(P((256, 16), 1)) == ()
