"""The mixture-of-experts Hugging Face families against transformers itself (float64, nothing
downloaded): one small random ``MixtralForCausalLM`` (a sliding window of 5 on every layer),
``Qwen3MoeForCausalLM`` (per-head QK-norm, norm_topk_prob, an expert width apart from the dense
one), ``OlmoeForCausalLM`` (QK-norm over the whole projection) and ``Qwen2MoeForCausalLM``
(q, k, v biases, a shared expert of width 10 with its sigmoid gate), each with 4 experts, 2 per
token, output_router_logits true; saved, imported, and shown equal in logits (1e-10 relative),
in gradients (jax.grad and manual vs torch autograd, 1e-10 per leaf, the router's included,
the load-balancing loss in both losses) and in the load-balancing loss; the export writes the
family and reloads with the same logits; a model whose layers are not all MoE is refused.

As in test_hf_families.py, transformers computes its RMS norms and rotary tables in float32
whatever the model's dtype, and so its router softmax (``softmax(..., dtype=torch.float)``,
Mixtral's ``router_logits.float()``) and load_balancing_loss_func's sums: the reference runs
the same formulas in float64 (``float64_model``, ``aux_loss64``); transformers' own float32
aux_loss is compared at 1e-6, the bound of its float32 sums. The router weights are 5 times
the others so that the routing is not near-uniform; random weights make ties in top-k
measure-zero."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_compare  # noqa: E402
from hf_compare import D, F, H, L, S, V, assert_export_reloads, assert_forward_matches, assert_grads_equal, batch  # noqa: E402

from jaxformer.formats import hf_moe  # noqa: E402
from jaxformer.formats.hf import HFFormatError, read_hf, write_hf  # noqa: E402
from jaxformer.model.moe import moe_aux_loss  # noqa: E402
from jaxformer.model.transformer import loss_and_stats  # noqa: E402
from jaxformer.tools.compare.hf_random import random_hf_model  # noqa: E402

jax.config.update("jax_enable_x64", True)
E, K, FE, FS, COEF = 4, 2, 12, 10, 0.02  # experts, per token, expert width, shared expert width, router_aux_loss_coef
CLASSES = {  # model_type: (config class, model class, its own keys, what the import makes of them)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, intermediate_size=FE, sliding_window=5),
                dict(router="topk_softmax", norm_topk_prob=False, expert_width=FE, sliding_window=5, qk_norm=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=E, moe_intermediate_size=FE, intermediate_size=F, norm_topk_prob=True, head_dim=6),
                  dict(router="softmax_topk", norm_topk_prob=True, expert_width=FE, sliding_window=0, qk_norm=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=E, intermediate_size=FE),
              dict(router="softmax_topk", norm_topk_prob=False, expert_width=FE, sliding_window=0, qk_norm=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=E, moe_intermediate_size=FE, intermediate_size=F, shared_expert_intermediate_size=FS,
                       norm_topk_prob=False),
                  dict(router="softmax_topk", norm_topk_prob=False, expert_width=FE, sliding_window=0, qk_norm=False,
                       shared_expert_d_ff=FS, shared_expert_gate=True)),
}


def hf_config(kind, **overrides):
    kw = dict(vocab_size=V, hidden_size=D, num_attention_heads=H, num_key_value_heads=2, num_hidden_layers=L,
              max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=5000.0, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, num_experts_per_tok=K, output_router_logits=True, router_aux_loss_coef=COEF,
              tie_word_embeddings=False, **CLASSES[kind][2])
    return getattr(transformers, CLASSES[kind][0])(**{**kw, **overrides})


def random_model(kind, cfg, seed=0):
    """Every leaf random: norm scales around 1 (not 1), the router's 5 times the projections'."""
    return random_hf_model(CLASSES[kind][1], cfg, seed, router_scale=1.0)


def float64_model(kind, folder):
    """The family's model from ``folder`` in float64 end to end: SDPA attention, and the RMS
    norms, rotary tables and router softmax (float32 inside transformers) in float64."""
    def router(self, hidden):  # the family's TopKRouter.forward without its float32 cast
        logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, idx

    return hf_compare.float64_model(CLASSES[kind][1], folder, patches=[("TopKRouter", router)],
                                    experts_implementation="eager")


def aux_loss64(router_logits, top_k):
    """transformers' load_balancing_loss_func (no attention mask) in float64."""
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    counts = torch.nn.functional.one_hot(torch.topk(probs, top_k, dim=-1).indices, probs.shape[-1]).sum(1)
    return probs.shape[-1] * torch.sum(counts.double().mean(0) * probs.mean(0))


@pytest.fixture(scope="module", params=sorted(CLASSES))
def saved(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    random_model(kind, hf_config(kind)).save_pretrained(folder)
    params, config = read_hf(folder, np.float64)
    return kind, float64_model(kind, folder), folder, params, config


def test_import_reads_the_family_and_matches_transformers_logits(saved):
    kind, model, folder, params, config = saved
    want = CLASSES[kind][3]
    assert config.family == kind and config.n_experts == E and config.experts_per_token == K
    assert {k: getattr(config, k) for k in want} == want
    assert tuple(config.linear_biases) == ((True, False, False) if kind == "qwen2_moe" else (False, False, False))
    assert config.moe_aux_loss_coef == COEF and config.qk_norm_scope == ("projection" if kind == "olmoe" else "head")
    ffn = params["blocks"]["ffn"]
    assert (ffn["router"].shape, ffn["w_gate"].shape, ffn["w_down"].shape) == ((L, D, E), (L, E, D, FE), (L, E, FE, D))
    assert_forward_matches(model, folder, params, config)


def torch_reference(model, config, b):
    """(loss, grads in our tree): torch autograd of cross entropy + coef * the float64 aux loss."""
    model.zero_grad()
    out = model(torch.tensor(np.asarray(b["inputs"], np.int64)), output_router_logits=True)
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.tensor(np.asarray(b["targets"], np.int64)).reshape(-1))
    loss = ce + config.moe_aux_loss_coef * aux_loss64(out.router_logits, config.experts_per_token)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), hf_moe.params_from_hf(grads, config, np.float64, "torch grads")


@pytest.mark.parametrize("source", ["jax.grad", "manual"])
def test_gradients_match_torch_autograd(saved, source):
    """Every leaf (router, experts, attention, norms) within 1e-10 of torch autograd; the fused
    gate_up_proj of transformers' named_parameters read as the import reads it."""
    kind, model, _, params, config = saved
    b = batch(1)
    ref_loss, ref = torch_reference(model, config, b)
    rows = assert_grads_equal(params, b, config, source, ref_loss, ref)
    worst = max(rows, key=lambda r: r.rel)
    router = max(r.rel for r in rows if "router" in str(r.path))
    print(f"\n{kind} {source}: worst leaf {worst.path} relative {worst.rel:.1e}, router {router:.1e}")


def test_aux_loss_is_transformers_router_aux_loss(saved):
    """Our load-balancing term equals transformers' (output_router_logits=True: its aux_loss,
    which its loss adds times router_aux_loss_coef): to 1e-12 of the float64 formula, to 1e-6
    of transformers' own float32 sums."""
    kind, model, _, params, config = saved
    b = batch(3)
    _, stats = loss_and_stats(params, b, config)
    ours = float(moe_aux_loss(stats, config)) / config.moe_aux_loss_coef
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(b["inputs"], np.int64)), output_router_logits=True)
    assert ours == pytest.approx(float(aux_loss64(out.router_logits, K)), rel=1e-12)
    assert ours == pytest.approx(float(out.aux_loss), rel=1e-6)
    assert model.router_aux_loss_coef == config.moe_aux_loss_coef


def test_export_writes_the_family_and_reloads(saved, tmp_path):
    kind, _, _, params, config = saved
    params, back, out = assert_export_reloads(tmp_path, params, config, kind, CLASSES[kind][1],
                                              lambda out: float64_model(kind, out))
    assert back.config.output_router_logits and back.router_aux_loss_coef == COEF
    again, _ = read_hf(out, np.float64)
    jax.tree_util.tree_map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7), again, params)


def test_refused_configs_are_one_line(saved):
    kind, _, folder, _, config = saved
    hf = json.loads((folder / "config.json").read_text())
    if kind == "qwen3_moe":
        with pytest.raises(HFFormatError, match=r"mlp_only_layers \[1\]: layers \[1\] have a dense MLP"):
            hf_moe.config_from_hf({**hf, "mlp_only_layers": [1]})
        with pytest.raises(HFFormatError, match=r"decoder_sparse_step 2 .* layers \[0\]"):
            hf_moe.config_from_hf({**hf, "decoder_sparse_step": 2})
    if kind == "qwen2_moe":
        with pytest.raises(HFFormatError, match=r"mlp_only_layers \[0\]: layers \[0\] have a dense MLP"):
            hf_moe.config_from_hf({**hf, "mlp_only_layers": [0]})
        with pytest.raises(HFFormatError, match=r"decoder_sparse_step 2 .* layers \[0\]"):
            hf_moe.config_from_hf({**hf, "decoder_sparse_step": 2})
        with pytest.raises(HFFormatError, match="use_sliding_window true is not supported for qwen2_moe"):
            hf_moe.config_from_hf({**hf, "use_sliding_window": True})
        with pytest.raises(ValueError, match="Qwen2-MoE needs ModelConfig.shared_expert_gate = True"):
            hf_moe.config_to_hf(config.replace(shared_expert_gate=False))
        with pytest.raises(ValueError, match="Qwen2-MoE has a shared expert: ModelConfig.shared_expert_d_ff"):
            hf_moe.config_to_hf(config.replace(shared_expert_d_ff=0))
        with pytest.raises(ValueError, match="Qwen3-MoE needs ModelConfig.shared_expert_d_ff = 0"):
            hf_moe.config_to_hf(config.replace(family="qwen3_moe"))
    if kind == "olmoe":
        with pytest.raises(HFFormatError, match="clip_qkv 8.0 is not supported"):
            hf_moe.config_from_hf({**hf, "clip_qkv": 8.0})
    if kind == "mixtral":
        with pytest.raises(HFFormatError, match="router_jitter_noise 0.1 is not supported"):
            hf_moe.config_from_hf({**hf, "router_jitter_noise": 0.1})
        with pytest.raises(ValueError, match="Mixtral needs ModelConfig.router = 'topk_softmax'"):
            hf_moe.config_to_hf(config.replace(router="softmax_topk"))
    with pytest.raises(ValueError, match="a mixture of experts exports as family"):
        write_hf("unused", {}, config.replace(family="llama"))
