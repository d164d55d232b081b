"""The norms' Pallas kernels (jaxformer/kernels/pallas/norm.py) in interpret mode, against the
code they replace on a GPU: the model's row scale, manual_grads' layer norm and RMS norm
forward and backward, and (manual_grads/norms.py) the whole hand-derived step. Float64 and
float32; the kernels' Triton lowering is compiled for an H100 in tests/test_aot.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer import get_preset, init_params
from jaxformer.data.batching import random_batch
from jaxformer.kernels.pallas import norm as K
from jaxformer.model.layer_norm import row_scale
from manual_grads import model as manual_model
from manual_grads import norms
from manual_grads.check import assert_trees_close
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd
from manual_grads.rms_norm import rms_norm_bwd, rms_norm_fwd

# the norms the kernels take: (name, rms, scale, bias, offset)
KINDS = {
    "layer": (False, True, True, 0.0),
    "layer-nobias": (False, True, False, 0.0),
    "rms": (True, True, False, 0.0),
    "rms-offset": (True, True, False, 1.0),
    "rms-noscale": (True, False, False, 0.0),
}
TOL = {jnp.float64: 1e-12, jnp.float32: 2e-6}  # the two sides sum a row in different orders


def edge_values(dtype):
    """Values whose row scale takes every path: zero, subnormal, below and at 1, powers of two
    and their neighbours, the largest finite value, and the non-finite ones."""
    info = jnp.finfo(dtype)
    powers = [2.0 ** k for k in range(-3, int(info.maxexp))]
    v = [0.0, float(info.smallest_subnormal), float(info.tiny), 0.3, 0.5, 0.999, 1.0, 1.5, 3.0,
         float(info.max), np.inf, -np.inf, np.nan]
    v += powers + [np.nextafter(p, 0.0, dtype=np.dtype(dtype)) for p in powers] + [-p * 1.25 for p in powers[:40]]
    return jnp.asarray(v, dtype)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_row_scale_from_bits_is_the_models(dtype):
    """The kernels build s from the bits of a row's max (Triton has no frexp): bit for bit the
    model's row_scale, for a row of each edge value and for rows of two."""
    v = edge_values(dtype)
    for x in (v[:, None], jnp.stack([v, jnp.roll(v, 7)], axis=1)):
        top = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        bad = ~jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)
        got = jax.jit(K.row_scale, static_argnums=2)(top, bad, dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(row_scale(x)))


def rows(dtype, D, seed=0):
    """x (3, 8, D): rows of every size the row scale handles (huge, tiny, zero, a non-finite
    one), scale and bias (D,), dy and a skip gradient (3, 8, D)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (3, 8, D), dtype) * 2.0 + 0.5
    big = 1e200 if dtype == jnp.float64 else 1e30
    x = x.at[0, 1].multiply(big).at[0, 2].multiply(1e-30).at[1, 3].set(0.0).at[2, 4, 5].set(jnp.inf)
    scale = 1.0 + 0.3 * jax.random.normal(k[1], (D,), dtype)
    return x, scale, 0.1 * jax.random.normal(k[2], (D,), dtype), jax.random.normal(k[3], x.shape, dtype), \
        jax.random.normal(k[4], x.shape, dtype)


def reference_fwd(kind, x, scale, bias):
    rms, has_scale, has_bias, offset = KINDS[kind]
    if rms:
        return rms_norm_fwd({"scale": scale} if has_scale else {}, x, 1e-5, offset)
    return layer_norm_fwd({"scale": scale, "bias": bias} if has_bias else {"scale": scale}, x, 1e-5)


def kernel_fwd(kind, x, scale, bias, **dtypes):
    rms, has_scale, has_bias, offset = KINDS[kind]
    return K.norm_forward(x, scale if has_scale else None, bias if has_bias else None, eps=1e-5, rms=rms,
                          offset=offset, interpret=True, **dtypes)


def close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_forward_is_the_models(dtype, kind):
    """y, the normalized input and rstd of every row (a non-finite row: NaN where the model's is);
    rows of 48 features (3 chunks of 16) for layer norm, of 40 (5 chunks of 8) for RMS norm."""
    x, scale, bias, _, _ = rows(dtype, 40 if KINDS[kind][0] else 48)
    y0, res = reference_fwd(kind, x, scale, bias)
    y, xhat, rstd = jax.jit(functools.partial(kernel_fwd, kind))(x, scale, bias)
    assert y.dtype == y0.dtype and xhat.dtype == res.xhat.dtype and rstd.dtype == res.rstd.dtype
    close(y, y0, TOL[dtype])
    close(xhat, res.xhat, TOL[dtype])
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(res.rstd), rtol=TOL[dtype])  # 1e-200 to 316


@pytest.mark.parametrize("kind", ["layer", "rms-noscale"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_forward_of_the_residual_sum(dtype, kind):
    """Given the branch and its bias (``add``, ``add_bias``), the forward writes the residual
    stream's sum x + (branch + bias) bit for bit as the model computes it, and the norm of that
    sum bit for bit as the kernel normalizes the sum given whole; without a bias, x + branch."""
    x, scale, bias, branch, _ = rows(dtype, 48, seed=4)
    b = 0.7 * bias[::-1]
    for add_bias, want in ((b, x + (branch + b)), (None, x + branch)):
        y0, xhat0, rstd0 = jax.jit(functools.partial(kernel_fwd, kind))(want, scale, bias)
        y, xhat, rstd, s = jax.jit(functools.partial(kernel_fwd, kind))(x, scale, bias, add=branch,
                                                                        add_bias=add_bias)
        assert s.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want))  # NaN where the sum's is
        for got, ref in ((y, y0), (xhat, xhat0), (rstd, rstd0)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_forward_writes_the_dtypes_asked():
    """y and the kept input in bfloat16 (a product's input and a bfloat16 policy's residual):
    the float32 values rounded once, so within half a bfloat16 step of them."""
    x, scale, bias, _, _ = rows(jnp.float32, 48)
    x = x.at[0, 1].set(x[0, 0]).at[2, 4, 5].set(1.0)  # finite rows
    y32, xhat32, _ = kernel_fwd("layer", x, scale, bias)
    y, xhat, _ = kernel_fwd("layer", x, scale, bias, y_dtype=jnp.bfloat16, kept_dtype=jnp.bfloat16)
    assert y.dtype == xhat.dtype == jnp.bfloat16
    for got, want in ((y, y32), (xhat, xhat32)):
        step = jnp.abs(want) * 2.0 ** -8 + 1e-30  # a bfloat16 step at |want| is at most |want| 2^-7
        assert bool(jnp.all(jnp.abs(got.astype(jnp.float32) - want) <= step)), "more than half a step off"


@pytest.mark.parametrize("skip", [False, True], ids=["alone", "skip"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_backward_is_the_manual_backward(dtype, kind, skip):
    """dx (plus the skip connection's gradient) and the column sums (dscale, dbias) against
    manual_grads' backward, from the forward's own residual; rows finite."""
    rms, has_scale, has_bias, offset = KINDS[kind]
    x, scale, bias, dy, g = rows(dtype, 48, seed=1)
    x = x.at[2, 4, 5].set(1.0)
    _, res = reference_fwd(kind, x, scale, bias)
    dp, dx0 = (rms_norm_bwd if rms else layer_norm_bwd)(res, dy)
    w = None if not has_scale else (scale if not offset else offset + scale)

    @jax.jit
    def kernel(dy, xhat, rstd, g):
        return K.norm_backward(dy, xhat, rstd, w, rms=rms, skip=g if skip else None, interpret=True)

    dx, dscale, dbias = kernel(dy, res.xhat, res.rstd, g)
    assert dscale.shape == dbias.shape and dscale.shape[1] == 48
    close(dx, dx0 + g if skip else dx0, TOL[dtype] * float(jnp.max(jnp.abs(dx0))))
    if has_scale:
        close(dscale.sum(axis=0), dp["scale"], TOL[dtype] * 24)
    if has_bias:
        close(dbias.sum(axis=0), dp["bias"], TOL[dtype] * 24)


def test_backward_reads_a_bfloat16_gradient_in_float32():
    """A product's bfloat16 input cotangent and a bfloat16 kept input: the kernel computes in
    float32, as manual_grads' backward does (it upcasts dy first)."""
    x, scale, bias, dy, _ = rows(jnp.float32, 48, seed=2)
    x = x.at[2, 4, 5].set(1.0)
    _, res = reference_fwd("layer", x, scale, bias)
    res = res._replace(xhat=res.xhat.astype(jnp.bfloat16))
    dy = dy.astype(jnp.bfloat16)
    dp, dx0 = layer_norm_bwd(res, dy)
    dx, dscale, dbias = K.norm_backward(dy, res.xhat, res.rstd, scale, rms=False, interpret=True)
    assert dx.dtype == jnp.float32
    close(dx, dx0, TOL[jnp.float32] * float(jnp.max(jnp.abs(dx0))))
    close(dscale.sum(axis=0), dp["scale"], TOL[jnp.float32] * 24)
    close(dbias.sum(axis=0), dp["bias"], TOL[jnp.float32] * 24)


@pytest.mark.parametrize("skip", [False, True], ids=["alone", "skip"])
def test_backward_writes_the_next_products_copy_and_sums(skip):
    """Asked for them, the backward also writes dx's bfloat16 copy (the next products' input:
    dx rounded, bit for bit) and each program's column sums of dx (the next bias's gradient),
    beside the same dx and sums as without them."""
    x, scale, bias, dy, g = rows(jnp.float32, 48, seed=3)
    x = x.at[2, 4, 5].set(1.0)
    _, res = reference_fwd("layer", x, scale, bias)
    args = (dy, res.xhat, res.rstd, scale)
    kw = dict(rms=False, skip=g if skip else None, interpret=True)
    dx0, dscale0, dbias0 = K.norm_backward(*args, **kw)
    dx, dscale, dbias, narrow, sums = K.norm_backward(*args, narrow_dtype=jnp.bfloat16, dx_sums=True, **kw)
    for got, want in ((dx, dx0), (dscale, dscale0), (dbias, dbias0)):
        assert bool(jnp.all(got == want))
    assert narrow.dtype == jnp.bfloat16 and bool(jnp.all(narrow == dx.astype(jnp.bfloat16)))
    assert sums.shape == dscale.shape
    close(sums.sum(axis=0), dx.reshape(-1, 48).astype(jnp.float64).sum(axis=0), TOL[jnp.float32] * 24)
    only_sums = K.norm_backward(*args, dx_sums=True, **kw)
    assert len(only_sums) == 4 and bool(jnp.all(only_sums[3] == sums))


def kernels_everywhere(monkeypatch):
    """manual_grads/norms.py's GPU branch on this CPU: the kernels in interpret mode, for
    float64 inputs and full attention too (a GPU takes them for float32 statistics, beside
    the attention's kernels)."""
    monkeypatch.setattr(norms, "_kernels", lambda config, dtype: True)
    monkeypatch.setattr(norms, "norm_forward", functools.partial(K.norm_forward, interpret=True))
    monkeypatch.setattr(norms, "norm_backward", functools.partial(K.norm_backward, interpret=True))
    monkeypatch.setattr(norms, "_on_gpu", lambda kernel, xla, *args, after=lambda *o: o: after(*kernel(*args)))


@pytest.mark.parametrize("preset,changes", [
    ("tiny", {}),  # GPT-2's block: layer norms with biases before each sublayer, and ln_f
    ("tiny", {"norm_type": "rms", "norm": "sandwich", "norm_offset": 1.0, "mlp": "gated", "activation": "gelu",
              "positions": "rope", "bias": False, "tie_embeddings": True}),  # Gemma's: four norms a block
    ("tiny", {"norm": "post"}),  # the residual stream's own norms, no skip to fuse
], ids=["gpt2", "gemma", "post"])
def test_manual_step_with_the_kernels_is_the_xla_one(monkeypatch, preset, changes):
    """The hand-derived loss and gradients of a 2-layer model in float64, its norms as on a GPU
    (the kernels, the skip connection's gradient added in the backward's pass) against the
    norms as on this CPU: every leaf within float64's gradient tolerance."""
    config = get_preset(preset, n_layers=2, **changes)
    params = init_params(jax.random.PRNGKey(0), config, dtype=jnp.float64)
    batch = random_batch(config, 2, 16, 0)
    loss0, grads0 = jax.jit(functools.partial(manual_model.value_and_grad, config=config))(params, batch)
    kernels_everywhere(monkeypatch)  # a new function to trace (jit's cache is by function)
    loss, grads = jax.jit(functools.partial(manual_model.value_and_grad, config=config))(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-12 * abs(float(loss0))
    assert_trees_close(grads0, grads)


def test_the_kernels_lower_for_cuda_inside_shard_map():
    """Inside a user's jax.shard_map (its check of varying axes on), both kernels lower for cuda:
    their outputs vary over the mesh axes their row input does, as shard_map's check asks of a
    kernel's outputs."""
    mesh = jax.make_mesh((1,), ("context",))

    def f(x, w):
        y, xhat, rstd = K.norm_forward(x, w, None, eps=1e-5, rms=True)
        return K.norm_backward(y, xhat, rstd, w, rms=True, skip=x)[0]

    rows, whole = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P())
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "context"), P()), out_specs=P(None, "context")))
    args = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32, sharding=rows), jax.ShapeDtypeStruct((32,), jnp.float32,
                                                                                                 sharding=whole)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(g, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    assert text.count("@__gpu$xla.gpu.triton") == 2
