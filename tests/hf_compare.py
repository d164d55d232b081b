"""What the Hugging Face family tests share: the small shape, a random batch, random models
and folders, transformers' models run in float64 end to end, and the float64 comparisons
against transformers' logits and torch autograd's gradients.

transformers computes its RMS norms and rotary tables in float32 whatever the model's dtype:
``float64_model`` runs them in float64, the same formulas with the module's own weight, eps
and theta (the rotary base per layer type where the config has several; linear scaling's
frequencies divided by its factor), and attention through SDPA, which keeps float64 (or the
eager attention a test patches in). Unpatched, the two agree to ~1e-7, float32's round-off."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from helpers import FORWARD, auto_vg, manual_vg

from jaxformer.formats.hf import FORMATS, hf_format, read_hf, write_hf
from jaxformer.tools.compare.hf_random import random_hf_model
from manual_grads.check import assert_trees_close

V, D, H, L, F, S = 64, 16, 4, 2, 24, 32  # vocab, width, heads, layers, d_ff, max positions
B, T = 2, 11


GRAD_FNS = {"jax.grad": auto_vg, "manual": manual_vg}  # jitted (helpers.py)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)}


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, np.int64))).logits.numpy()


def assert_logits_equal(ours, ref, rtol=1e-10):
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def assert_forward_matches(model, folder, params, config):
    """Our logits of a batch equal the Hugging Face model's (1e-10 of the largest), printed."""
    b = batch()
    ours, ref = np.asarray(FORWARD(params, b["inputs"], config)), torch_logits(model, b["inputs"])
    print(f"\n{folder.name}: logits max |diff| / max |ref| {np.abs(ours - ref).max() / np.abs(ref).max():.1e}")
    assert_logits_equal(ours, ref)


def random_folder(folder, model_class, hf_config, seed=0, **random):
    """``folder`` holding a random_hf_model of transformers' ``model_class`` (random: its
    norm_center and router_scale), saved."""
    random_hf_model(model_class, hf_config, seed, **random).save_pretrained(folder)
    return folder


def default_rope(module, rope, dim):
    """(inv_freq, attention factor) in float64 of the default rotary, or of linear scaling."""
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return (inv_freq / rope["factor"] if rope["rope_type"] == "linear" else inv_freq), 1.0


def float64_model(model_class, folder, offset=False, rope=default_rope, patches=(), attn="sdpa", **kwargs):
    """transformers' ``model_class`` from ``folder`` in float64, its RMS norms ((1 + w) with
    ``offset``) and rotary tables (``rope(module, rope_parameters, dim) -> (inv_freq, factor)``)
    in float64, and each module whose class name ends with a suffix in ``patches`` ((suffix,
    forward) pairs) run by that forward."""
    def rms_norm(self, x):
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return xhat * (1.0 + self.weight) if offset else self.weight * xhat

    def rotary(self, x, position_ids, layer_type=None):
        params = self.config.rope_parameters
        inv_freq = getattr(self, f"{layer_type}_inv_freq" if layer_type else "inv_freq")
        inv_freq, scale = rope(self, params[layer_type] if layer_type else params, 2 * inv_freq.shape[0])
        angle = position_ids[..., None].double() * inv_freq
        angle = torch.cat((angle, angle), dim=-1)
        return (angle.cos() * scale).to(x.dtype), (angle.sin() * scale).to(x.dtype)

    model = getattr(transformers, model_class).from_pretrained(folder, attn_implementation=attn, **kwargs)
    model = model.double().eval()
    for module in model.modules():
        for suffix, forward in (("RMSNorm", rms_norm), ("RotaryEmbedding", rotary), *patches):
            if type(module).__name__.endswith(suffix):
                module.forward = types.MethodType(forward, module)
    return model


def copy_folder(tmp_path, folder, name, config=None, tensors=None):
    """A copy of the saved ``folder`` as tmp_path/name, config.json and tensors edited."""
    from safetensors.numpy import load_file, save_file
    out = tmp_path / name
    out.mkdir()
    hf = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    t = load_file(str(folder / "model.safetensors"))
    save_file(tensors(t) if tensors else t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def assert_export_reloads(tmp_path, params, config, kind, model_class, reload):
    """A "trained" copy of ``params`` (times 1.01) exports as family ``kind`` (config.json's
    model_type and architectures [model_class]); ``reload(folder)`` (transformers' model of the
    export) gives its logits to the float32 file's round-off (1e-4) and the export read back in
    float64 the same config and the same logits to 1e-10. Returns (trained params, reloaded
    model, export folder)."""
    params = jax.tree_util.tree_map(lambda a: a * 1.01, params)
    assert hf_format(config) == kind
    out, written = write_hf(tmp_path / "out", params, config)
    hf = json.loads((out / "config.json").read_text())
    assert written == hf["model_type"] == kind and hf["architectures"] == [model_class]
    back = reload(out)
    b = batch(2)
    ref = torch_logits(back, b["inputs"])
    assert_logits_equal(np.asarray(FORWARD(params, b["inputs"], config)), ref, rtol=1e-4)  # float32 file
    again, config2 = read_hf(out, np.float64)
    assert config2 == config
    assert_logits_equal(np.asarray(FORWARD(again, b["inputs"], config)), ref)
    return params, back, out


def torch_reference(model, config, b):
    """(loss, grads mapped to our tree) of torch autograd through the Hugging Face model."""
    model.zero_grad()
    logits = model(torch.tensor(np.asarray(b["inputs"], np.int64))).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(np.asarray(b["targets"], np.int64)).reshape(-1))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), FORMATS[model.config.model_type].params_from_hf(grads, config, np.float64, "torch grads")


def assert_grads_match_torch(model, folder, source):
    """The folder read in float64: the loss of ``source`` ("jax.grad" or "manual") equals torch
    autograd's to 1e-12 and every gradient leaf to 1e-10 (a tied tok_embed holds embedding + head)."""
    params, config = read_hf(folder, np.float64)
    b = batch(1)
    rows = assert_grads_equal(params, b, config, source, *torch_reference(model, config, b))
    worst = max(rows, key=lambda r: r.rel)
    print(f"\n{folder.name} {source}: worst leaf {worst.path} relative {worst.rel:.1e}")


def assert_grads_equal(params, b, config, source, ref_loss, ref):
    """The loss of ``source`` ("jax.grad" or "manual") on batch ``b`` equals ``ref_loss`` to
    1e-12 and every gradient leaf the tree ``ref`` to 1e-10; the rows of the comparison."""
    loss, grads = GRAD_FNS[source](params, b, config)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-12)
    return assert_trees_close(ref, grads)
