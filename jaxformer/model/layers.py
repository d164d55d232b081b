"""Every layer's forward in one namespace: ``from jaxformer.model import layers``.

A convenience for notebooks, tests and custom models (``layers.attention(...)``);
each name is defined once, in the module of its layer kind, and only gathered here.
``manual_grads.custom_vjp`` offers the same names as drop-ins whose gradient is the
hand-derived one.
"""

from jaxformer.model.activations import (ACTIVATION_FNS, GELU_TANH_A, GELU_TANH_C,  # noqa: F401
                                         activation, gelu, gelu_tanh, relu, relu2, silu, tanh)
from jaxformer.model.attention import (CORES, Core, attention, attention_out, attention_qkv,  # noqa: F401
                                       attention_spec, core_kv, merge_heads, merge_qkv, qkv_heads,
                                       qkv_weights, rotate_qk, split_heads, split_qkv)
from jaxformer.model.cores import (AttentionSpec, attention_probs, attention_scores,  # noqa: F401
                                   masked_softmax, repeat_kv)
from jaxformer.model.block import (BLOCK_LAYERS, BlockLayers, block, compose_block,  # noqa: F401
                                   pick_norm, remat_block)
from jaxformer.model.embedding import (embed, positions, sinusoidal_positions,  # noqa: F401
                                       token_embedding)
from jaxformer.model.layer_norm import layer_norm, layer_norm_stats, row_scale  # noqa: F401
from jaxformer.model.linear import linear  # noqa: F401
from jaxformer.model.losses import cross_entropy  # noqa: F401
from jaxformer.model.mlp import feed_forward, gate_up_weights, gated_feed_forward  # noqa: F401
from jaxformer.model.precision import cast, matmul, stats_dtype, upcast  # noqa: F401
from jaxformer.model.rms_norm import rms_norm, rms_norm_stats  # noqa: F401
from jaxformer.model.rotary import RopeSpec, apply_rope, rope_base, rope_spec, rope_tables, rotate_half  # noqa: F401
