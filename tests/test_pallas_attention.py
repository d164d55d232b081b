"""attention_impl "pallas": the flash-attention kernels (jaxformer/kernels/pallas/forward.py,
backward.py) run in interpret mode on CPU and equal the full layer in float64,
forward and gradients, to 1e-10, grouped-query k, v (G = 1, 2, H) against repeated ones,
and with the GPU's and TPU's own tiles; the whole model's manual and autodiff gradients
with them equal the full model's; bfloat16 stays within autodiff's error; the kernel
follows the platform exported for (Triton on cuda, Mosaic on tpu, interpret on cpu) and
compiles for a TPU v5e topology when jax[tpu] is installed; cudnn off a GPU or in the
manual source is refused by name. Shapes are tiny (interpret mode compiles slowly):
T <= 40, D = 16, Dh = 8."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_params as make
from helpers import auto_vg, dot_generals, leaf_rels, make_batch, make_params, manual_vg

import jaxformer
import manual_grads
from jaxformer.kernels.pallas import forward as pa
from jaxformer.kernels.pallas import backward as pb
from jaxformer.kernels.pallas import entry as pe
from jaxformer.kernels.pallas import tiling as pt
from jaxformer.model.attention import attention
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec, full
from jaxformer.tools.aot.targets import TARGETS, compiling_for
from jaxformer.tools.compare import grads as compare
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from manual_grads.attention import attention_bwd, attention_fwd

D, H, T = 16, 2, 37  # Dh = 8; T = 37 is a multiple of neither block below
BLOCKS = (16, 8)  # (block_q, block_k): 3 query blocks, 5 key blocks, both last ones padded


def full_core(q, k, v, causal):
    return full(q, k, v, AttentionSpec(causal=causal))


def qkv_do(seed, T, B=2, Dh=8):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, Dh))) for _ in range(4))


def repeat_kv(k, G):
    """(B, Hkv, T, Dh) -> (B, Hkv * G, T, Dh): query head h reads key/value head h // G."""
    return jnp.repeat(k, G, axis=1)


@functools.partial(jax.jit, static_argnums=(4, 5))
def manual_core(q, k, v, do, causal, blocks):
    out, res = pe.flash_core_fwd(q, k, v, causal, *blocks)
    return out, res, pe.flash_core_bwd(res, do)


@functools.partial(jax.jit, static_argnums=4)
def full_core_vjp(q, k, v, do, causal):
    """The reference: k, v repeated to q's heads, full softmax attention, jax.vjp of it
    (the gradients of k, v sum over the G heads that read them)."""
    G = q.shape[1] // k.shape[1]
    out, vjp = jax.vjp(lambda q, k, v: full_core(q, repeat_kv(k, G), repeat_kv(v, G), causal), q, k, v)
    return out, vjp(do)


def gqa_inputs(seed, T, H=4, Hkv=2, B=1, Dh=8):
    """q, dO (B, H, T, Dh) and k, v (B, Hkv, T, Dh), float64."""
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((B, H, T, Dh))) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, Hkv, T, Dh))) for _ in range(2))
    return q, k, v, do


# ---------------------------------------------------------------------------- the core


@pytest.mark.parametrize("T,causal", [(T, True), (T, False), (1, True)])
def test_core_equals_full_attention(T, causal):
    """Forward, lse and the three backward kernels against the full core and jax.vjp of it."""
    q, k, v, do = qkv_do(0, T)
    out, res, grads = manual_core(q, k, v, do, causal, BLOCKS)
    out_ref, grads_ref = full_core_vjp(q, k, v, do, causal)
    np.testing.assert_allclose(out, out_ref, rtol=1e-13, atol=1e-13)
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(8)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    np.testing.assert_allclose(res.lse, jax.nn.logsumexp(s, axis=-1), rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)
    assert isinstance(res, pe.CausalFlashRes) == causal
    assert out.dtype == res.lse.dtype == jnp.float64


@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["G1", "G2", "MQA"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_grouped_query_core_equals_repeated_full_attention(Hkv, causal):
    """k, v with Hkv of the 4 query heads (G = 1, 2, 4): the kernels read key/value head
    h // G without repeating it; output and dq equal full attention on repeated k, v,
    and dk, dv (B, Hkv, T, Dh) its gradients, summed over each group (float64, T = 37)."""
    q, k, v, do = gqa_inputs(2, T, Hkv=Hkv)
    out, res, grads = manual_core(q, k, v, do, causal, BLOCKS)
    out_ref, grads_ref = full_core_vjp(q, k, v, do, causal)
    np.testing.assert_allclose(out, out_ref, rtol=1e-13, atol=1e-13)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_trees_close(grads_ref, grads, rtol=1e-10)


def test_grouped_query_custom_vjp_returns_key_value_head_gradients():
    """jax.grad through flash_attention (the model's path): dk, dv have Hkv heads."""
    q, k, v, do = gqa_inputs(3, 21, Hkv=1)
    f = jax.jit(lambda q, k, v: jnp.vdot(pe.flash_attention(q, k, v, True, 8, 8), do))
    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    _, grads_ref = full_core_vjp(q, k, v, do, True)
    assert grads[1].shape == (1, 1, 21, 8)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


@pytest.mark.parametrize("shapes", [((1, 4, 8, 8), (1, 3, 8, 8)), ((1, 4, 8, 8), (1, 2, 9, 8))])
def test_heads_that_do_not_group_are_refused(shapes):
    q, k = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match="H a multiple of Hkv; got q"):
        pe.flash_attention(q, k, k, True)


def test_residuals_never_hold_the_probabilities():
    """What the backward keeps: q, k, v (unpadded: each platform pads to its own tiles), O
    and lse, nothing (T, T); the requested block sizes are read back from the shapes."""
    q, k, v, _ = gqa_inputs(0, T)
    _, res = jax.eval_shape(lambda q, k, v: pe.flash_core_fwd(q, k, v, True, *BLOCKS), q, k, v)
    assert res.q.shape == res.out.shape == (1, 4, T, 8) and res.k.shape == res.v.shape == (1, 2, T, 8)
    assert res.lse.shape == (1, 4, T) and pe.res_blocks(res) == BLOCKS


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def core_on(q, k, v, do, device, blocks, interpret):
    """One platform's forward and backward, launched in interpret mode here."""
    options = dict(causal=True, block_q=blocks[0], block_k=blocks[1], interpret=interpret)
    out, lse = pa.forward_on(device, q, k, v, **options)
    return out, pb.backward_on(device, q, k, v, out, lse, do, **options)


@pytest.mark.parametrize("device,blocks,interpret", [
    ("gpu", (16, 32), True),  # Triton's tiles: powers of two >= 16, Dh 8 padded to 16
    ("tpu", (16, 8), True),  # Mosaic's: multiples of 8, Dh whole
    ("tpu", (16, 8), "tpu-interpreter"),  # pltpu's TPU interpreter, with the Mosaic compiler params
], ids=["gpu", "tpu", "tpu-interpreter"])
def test_other_platforms_tiles_in_interpret_mode(device, blocks, interpret):
    """The GPU and TPU branches' own tiles and launches, run in interpret mode on CPU in
    float64 with grouped heads (G = 2): the same numbers as the full core."""
    from jax.experimental.pallas import tpu as pltpu
    interpret = pltpu.InterpretParams() if interpret == "tpu-interpreter" else interpret
    q, k, v, do = gqa_inputs(1, T)
    out, grads = core_on(q, k, v, do, device, blocks, interpret)
    out_ref, grads_ref = full_core_vjp(q, k, v, do, True)
    np.testing.assert_allclose(out, out_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


def test_tiling_per_device():
    assert pt.tiling(T, 8, 16, 32, "gpu") == pt.Tiling(T, 16, 32, 3, 2, 8, 16)
    assert pt.tiling(5, 8, 0, 0, "gpu")[1:3] == (16, 16)  # short T: one 16-tile
    assert pt.tiling(T, 8, 16, 8, "tpu") == pt.Tiling(T, 16, 8, 3, 5, 8, 8)
    assert pt.tiling(5, 64, 0, 0, "tpu")[1:3] == (8, 8)  # short T: rounded up to 8 rows


def test_block_sizes_default_per_device():
    assert pt.tiling(200, 64, 0, 0, "gpu")[1:3] == pt.DEFAULT_BLOCKS["gpu"] == (64, 64)
    assert pt.tiling(200, 64, 0, 0, "tpu")[1:3] == pt.DEFAULT_BLOCKS["tpu"] == (128, 128)
    assert pt.tiling(200, 64, 0, 0, "cpu")[1:3] == pt.DEFAULT_BLOCKS["cpu"] == (128, 128)
    assert pt.tiling(200, 64, 32, 0, "cpu")[1:3] == (32, 128)


@pytest.mark.parametrize("block", [12, 24, 8])
def test_gpu_tiles_must_be_powers_of_two(block):
    with pytest.raises(ValueError, match="ModelConfig.pallas_block_q must be a power of two >= 16"):
        pt.tiling(T, 8, block, 64, "gpu")


@pytest.mark.parametrize("block", [4, 12, 100])
def test_tpu_tiles_must_be_multiples_of_eight(block):
    with pytest.raises(ValueError, match=f"ModelConfig.pallas_block_k must be a multiple of 8 on a TPU.*got {block}"):
        pt.tiling(T, 8, 8, block, "tpu")


# ---------------------------------------------------------------------------- the platform lowered for

EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
                 jax.export.DisabledSafetyCheck.custom_call("tpu_custom_call")]
KERNEL_CALLS = {"triton": "@__gpu$xla.gpu.triton", "mosaic": "@tpu_custom_call"}


def exported(platform, blocks=(0, 0)):
    """The StableHLO of jax.value_and_grad through flash_attention (GQA, G = 2), exported
    from this CPU process for ``platform``."""
    def loss(q, k, v):
        return pe.flash_attention(q, k, v, True, *blocks).sum()
    q, k = jax.ShapeDtypeStruct((1, 4, 40, 8), jnp.float32), jax.ShapeDtypeStruct((1, 2, 40, 8), jnp.float32)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with compiling_for(TARGETS["h100" if platform == "cuda" else "tpu-v5e"]):
        return jax.export.export(f, platforms=[platform], disabled_checks=EXPORT_CHECKS)(q, k, k).mlir_module()


@pytest.mark.parametrize("platform,triton,mosaic", [("cuda", 4, 0), ("tpu", 0, 4), ("cpu", 0, 0)])
def test_the_kernel_follows_the_platform_exported_for(platform, triton, mosaic):
    """The same traced program, exported from CPU: for cuda the four kernels (forward,
    delta, dK/dV, dQ) are Triton custom calls, for tpu Mosaic ones, for cpu the
    interpreted loops (no custom call)."""
    text = exported(platform)
    assert text.count(KERNEL_CALLS["triton"]) == triton and text.count(KERNEL_CALLS["mosaic"]) == mosaic
    assert ("stablehlo.while" in text) == (platform == "cpu")


def test_blocks_a_platform_cannot_take_fail_only_its_lowering():
    """pallas_block_q 24: fine on CPU and TPU (a multiple of 8), not a power of two for
    Triton: the cuda export fails naming the field and value; the others lower."""
    assert exported("cpu", (24, 8)) and exported("tpu", (24, 8)).count(KERNEL_CALLS["mosaic"]) == 4
    with pytest.raises(ValueError, match="ModelConfig.pallas_block_q must be a power of two >= 16 "
                                         "on a GPU \\(Triton's tiles\\), got 24"):
        exported("cuda", (24, 8))


TPU_COMPILE = """
import json, sys, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from jaxformer.kernels.pallas import flash_attention
device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
def loss(q, k, v):
    return flash_attention(q, k, v, True).astype(jnp.float32).sum()
times = {}
for dtype, Hkv in (("float32", 2), ("bfloat16", 1)):
    q, k = (jax.ShapeDtypeStruct((2, 4, 200, 64), dtype, sharding=SingleDeviceSharding(device)),
            jax.ShapeDtypeStruct((2, Hkv, 200, 64), dtype, sharding=SingleDeviceSharding(device)))
    start = time.perf_counter()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
    times[dtype] = [round(time.perf_counter() - start, 2), text.count("tpu_custom_call")]
print(json.dumps(times))
"""


def test_forward_and_backward_compile_for_a_tpu():
    """Mosaic compiles the four kernels for a TPU v5e topology from this CPU machine
    (libtpu's real compiler; float32 with G = 2, bfloat16 MQA, T = 200 not a multiple
    of the 128 block). Needs jax[tpu]; run in a subprocess, so the TPU plugin stays out
    of this one."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jax[tpu]'): the TPU compile check needs it")
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", TPU_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    times = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(calls >= 4 for _, calls in times.values()), times


# ---------------------------------------------------------------------------- the layer


LAYER = ModelConfig(d_model=D, n_heads=H)  # the full core; causal


@functools.partial(jax.jit, static_argnums=(3, 4))
def layer_vjp(p, x, dy, layer, config=LAYER):
    y, vjp = jax.vjp(lambda p, x: layer(p, x, config), p, x)
    return y, vjp(dy)


def test_custom_vjp_drop_in_equals_the_full_layer():
    """manual_grads.custom_vjp.attention with the pallas core: JAX's grad through it runs the
    manual backward; output and gradients equal the full layer's."""
    p, x, dy = make(2, 2, T, D)
    y_ref, grads_ref = layer_vjp(p, x, dy, attention)
    pallas = LAYER.replace(attention_impl="pallas", pallas_block_q=BLOCKS[0], pallas_block_k=BLOCKS[1])
    y, grads = layer_vjp(p, x, dy, cv.attention, pallas)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


# ---------------------------------------------------------------------------- the model

MODEL = ModelConfig(vocab_size=24, d_model=D, n_heads=H, n_layers=2, d_ff=24, max_seq_len=40,
                    attention_impl="pallas", pallas_block_q=BLOCKS[0], pallas_block_k=BLOCKS[1])


@pytest.mark.parametrize("options,sources", [
    (dict(norm="pre"), (manual_vg, auto_vg)),
    (dict(norm="post", causal=False, remat="block", loss_chunk=16), (manual_vg,)),
], ids=["pre", "post-bidirectional-remat-chunked"])
def test_model_gradients_equal_the_full_model(options, sources):
    """manual_grads.value_and_grad with impl "pallas" (and, pre-norm, jax.grad(loss_fn),
    through the model's custom_vjp), under a loss mask, equals jax.grad of the same model
    with full attention; post-norm, bidirectional, beside block recompute and the chunked loss."""
    config = MODEL.replace(**options)
    params = make_params(config, jnp.float64)
    batch = make_batch(config, 2, T, "mostly_zero")
    plain = config.replace(attention_impl="full", remat="none", loss_chunk=0)
    loss_ref, grads_ref = auto_vg(params, batch, plain)
    for vg in sources:
        loss, grads = vg(params, batch, config)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-12)
        assert_trees_close(grads_ref, grads)


def f32(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


@jax.jit
def pallas_manual_bf16(p, x, dy):
    config = LAYER.replace(attention_impl="pallas", pallas_block_q=8, pallas_block_k=8,
                           compute_dtype="bfloat16")
    y, res = attention_fwd(p, x, config)
    return y, attention_bwd(res, dy)


def kernel_dots(jaxpr):
    """The dot_generals inside the pallas_calls of a jaxpr."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield from dot_generals(eqn.params["jaxpr"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") and eqn.primitive.name != "pallas_call":
                    yield from kernel_dots(getattr(sub, "jaxpr", sub))


def test_bfloat16_manual_error_is_within_autodiff_error():
    """compute_dtype bfloat16, judged as compare-grads judges it: against the float32
    reference (the full layer, no compute dtype), each gradient leaf of the pallas layer's
    manual backward is at most compare.MIXED_FACTOR times as far as JAX's grad of the
    same online softmax (the blockwise layer) is. (The key bias's true gradient is 0, so
    its error is round-off measured against the floor; the full layer's autodiff, whose
    dS rows sum to 0 more exactly, puts it up to 2 times closer.)"""
    p, x, dy = f32(make(4, 2, 21, D))
    _, ref = layer_vjp(p, x, dy, attention)
    blockwise = LAYER.replace(attention_impl="blockwise", attention_block=8, compute_dtype="bfloat16")
    y_a, grads_a = layer_vjp(p, x, dy, attention, blockwise)
    y_m, grads_m = pallas_manual_bf16(p, x, dy)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads_m)} == {jnp.dtype("float32")}
    err_m, err_a = leaf_rels(ref, grads_m), leaf_rels(ref, grads_a)
    for path in err_a:
        assert compare.mixed_precision_passed(err_m[path], err_a[path]), (path, err_m[path], err_a[path])
    assert 1e-4 < err_m["[1]"] < 0.1  # dx: bfloat16 ran
    np.testing.assert_allclose(y_m, y_a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("source", ["manual", "auto"])
def test_kernels_follow_the_configured_compute_dtype(source):
    """Both gradient sources hand config.compute_dtype to the kernels: every product in
    the forward and backward kernels, in every platform's branch, reads bfloat16 and
    accumulates in float32."""
    config = MODEL.replace(n_layers=1, compute_dtype="bfloat16")
    params = make_params(config, jnp.float32)
    batch = make_batch(config, 2, 21, None)
    vg = manual_grads.value_and_grad if source == "manual" else jax.value_and_grad(jaxformer.loss_fn)
    dots = list(kernel_dots(jax.make_jaxpr(vg, static_argnums=2)(params, batch, config).jaxpr))
    # per platform branch: forward: q k^T, P v; dK/dV: q k^T, dO v^T, P^T dO, dS^T q; dQ: q k^T,
    # dO v^T, dS k; two branches take blocks (16, 8), cpu and tpu (Triton's refuses 8)
    assert len(dots) == 2 * 9
    for eqn in dots:
        assert [a.aval.dtype for a in eqn.invars] == [jnp.bfloat16] * 2, eqn
        assert eqn.outvars[0].aval.dtype == jnp.float32, eqn


# ---------------------------------------------------------------------------- refusals


def test_cudnn_is_refused_by_name(monkeypatch):
    config = MODEL.replace(attention_impl="cudnn", compute_dtype="bfloat16")
    params = make_params(config, jnp.float32)
    batch = make_batch(config, 1, 4, None)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' runs only on a GPU.*'cpu'"):
        jaxformer.loss_fn(params, batch, config)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' runs only on a GPU.*'cpu'"):
        manual_grads.value_and_grad(params, batch, config)  # cuDNN's kernels in the hand-derived step
    with pytest.raises(ValueError, match="ModelConfig.attention_impl 'cudnn' cannot run with compute_dtype"):
        config.replace(compute_dtype="float32")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="attention_impl 'cudnn' needs bfloat16 or float16 products, "
                                         "not float32"):
        jaxformer.loss_fn(params, batch, config.replace(compute_dtype=None))


@pytest.mark.parametrize("field", ["pallas_block_q", "pallas_block_k"])
@pytest.mark.parametrize("value", [-1, 2.0, True, "8"])
def test_block_fields_are_checked_by_name(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be a non-negative integer"):
        MODEL.replace(**{field: value})
