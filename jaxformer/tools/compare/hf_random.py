"""A Hugging Face model of any family with every weight random, for comparisons against
transformers itself (tests/test_hf_*.py, experiments/family_folders.py): zero biases or unit
norm scales would hide a weight read into the wrong place or a missing norm."""

from __future__ import annotations


def random_hf_model(model_class: str, hf_config, seed: int = 0, norm_center: float = 1.0,
                    router_scale: float = 0.2):
    """transformers' ``model_class`` (a name: "LlamaForCausalLM") of ``hf_config``, every leaf
    drawn from torch's generator seeded ``seed``: vectors N(0, 0.3²), matrices N(0, 0.2²), a
    mixture of experts' router (``...gate.weight``) N(0, router_scale²), and the norms' scales
    shifted by ``norm_center`` (1 for a scale w, 0 for a (1 + w) norm: both about 1, not 1)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if p.ndim == 1 else (router_scale if name.endswith("gate.weight") else 0.2)
            p.copy_(torch.randn_like(p) * scale + (norm_center if "norm" in name else 0.0))
    return model
