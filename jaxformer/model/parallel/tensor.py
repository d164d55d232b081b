"""Tensor parallelism, Megatron-LM's split of each block over the mesh's ``tensor`` axis (t
devices), composed of the regions of regions.py around the model's own layers:

    attention   h = copy_to_tensor(x)                      (B, T, D), replicated
                q, k, v = heads of h @ [wq | wk | wv]_i     column-parallel: device i's H/t heads
                o = core(q, k, v)                          (B, H/t, T, Dh) on device i alone
                y = reduce_from_tensor(merge_heads(o) @ wo_i) + bo     row-parallel: wo's rows of i
    feed-forward h = copy_to_tensor(x)
                y = reduce_from_tensor(act(h @ w_in_i) @ w_out_i) + b_out
                (gated: act(h @ w_gate_i) * (h @ w_up_i) @ w_down_i, + b_down)

Device i holds columns i F/t .. (i+1) F/t - 1 of the column-parallel weights (w_in, w_gate,
w_up; wq: its heads i H/t ..) and the same rows of the row-parallel ones (wo, w_out,
w_down); norms, residual adds, the row-parallel biases and the embeddings are replicated.
Each device runs the model's attention and feed-forward (attention.py, mlp.py) on its slice,
with a ``local_config`` (H/t heads of the same Dh, F/t): no math is written twice.

Key/value heads (grouped-query attention, Hkv heads read by G = H / Hkv query heads each) split
like the query heads when t divides Hkv: device i's query heads read exactly its Hkv/t key/value
heads. When it does not (t > Hkv, say), wk, wv (and bk, bv) stay replicated and each device
takes from its copy the columns of the key/value head each of its H/t query heads reads
(``kv_columns``: repeat_kv on the weight, then its heads), so locally every query head has
its own: the same products as one device; their gradients add over the devices (copy_to_tensor).

QK-norm over the whole projection (qk_norm_scope "projection", OLMo 2's): a token's norm is over
every head's features, of which device i holds its heads': the mean of squares is a psum over the
axis of each device's sum (``tensor_qk_norm``: rms_norm's axis_name), and each device reads its
block of the (H Dh,) scales (scatter_to_tensor). The key/value heads must split (t divides Hkv).

Sequence parallelism (``sequence=True``, Megatron-LM's): between the sublayers the activations
split along T over the same axis, so the norms, residual adds and the row-parallel biases run on
each device's T/t tokens; a sublayer gathers its input along T (gather_from_sequence, where
copy_to_tensor was) and reduce-scatters its output back (reduce_scatter_to_sequence, where
reduce_from_tensor was): the same bytes as the all-reduce, and no device holds a whole (B, T, D)
between the sublayers. The replicated leaves the token-split layers read (norms, row biases)
then have one part of their gradient on each device: jax.grad sums them (shard_map's transpose
of a replicated input), the manual backward with a psum of its own.

LoRA adapters (lora.py: y = x W + s (x A) B) split as the weight they adapt (``local_adapters``):
beside a column-parallel W, B by the same output columns and A replicated; beside a row-parallel
W, A by the same input rows and B replicated, so device i's s (x_i A_i) B is a partial sum the
row-parallel reduction adds with x_i W_i. They are stored replicated (small); each device reads
its slice. Their dropout draws each device's piece of one device's masks: its rows, and beside a
row-parallel W its block of the input's features (``local_adapters``, ``site_piece_keys``).

Mixture of experts: each expert's gated MLP splits as the dense one (w_gate, w_up by their F
columns, w_down by its F rows), the shared expert's too; the router and the shared expert's gate
are replicated (``moe_local_params``), so every device routes every token alike and its output
is a partial sum; the router's statistics are pmean'd to the whole batch's (``moe_global_stats``).

Dropout: each device draws its piece of one device's masks (``device_key``: the layer's key as a
dropout.PieceKey of the device's batch rows, its H/t heads for the probabilities and, with
sequence parallelism, its T/t tokens for the branches), so a tensor-parallel step drops exactly
what one device's does.

``tensor_blocks`` runs the stacked blocks (L, ...) under ``jax.shard_map`` on a mesh with a
tensor axis; every other mesh axis splits the batch. A mesh that does not divide the model
is refused in one line naming the axis, its size and what it must divide (``check_tensor``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.attention import QKNorm, attention, qk_norm_of
from jaxformer.model.block import BlockLayers, compose_block
from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import PieceKey, layer_key
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.mlp import feed_forward
from jaxformer.model.moe import moe
from jaxformer.model.parallel.context import check_context_model, ring_core_of
from jaxformer.model.parallel.pieces import device_piece, local_positions, site_piece_keys
from jaxformer.model.lora import LORA, site_key
from jaxformer.model.parallel.regions import (CONTEXT, TENSOR, axis_size, batch_axes, copy_to_tensor,
                                              gather_from_sequence, reduce_from_tensor, reduce_scatter_to_sequence,
                                              scatter_to_tensor, token_axes, trace_mesh_with)
from jaxformer.model.rms_norm import rms_norm

COLUMNS = {"attn": ("wq", "bq"), "ffn": ("w_in", "b_in", "w_gate", "b_gate", "w_up", "b_up")}
KV = ("wk", "bk", "wv", "bv")  # column-parallel when t divides the key/value heads, else replicated
ROWS = {"attn": ("wo",), "ffn": ("w_out", "w_down")}  # split along their input rows
ROW_BIAS = {"attn": "bo", "ffn": ("b_out", "b_down")}  # replicated: added once, after the reduction


def split_kv(config: ModelConfig, t: int) -> bool:
    """Whether the key/value heads split over a tensor axis of size t (t divides them)."""
    return config.kv_heads % t == 0


def check_tensor(config: ModelConfig, t: int, seq_len: int | None = None) -> None:
    """A ValueError in one line unless a tensor axis of size t can split ``config`` (and, with
    sequence parallelism, sequences of ``seq_len`` tokens)."""
    sizes = [("n_heads", config.n_heads), ("d_ff", config.d_ff)]
    for what, n in sizes + ([("the sequence length", seq_len)] if seq_len is not None else []):
        if n % t:
            raise ValueError(f"mesh axis tensor={t} does not divide {what} {n}: the tensor size must divide {what}")
    if config.qk_norm and config.qk_norm_scope == "projection" and not split_kv(config, t):
        raise ValueError(f"mesh axis tensor={t} does not divide n_kv_heads {config.kv_heads}: with qk_norm_scope "
                         f"'projection' the tensor size must divide n_kv_heads (k's norm over its heads' features)")
    refused = [(config.attention_impl == "cudnn", "attention_impl 'cudnn' (cuDNN runs on GPUs alone, and the "
                                                  "tensor region is proven on CPU devices)")]
    for on, what in refused:
        if on and t > 1:
            raise ValueError(f"mesh axis tensor={t}: tensor parallelism does not run {what} yet; use tensor=1")


def local_config(config: ModelConfig, t: int) -> ModelConfig:
    """The config of one device's slice: H/t heads of the same width Dh, F/t hidden features;
    Hkv/t key/value heads when they split, else one a query head (``kv_columns``)."""
    kv = config.kv_heads // t if split_kv(config, t) else 0
    return dataclasses.replace(config, n_heads=config.n_heads // t, n_kv_heads=kv,
                               head_dim=config.d_head, d_ff=config.d_ff // t)


def kv_columns(w, n_kv_heads: int, n_heads: int, axis_name: str = TENSOR):
    """A replicated key/value weight w (..., Hkv Dh) -> (..., (H/t) Dh): for each of this device's
    H/t query heads, the Dh columns of the key/value head it reads (query head h reads h // G,
    G = H / Hkv: repeat_kv on the weight), so that each local query head has its own."""
    *lead, width = w.shape
    dh, t = width // n_kv_heads, jax.lax.axis_size(axis_name)
    rep = jnp.repeat(w.reshape(*lead, n_kv_heads, dh), n_heads // n_kv_heads, axis=-2)  # (..., H, Dh)
    mine = jax.lax.dynamic_slice_in_dim(rep, jax.lax.axis_index(axis_name) * (n_heads // t), n_heads // t, axis=-2)
    return mine.reshape(*lead, (n_heads // t) * dh)


def tensor_qk_norm(config: ModelConfig) -> QKNorm:
    """QK-norm on device i's heads: over each head's Dh as on one device; with qk_norm_scope
    "projection" over every device's heads' features (QKNorm.axis: the statistics' sum over
    the tensor axis, each device's heads its part of a token's H Dh features)."""
    qk = qk_norm_of(config)
    return qk._replace(axis=TENSOR) if qk.whole else qk


def attention_local_params(p, config: ModelConfig, t: int) -> dict:
    """One device's attention params as the model's attention reads them (its local_config):
    no output bias (added after the reduction); the replicated leaves it reads per head
    (QK-norm's scales, unsplit key/value weights) through copy_to_tensor. A whole-projection
    QK-norm's scales (H Dh,), (Hkv Dh,) are read by device i's heads' features alone
    (scatter_to_tensor: its block of them)."""
    local = {n: v for n, v in p.items() if n != "bo"}
    read = (lambda v: scatter_to_tensor(v, -1)) if qk_norm_of(config).whole else copy_to_tensor
    for n in ("q_norm", "k_norm"):
        if n in local:
            local[n] = jax.tree_util.tree_map(read, local[n])
    if not split_kv(config, t):
        for n in KV:
            if n in local:
                local[n] = kv_columns(copy_to_tensor(local[n]), config.kv_heads, config.n_heads)
    return local


def replicated_kv(config: ModelConfig, t: int) -> tuple[int, int] | None:
    """(Hkv, H) where the key/value weights stay replicated over a tensor axis of t (each device
    reads them through kv_columns), else None."""
    return None if split_kv(config, t) else (config.kv_heads, config.n_heads)


def adapter_split(name: str, section: str, kv: tuple[int, int] | None) -> str:
    """How the LoRA factors beside weight ``name`` split, as that weight does: "rows" (a
    row-parallel W: A by its input rows, B replicated), "kv" (replicated key/value weights, kv
    (Hkv, H): B read through kv_columns) or "columns" (B by its output columns, A replicated)."""
    if name in ROWS[section]:
        return "rows"
    return "kv" if name in KV and kv else "columns"


def local_adapters(site, section: str, kv: tuple[int, int] | None = None) -> dict:
    """One device's LoRA site (lora.py: delta = s (x A) B beside each adapted W), split as its W
    (``adapter_split``): a column-parallel W's B by the same output columns, A replicated (each
    device's copy read by its own columns); a row-parallel W's A by the same input rows, B
    replicated (each device's partial x_i A_i B summed by the row-parallel reduction, with
    x_i W_i); replicated key/value weights' B through kv_columns, as the weights. The scale and
    the dropout rate are read as they are. With dropout (the site's key device i's PieceKey of
    its rows, and of its tokens on a context axis: pieces.site_piece_keys) each adapter gets its
    own key (lora.site_key's), whose piece a row-parallel adapter widens by its input's
    features: x_i is device i's block of them."""
    local = {}
    for name, leaf in site.items():
        if not isinstance(leaf, dict):  # the scale, the rate, the site's key (each adapter gets its own below)
            local[name] = leaf
            continue
        split = adapter_split(name, section, kv)
        if split == "rows":
            local[name] = {"a": scatter_to_tensor(leaf["a"], -2), "b": copy_to_tensor(leaf["b"])}
        elif split == "kv":
            local[name] = {"a": copy_to_tensor(leaf["a"]), "b": kv_columns(copy_to_tensor(leaf["b"]), *kv)}
        else:
            local[name] = {"a": copy_to_tensor(leaf["a"]), "b": scatter_to_tensor(leaf["b"], -1)}
        if "key" in site:
            key = site_key(site, name)
            if split == "rows":  # A's input rows I, device i's I/t of them
                width, t = leaf["a"].shape[-2], jax.lax.axis_size(TENSOR)
                key = PieceKey(key.key, key.piece._replace(features=(width, jax.lax.axis_index(TENSOR) * (width // t))))
            local[name]["key"] = key
    return local


def with_local_adapters(local, p, section: str, kv: tuple[int, int] | None = None) -> dict:
    """``local`` (a sublayer's params on one device) with p's LoRA site made local too, if it has one."""
    return {**local, LORA: local_adapters(p[LORA], section, kv)} if LORA in p else local


def enter(x, sequence: bool):
    """A sublayer's input as its column-parallel products read it: x replicated, read per device
    (copy_to_tensor), or, with sequence parallelism, device i's T/t tokens gathered along T."""
    return gather_from_sequence(x) if sequence else copy_to_tensor(x)


def leave(y, sequence: bool):
    """A sublayer's partial output summed over the devices (the row-parallel reduction): on every
    device, or, with sequence parallelism, device i's T/t tokens of the sum."""
    return reduce_scatter_to_sequence(y) if sequence else reduce_from_tensor(y)


def ring_args(ring: bool, n_local: int, config: ModelConfig) -> dict:
    """attention's core and rotary positions on a mesh with a context axis too (``ring``): ring
    attention over it (config's core: context.ring_core_of), each of the device's ``n_local``
    tokens at its global position."""
    return {"core": ring_core_of(config), "positions": local_positions(n_local)} if ring else {}


def tensor_attention(p, x, config: ModelConfig, key=None, segments=None, sequence: bool = False, ring: bool = False):
    """The attention layer on device i's heads (under shard_map): x (B, T, D) replicated ->
    (y (B, T, D) replicated, None), a BlockLayers attention. ``sequence``: x and y are device
    i's (B, T/t, D); ``segments`` stay whole (B, T). ``ring``: x, y and segments are device i's
    T/c tokens of a context axis (parallel/context.py), the core ring attention over it."""
    t = jax.lax.axis_size(TENSOR)
    local = with_local_adapters(attention_local_params(p, config, t), p, "attn", replicated_kv(config, t))
    h = enter(x, sequence)
    y = attention(local, h, local_config(config, t), key, segments=segments, qk=tensor_qk_norm(config),
                  **ring_args(ring, h.shape[1], config))  # partial sums
    y = leave(y, sequence)  # the row-parallel product's sum over the devices
    return (y + p["bo"] if "bo" in p else y), None


def ffn_bias(p) -> str:
    """The feed-forward's row-parallel bias name: b_down (gated) or b_out."""
    return "b_down" if "w_gate" in p else "b_out"


MOE_SHARED = ("router", "shared_gate")  # an MoE layer's replicated leaves, read per device


def moe_local_params(p) -> dict:
    """One device's MoE layer params as moe() reads them: the experts' w_gate, w_up (E, D, F/t)
    and w_down (E, F/t, D) and the shared expert's MLP are device i's slices already (block_specs);
    the router and the shared expert's gate are replicated, read per device (copy_to_tensor)."""
    return {n: copy_to_tensor(v) if n in MOE_SHARED else v for n, v in p.items()}


def tensor_feed_forward(p, x, config: ModelConfig, sequence: bool = False):
    """The feed-forward on device i's F/t hidden features (under shard_map): x (B, T, D)
    replicated -> y (B, T, D) replicated (``sequence``: device i's (B, T/t, D) each). With
    n_experts the MoE layer on each expert's F/t features (and the shared expert's Fs/t): every
    device routes every token alike (the router replicated), so its partial y is the gates times
    its experts' partial outputs, summed over the axis as a dense layer's; (y, MoeStats), the
    statistics the same on every device of the axis."""
    if config.n_experts:
        y, stats = moe(moe_local_params(p), enter(x, sequence), config)  # partial sums
        return leave(y, sequence), stats
    bias = ffn_bias(p)
    local = with_local_adapters({n: v for n, v in p.items() if n != bias}, p, "ffn")
    y = feed_forward(local, enter(x, sequence), config.activation, config.compute_dtype)  # partial sums
    y = leave(y, sequence)
    return y + p[bias] if bias in p else y


TENSOR_LAYERS = BlockLayers(tensor_attention, tensor_feed_forward, layer_norm, rms_norm)
SEQUENCE_LAYERS = BlockLayers(functools.partial(tensor_attention, sequence=True),
                              functools.partial(tensor_feed_forward, sequence=True), layer_norm, rms_norm)
RING_LAYERS = BlockLayers(functools.partial(tensor_attention, ring=True), tensor_feed_forward, layer_norm, rms_norm)


def device_key(key, x, config: ModelConfig, mesh, sequence: bool) -> PieceKey:
    """A block's dropout key as device i's PieceKey (under shard_map over ``mesh``, x its (B/n, T, D) or, with
    sequence parallelism, (B/n, T/t, D), or with a context axis beside (B/n, T/c, D)): its rows of
    the batch (split over the batch axes, in their order), its H/t heads, and with sequence
    parallelism its T/t tokens, on a context axis its tokens' global positions (zig-zag), so that
    each of its masks is the piece of the one device's mask it holds (dropout.piece_uniform; the
    ring draws each visit's queries and keys)."""
    t, i = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    piece = device_piece(x, mesh)._replace(heads=(config.n_heads, i * (config.n_heads // t)))
    if sequence and piece.tokens is None:  # its T/t tokens (no context axis beside: refused with it)
        piece = piece._replace(tokens=(t * x.shape[1], i * x.shape[1]))
    return PieceKey(key, piece)


def layer_device_key(key, l, x, config: ModelConfig, mesh, sequence: bool):
    """Layer l's dropout key (layer_key) as device i's piece (``device_key``), or None without a key."""
    return None if key is None else device_key(layer_key(key, l), x, config, mesh, sequence)


def tensor_block(p, x, config: ModelConfig, key=None, segments=None, sequence: bool = False, ring: bool = False):
    """One block on device i (under shard_map): the model's compose_block with TENSOR_LAYERS
    (SEQUENCE_LAYERS: x and y device i's T/t tokens; RING_LAYERS: its T/c tokens of a context axis).
    With n_experts: (y, the MoE layer's MoeStats over device i's rows)."""
    layers = RING_LAYERS if ring else SEQUENCE_LAYERS if sequence else TENSOR_LAYERS
    y, aux = compose_block(p, x, config, layers, key, segments)
    return (y, aux[1]) if config.n_experts else y


# ----------------------------------------------------------------------------
# the layout on the mesh


def leaf_spec(section: str, name: str, ndim: int, kv_split: bool) -> PartitionSpec:
    """The PartitionSpec of blocks[section][name] with ``ndim`` dims (stacked or one layer's)."""
    if name in COLUMNS.get(section, ()) or (section == "attn" and name in KV and kv_split):
        return PartitionSpec(*([None] * (ndim - 1)), TENSOR)  # the output columns
    if name in ROWS.get(section, ()):
        return PartitionSpec(*([None] * (ndim - 2)), TENSOR, None)  # the input rows
    return PartitionSpec()


def block_specs(blocks, config: ModelConfig, t: int):
    """The PartitionSpec tree of params["blocks"] (or one layer's slice): column-parallel
    leaves split along their last axis, row-parallel along their rows, the rest replicated."""
    def spec(path, leaf):
        keys = [k.key for k in path]
        name = keys[2] if keys[1:2] == ["shared"] else keys[1] if len(keys) > 1 else ""  # the shared expert's MLP
        return leaf_spec(keys[0], name, leaf.ndim, split_kv(config, t))
    return jax.tree_util.tree_map_with_path(spec, blocks)


def tensor_size(mesh) -> int:
    return axis_size(mesh, TENSOR)


def tensor_mesh():
    """The trace's mesh when it has a tensor axis larger than 1 (regions.trace_mesh_with): the
    whole model's blocks then run as ``tensor_blocks`` (the forward, jaxformer/model/transformer.py)
    and ``tensor_blocks_fwd`` / ``_bwd`` (manual_grads/model.py); None otherwise."""
    return trace_mesh_with(TENSOR)


def ring_on(mesh) -> bool:
    """Whether ``mesh`` has a context axis larger than 1 beside the tensor axis: the tokens are
    then split over it (in its zig-zag order, parallel/context.py) and attention is the ring."""
    return axis_size(mesh, CONTEXT) > 1


def stream_spec(mesh, sequence: bool) -> PartitionSpec:
    """The residual stream's (B, T, D) spec between the blocks: the batch's, and T split over the
    tensor axis with sequence parallelism, or over the context axis where the mesh has one."""
    if sequence:
        return PartitionSpec(batch_axes(mesh) or None, TENSOR)
    return token_axes(mesh)[1]  # the batch's rows, and T over a context axis


def segments_spec(mesh) -> PartitionSpec:
    """The packed documents' ids' (B, T) spec: the batch's (whole rows with sequence parallelism:
    attention gathers its tokens), T over the context axis where the mesh has one."""
    return stream_spec(mesh, False)


def check_tensor_blocks(config: ModelConfig, mesh, x, sequence: bool) -> None:
    """check_tensor, and check_context_model where the mesh has a context axis too."""
    t = tensor_size(mesh)
    check_tensor(config, t, x.shape[1] if sequence else None)
    if ring_on(mesh):
        check_context_model(config, axis_size(mesh, CONTEXT), x.shape[1], t)


def tensor_blocks(blocks, x, config: ModelConfig, mesh, segments=None, sequence: bool = False, key=None):
    """The stacked blocks (leaves (L, ...)) on ``mesh``: x (B, T, D) -> (B, T, D) (with n_experts
    (y, the MoE layers' statistics stacked over L, over the whole batch)), each block
    tensor parallel over the mesh's tensor axis, the batch split over its other axes;
    ``sequence``: the activations between the sublayers split along T as well. On a mesh with a
    context axis, x and segments are in its zig-zag order, T split over it, attention the ring.
    ``key``: dropout's key (None: none); block l draws layer_key(key, l)'s masks, each device
    its piece of them (``device_key``): the masks one device draws."""
    check_tensor_blocks(config, mesh, x, sequence)
    t, ring = tensor_size(mesh), ring_on(mesh)

    def local(blocks, x, segments, key):
        def layer(p, x, l):
            lkey = layer_device_key(key, l, x, config, mesh, sequence)
            p = site_piece_keys(p, x, mesh)  # LoRA dropout's keys: device i's piece
            # layer l's config: its kind of attention (layer_kinds.per_layer)
            return per_layer(config, l, lambda c: tensor_block(p, x, c, lkey, segments, sequence, ring))
        if config.remat == "block":  # JAX's grad keeps each block's input alone and runs it again
            layer = jax.checkpoint(layer)
        if not config.n_experts:
            return jax.lax.scan(lambda x, pl: (layer(pl[0], x, pl[1]), None), x,
                                (blocks, jnp.arange(config.n_layers)))[0]
        y, stats = jax.lax.scan(lambda x, pl: layer(pl[0], x, pl[1]), x, (blocks, jnp.arange(config.n_layers)))
        return y, moe_global_stats(stats, mesh)

    stream = stream_spec(mesh, sequence)
    specs = (block_specs(blocks, config, t), stream, segments_spec(mesh), PartitionSpec())
    out = (stream, PartitionSpec()) if config.n_experts else stream
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out)(blocks, x, segments, key)


def moe_global_stats(stats, mesh):
    """Inside tensor_blocks' shard_map: the MoE layers' statistics over device i's tokens -> over
    the whole batch, as one device computes them: their pmean over the axes the tokens split over
    (every device holds as many: regions.token_axes) and over tensor (where every device computed
    the same)."""
    axes = (*token_axes(mesh)[0], TENSOR)
    return jax.tree_util.tree_map(lambda s: jax.lax.pmean(s, axes), stats)
