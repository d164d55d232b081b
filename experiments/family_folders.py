"""compare-grads on one random folder of every Hugging Face family jaxformer reads (a proof
run, not a test: tests/test_hf_*.py compare each family with transformers itself).

For each family this builds a tiny model with transformers' own class (every weight random,
norm scales away from 1, the family's particular options on: llama3 rotary scaling,
windows, QK-norms, softcaps, a local rotary base, layers without rotary positions, experts),
saves it as a folder, and runs ``jaxformer compare-grads --init-from FOLDER --dtype float64
--fd``: the hand-derived gradients against jax.grad leaf by leaf, and against float64 finite
differences. It prints one row per family: the worst leaf's relative error (manual vs
jax.grad) and the worst finite-difference error, and exits 1 if any family fails.

    python experiments/family_folders.py                      # every family, a few minutes
    python experiments/family_folders.py --families gemma2 olmoe
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

COMMON = dict(vocab_size=256, hidden_size=16, intermediate_size=24, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=32,
              bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=12)
# family: (config class, model class, the family's own options)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3, head_dim=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=3,
                                                     max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=6, attention_bias=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(attention_bias=True)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=6, num_key_value_heads=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=6, sliding_window=3, query_pre_attn_scalar=10,
                                                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=6, sliding_window=3, query_pre_attn_scalar=10, rope_local_base_freq=1000.0,
        layer_types=["sliding_attention", "full_attention"])),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, norm_topk_prob=True,
                                                               head_dim=6, **MOE)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, **MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, shared_expert_intermediate_size=10,
                                                               **MOE)),
}


def random_folder(family: str, folder: Path) -> None:
    """Save a random model of ``family`` (transformers' classes) in ``folder``."""
    import transformers

    from jaxformer.tools.compare.hf_random import random_hf_model
    config_class, model_class, own = FAMILIES[family]
    transformers.utils.logging.disable_progress_bar()
    config = getattr(transformers, config_class)(**{**COMMON, **own})
    random_hf_model(model_class, config).save_pretrained(folder)


def compare(folder: Path, out: Path) -> dict:
    """compare-grads on ``folder`` (float64, finite differences): its report.json's preset."""
    from jaxformer.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["compare-grads", "--init-from", str(folder), "--dtype", "float64", "--fd", "--batch-size", "2",
              "--seq-len", "11", "--repeats", "1", "--out", str(out)])
    if not (out / "report.json").exists():
        raise SystemExit(f"compare-grads --init-from {folder} stopped (exit {code}; its line above)")
    return json.loads((out / "report.json").read_text())["presets"][0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args(argv)
    print("| family | leaves | worst leaf, manual vs jax.grad | worst finite difference | result |")
    print("|---|---:|---:|---:|---|")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            folder = Path(tmp) / family
            random_folder(family, folder)
            r = compare(folder, Path(tmp) / f"{family}-report")
            worst = max(leaf["rel"] for leaf in r["leaves"])
            fd = max(leaf["rel"] for leaf in r["fd"]["leaves"])
            ok &= r["passed"]
            print(f"| `{family}` | {len(r['leaves'])} | {worst:.1e} | {fd:.1e} | "
                  f"{'pass' if r['passed'] else 'FAIL: ' + '; '.join(r['failures'])} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
