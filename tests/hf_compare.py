"""What the Hugging Face family tests share: the small shape, a random batch, and the
float64 comparisons against transformers' logits and torch autograd's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxformer
import manual_grads
from jaxformer.checkpoints.hf import read_hf
from jaxformer.checkpoints.hf_llama import params_from_hf
from manual_grads.check import assert_trees_close

V, D, H, L, F, S = 64, 16, 4, 2, 24, 32  # vocab, width, heads, layers, d_ff, max positions
B, T = 2, 11


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
    ours, ref = np.asarray(jaxformer.forward(params, b["inputs"], config)), torch_logits(model, b["inputs"])
    print(f"\n{folder.name}: logits max |diff| / max |ref| {np.abs(ours - ref).max() / np.abs(ref).max():.1e}")
    assert_logits_equal(ours, ref)


def torch_reference(model, config, b):
    """(loss, grads mapped to our tree) of torch autograd through the Hugging Face model."""
    model.zero_grad()
    logits = model(torch.tensor(np.asarray(b["inputs"], np.int64))).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(np.asarray(b["targets"], np.int64)).reshape(-1))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), params_from_hf(grads, config, np.float64, "torch grads")


def assert_grads_match_torch(model, folder, source):
    """The folder read in float64: the loss of ``source`` ("jax.grad" or "manual") equals torch
    autograd's to 1e-12 and every gradient leaf to 1e-10 (a tied tok_embed holds embedding + head)."""
    params, config = read_hf(folder, np.float64)
    b = batch(1)
    ref_loss, ref = torch_reference(model, config, b)
    grad_fn = jax.value_and_grad(jaxformer.loss_fn) if source == "jax.grad" else manual_grads.value_and_grad
    loss, grads = grad_fn(params, b, config)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-12)
    rows = assert_trees_close(ref, grads)
    worst = max(rows, key=lambda r: r.rel)
    print(f"\n{folder.name} {source}: worst leaf {worst.path} relative {worst.rel:.1e}")
