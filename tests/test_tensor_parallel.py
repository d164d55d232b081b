"""Tensor parallelism (jaxformer/model/parallel/, manual_grads/parallel/) equals one device.

One subprocess on 8 forced CPU devices, float64, runs every multi-device case and returns
the largest differences: each region's hand-written backward against jax.vjp of its forward
(under shard_map, tensor=4), and the stacked blocks (2 layers) on tensor=2 and tensor=4 for
the GPT-2 block (pre layer norm, plain GELU MLP, biases; its tensor=2 also splits the batch
over data=2) and a Llama-like one (RMS norm, gated SiLU MLP, rotary, QK-norm, 2 key/value
heads for 4 query heads: split over tensor=2, replicated over tensor=4; post layout), and with
sequence parallelism (the activations between the sublayers split along T) the GPT-2 block on
data=2 x tensor=2 and the Llama-like one on tensor=4. Each
mesh's loss, manual gradients and jax.grad through the same sharded forward are held to one
device's manual backward (test_block.py holds it to jax.grad), per leaf, to 1e-10; the manual
program's collectives are counted in its HLO (``collectives``); the whole model under
``jax.set_mesh`` of data=2 x tensor=2 (its blocks tensor parallel) equals one device, dropout
included (each device's piece of one device's masks: the same key), layers of two kinds (a
sliding window, then full attention), and a mixture of experts
(each expert's hidden features split over tensor); the head and
loss with the vocabulary split (parallel/vocab.py) equal one device's. The refusals and the sub-room's
source rules run in this process."""

import dataclasses
import re

import numpy as np
import pytest
from helpers import adapter_differences, assert_adapters_equal_one_device, once_per_run, run_cases_on_8_devices

from jaxformer.model.config import ModelConfig
from jaxformer.model.parallel.tensor import check_tensor

pytestmark = pytest.mark.xdist_group("test_tensor_parallel")  # one worker: the other goes on while its subprocess runs

TOL = 1e-10
REGIONS = ("copy_to_tensor", "reduce_from_tensor", "scatter_to_tensor", "gather_from_tensor",
           "gather_from_sequence", "reduce_scatter_to_sequence")
# (model, mesh axes, sizes, sequence parallelism)
CASES = [("gpt2", ("data", "tensor"), (2, 2), False), ("gpt2", ("tensor",), (4,), False),
         ("llama", ("tensor",), (2,), False), ("llama", ("tensor",), (4,), False),
         ("gpt2", ("data", "tensor"), (2, 2), True), ("llama", ("tensor",), (4,), True)]


def case_name(cname, names, shape, sequence) -> str:
    return f"{cname} {'x'.join(f'{n}={s}' for n, s in zip(names, shape))}{' sequence' if sequence else ''}"


def configs():
    base = dict(vocab_size=11, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=8)
    configs = {"gpt2": ModelConfig(**base),
               "gpt2-sequence-remat-dropout": ModelConfig(**base, sequence_parallel=True, remat="block", dropout=0.3),
               "llama": ModelConfig(**base, norm="post", norm_type="rms", mlp="gated", activation="silu",
                                    positions="rope", n_kv_heads=2, qk_norm=True,
                                    tie_embeddings=True, head_bias=False, logit_softcap=3.0, loss_chunk=5)}
    # layers of two kinds: a sliding window of 3 (its own rotary base), then full attention
    configs["llama-mixed-blockwise-dropout"] = configs["llama"].replace(
        attention_impl="blockwise", attention_block=4, dropout=0.2, sliding_window=3, rope_local_theta=100.0,
        layer_types=("sliding_attention", "full_attention"))
    # the Pallas kernels (interpreted here) on each device's heads, the sequence split between sublayers
    configs["llama-pallas-sequence"] = configs["llama"].replace(attention_impl="pallas", pallas_block_q=8,
                                                                pallas_block_k=8, sequence_parallel=True)
    # mixture of experts (4, 2 a token) with a shared expert, the load-balancing and z losses: each
    # expert's F/t features on a device, the router replicated; QK-norm over all of q's and k's
    # features as OLMoE's (each device's heads a part of them: the statistics summed over tensor)
    configs["moe-sequence"] = configs["llama"].replace(bias=False, n_experts=4, experts_per_token=2, shared_expert_d_ff=8,
                                                       moe_aux_loss_coef=0.1, router_z_loss_coef=0.01,
                                                       sequence_parallel=True, qk_norm_scope="projection")
    return configs


def run_cases() -> dict:
    """The subprocess' body: {name: largest difference}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxformer.model.parallel import regions
    from jaxformer.model.parallel.tensor import tensor_blocks
    from jaxformer.model.params import init_params
    from manual_grads.block import block_bwd, block_fwd
    from manual_grads.parallel import regions as manual_regions
    from manual_grads.parallel.tensor import tensor_blocks_bwd, tensor_blocks_fwd

    out = {}
    leaves = jax.tree_util.tree_leaves
    devices = np.array(jax.devices())

    # each region alone: the manual backward against jax.vjp of the forward, tensor=4, all in one program
    mesh = Mesh(devices[:4], ("tensor",))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 12), jnp.float64)  # (B, T, C): T and C split by 4
    dys = {}
    row, seq, rep = P(None, None, "tensor"), P(None, "tensor"), P()
    specs = {"copy_to_tensor": (rep, row), "reduce_from_tensor": (row, rep), "scatter_to_tensor": (rep, row),
             "gather_from_tensor": (row, rep), "gather_from_sequence": (seq, row),
             "reduce_scatter_to_sequence": (row, seq)}
    scale = lambda: 1.0 + jax.lax.axis_index("tensor")  # noqa: E731  a different factor on each device

    @jax.jit
    def region_errors(x):
        errors = {}
        for i, name in enumerate(REGIONS):
            fwd, bwd = getattr(regions, name), getattr(manual_regions, name + "_bwd")
            in_spec, out_spec = specs[name]
            if name == "copy_to_tensor":  # each device reads its copy its own way: y_i = x[..., :3] * (1 + i)
                f_local = lambda a, fwd=fwd: fwd(a)[..., :3] * scale()  # noqa: E731
                b_local = lambda dy, bwd=bwd: bwd(jnp.pad(dy * scale(), ((0, 0), (0, 0), (0, 9))))  # noqa: E731
            else:
                f_local, b_local = fwd, bwd
            f = jax.shard_map(f_local, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
            b = jax.shard_map(b_local, mesh=mesh, in_specs=out_spec, out_specs=in_spec, check_vma=False)
            y, vjp = jax.vjp(f, x)
            dy = jax.random.normal(jax.random.PRNGKey(i), y.shape, jnp.float64)
            errors[name] = jnp.max(jnp.abs(b(dy) - vjp(dy)[0]))
        return errors

    out.update({f"region {k}": float(v) for k, v in region_errors(x).items()})

    # the stacked blocks: loss = sum(blocks(x) * r); the reference is one device's manual backward
    # (test_block.py holds it equal to jax.grad); every difference is taken inside the programs
    def init(config):  # random params of init_params' shapes, without compiling init_params
        rng = np.random.default_rng(0)
        shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))["blocks"]
        return jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), shapes)

    rng = np.random.default_rng(1)
    x, r = (jnp.asarray(rng.standard_normal((4, 8, 16))) for _ in range(2))  # (B, T, D)
    jdiff = lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(u - v)) for u, v in zip(leaves(a), leaves(b), strict=True)]))  # noqa: E731
    reference = {}
    for cname, names, shape, sequence in CASES:
        config = configs()[cname]
        if cname not in reference:
            @jax.jit
            def one_device(blocks, x):
                y, res = jax.lax.scan(lambda x, p: block_fwd(p, x, config), x, blocks)
                dx, grads = jax.lax.scan(lambda dy, res: block_bwd(res, dy)[::-1], r, res, reverse=True)
                return jnp.sum(y * r), (grads, dx)

            blocks = init(config)
            reference[cname] = (blocks, one_device(blocks, x))
        blocks, (loss1, manual1) = reference[cname]
        mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape), names)

        @jax.jit
        def sharded(blocks, x, loss1, manual1):
            y, res = tensor_blocks_fwd(blocks, x, config, mesh, sequence=sequence)
            manual = tensor_blocks_bwd(res, r)
            auto_loss, auto = jax.value_and_grad(lambda b, x: jnp.sum(tensor_blocks(b, x, config, mesh, sequence=sequence) * r),
                                                 (0, 1))(blocks, x)
            return {"loss": jnp.maximum(jnp.abs(jnp.sum(y * r) - loss1), jnp.abs(auto_loss - loss1)),
                    "manual = one device": jdiff(manual, manual1),
                    "jax.grad sharded = one device": jdiff(auto, manual1),
                    "manual = jax.grad sharded": jdiff(manual, auto)}

        case = case_name(cname, names, shape, sequence)
        out.update({f"{case}: {k}": float(v) for k, v in sharded(blocks, x, loss1, manual1).items()})
        out[f"{case}: leaves"] = float(len(leaves(manual1)))
        out.update({f"{case}: {k}": v for k, v in collectives(config, mesh, blocks, x, r, sequence).items()})
    out.update(whole_model(devices))
    out.update(sampling(devices))
    out.update(adapters(devices))
    out.update(vocab_head(devices))
    return out


# (mesh axes, sizes, the logits' softcap, loss_chunk): V = 11 pads to 12 columns on either
VOCAB_MESHES = [(("tensor",), (4,), 0.0, 0), (("data", "tensor"), (2, 2), 2.0, 7)]


def vocab_case(names, shape, cap, chunk) -> str:
    return f"vocab {'x'.join(f'{n}={s}' for n, s in zip(names, shape))}{f' cap {cap}' if cap else ''}" \
           f"{f' chunk {chunk}' if chunk else ''}"


def vocab_head(devices) -> dict:
    """The head and cross entropy with the vocabulary split (parallel/vocab.py): the manual
    gradients and jax.grad through the split forward against jax.grad of one device's head and
    loss, and the manual program's collectives as lowered."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jaxformer.model.linear import linear
    from jaxformer.model.losses import cross_entropy
    from jaxformer.model.parallel.vocab import vocab_head_loss
    from jaxformer.model.softcap import softcap
    from manual_grads.parallel.vocab import vocab_head_loss_grads

    rng = np.random.default_rng(3)
    B, T, D, V = 4, 5, 6, 11
    p = {"w": jnp.asarray(rng.standard_normal((D, V))), "b": jnp.asarray(rng.standard_normal(V))}
    x = jnp.asarray(rng.standard_normal((B, T, D)))
    targets = jnp.asarray(rng.integers(0, V, (B, T)))
    mask = jnp.asarray(rng.integers(0, 2, (B, T)).astype(np.float64))
    leaves = jax.tree_util.tree_leaves
    diff = lambda a, b: max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(leaves(a), leaves(b), strict=True))  # noqa: E731
    out = {}
    for names, shape, cap, chunk in VOCAB_MESHES:
        capped = (lambda z: softcap(z, cap)) if cap else (lambda z: z)  # noqa: E731
        loss1, grads1 = jax.value_and_grad(
            lambda p, x: cross_entropy(capped(linear(x, p["w"], p["b"])), targets, mask), (0, 1))(p, x)
        mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape), names)
        case = vocab_case(names, shape, cap, chunk)
        manual = jax.jit(lambda p, x: vocab_head_loss_grads(p, x, targets, mask, mesh, None, cap, chunk))
        loss, dp, dx = manual(p, x)
        auto_loss, auto = jax.jit(jax.value_and_grad(
            lambda p, x: vocab_head_loss(p, x, targets, mask, mesh, None, cap, chunk), (0, 1)))(p, x)
        out[f"{case}: loss"] = max(abs(float(loss - loss1)), abs(float(auto_loss - loss1)))
        out[f"{case}: manual = one device"] = diff((dp, dx), grads1)
        out[f"{case}: jax.grad sharded = one device"] = diff(auto, grads1)
        kinds = re.findall(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)",
                           manual.lower(p, x).as_text())
        out[f"{case}: all-reduces"] = kinds.count("all_reduce")
        out[f"{case}: other collectives"] = len(kinds) - kinds.count("all_reduce")
    return out


# the whole model on data=2 x tensor=2 (sequence_parallel: T split too; remat "block": each block's
# forward run again in the backward; dropout: each device draws its piece of one device's masks,
# on its rows, heads and (sequence_parallel) tokens; the blockwise core's masks block pair by pair;
# layers of two kinds: each layer's own config, its inputs kept alone;
# MoE: the experts' hidden features split, the router's statistics over the whole batch). The plain
# "llama" is not among them: its options (post RMS norm, the tied head, the logits' soft cap,
# loss_chunk, 2 key/value heads split) are each of the three Llama-like ones here, and its full core
# on a tensor axis GPT-2's here and test_mesh_covering.py's Llama-like one's
WHOLE = ("gpt2", "gpt2-sequence-remat-dropout", "llama-mixed-blockwise-dropout", "moe-sequence",
         "llama-pallas-sequence")


def whole_model(devices) -> dict:
    """The whole model under ``jax.set_mesh`` of a data=2 x tensor=2 mesh: its blocks run tensor
    parallel (model/parallel/tensor.tensor_mesh), the embedding's rows and the head's columns split
    over tensor (parallel/vocab.py); loss and gradients of manual_grads.value_and_grad and of jax.grad against one device's
    manual ones, per leaf."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import manual_grads
    from jaxformer import loss_fn
    from jaxformer.model.params import init_params

    out, leaves = {}, jax.tree_util.tree_leaves
    mesh = Mesh(devices[:4].reshape(2, 2), ("data", "tensor"))
    for cname in WHOLE:
        config = configs()[cname]
        rng = np.random.default_rng(2)
        shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
        params = jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), shapes)
        inputs = jnp.asarray(rng.integers(0, config.vocab_size, (4, 8)))
        batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1)}
        key = jax.random.PRNGKey(7) if config.dropout else None  # the step's dropout key
        sources = (("manual", lambda p, b, c: manual_grads.value_and_grad(p, b, c, key=key)),
                   ("jax.grad", lambda p, b, c: jax.value_and_grad(loss_fn)(p, b, c, key=key)))
        loss1, grads1 = jax.jit(sources[0][1], static_argnums=2)(params, batch, config)
        if key is not None:  # the masks drop something: without them the loss is another
            out[f"whole {cname}: dropout's effect"] = abs(float(loss1) - float(jax.jit(
                loss_fn, static_argnums=2)(params, batch, config)))  # the forward alone
        params, batch = jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(batch, NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            for name, f in sources:
                loss, grads = jax.jit(f, static_argnums=2)(params, batch, config)
                out[f"whole {cname}: {name} loss"] = abs(float(loss) - float(loss1))
                out[f"whole {cname}: {name} = one device"] = max(
                    float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(grads), leaves(grads1), strict=True))
            # the embedding's rows split over tensor: the lookup gathers from device i's (V/t, D) = (6, 16)
            # slice of tok_embed (padded from 11 rows), not from the whole (11, 16) table
            for name, f in sources:
                traced = jax.jit(f, static_argnums=2).trace(params, batch, config)
                out[f"whole {cname}: {name} kernels"] = str(traced.jaxpr).count("pallas_call")
                lowered = traced.lower().as_text()
                if name == "manual":
                    out[f"whole {cname}: all-gathers"] = lowered.count("stablehlo.all_gather")  # the sequence's, T
                out[f"whole {cname}: {name} table slices"] = len(re.findall(r"gather.*\(tensor<6x16xf64>", lowered))
                out[f"whole {cname}: {name} whole tables"] = len(re.findall(r"gather.*\(tensor<11x16xf64>", lowered))
        out[f"whole {cname}: leaves"] = len(leaves(grads1))
    return out


LORA_CASE = "lora llama sequence dropout data=2 x tensor=4"


def adapters(devices) -> dict:
    """LoRA adapters with dropout 0.25 on every projection of the Llama-like model with sequence
    parallelism on data=2 x tensor=4 (its 2 key/value heads replicated: their adapters' B through
    kv_columns): each device draws its rows' piece of each adapter's mask, beside a row-parallel
    weight its block of the input's features too."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    config = configs()["llama"].replace(sequence_parallel=True)
    inputs = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (4, 8)))
    return adapter_differences(LORA_CASE, config, Mesh(devices[:8].reshape(2, 4), ("data", "tensor")), inputs,
                               dropout=0.25)


PROMPT = [1, 5, 2, 7, 3]
SAMPLED = {"tensor=2": ("greedy", "sampled"), "fsdp=2,tensor=2": ("sampled",)}  # {mesh: draws}


def sampling(devices) -> dict:
    """The Llama-like model (max_seq_len 32) sampled split over devices (inference/mesh.py): greedy
    and seeded draws of generate_many on tensor=2, the seeded ones on fsdp=2 x tensor=2 (fsdp only
    lays the weights out: the draw is tensor=2's), against one device's; on tensor=2 the prefill's
    cache as device 0 holds it, and the compiled decode's all-gathers (the greedy draw's program)."""
    import re

    import jax
    import jax.numpy as jnp

    from jaxformer.inference.generate import _decode_many, _prefill_many, generate_many
    from jaxformer.inference.mesh import model_mesh, split_model
    from jaxformer.model.kv_cache import cache_config
    from jaxformer.model.params import init_params

    config, rng = configs()["llama"].replace(max_seq_len=32), np.random.default_rng(4)
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), shapes)
    draws = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, seed=3, num_samples=2)}
    one = {k: generate_many(params, config, PROMPT, 12, **kw) for k, kw in draws.items()}
    out = {}
    for text, kinds in SAMPLED.items():
        split = split_model(params, model_mesh(text, devices))
        for k in kinds:
            kw = draws[k]
            out[f"sampling {text}: {k} tokens differ"] = int(np.sum(generate_many(split, config, PROMPT, 12, **kw) != one[k]))
    split = split_model(params, model_mesh("tensor=2", devices))
    cfg = cache_config(config, len(PROMPT) + 12)
    window = jnp.zeros((1, cfg.max_seq_len), jnp.int32)
    last, cache = _prefill_many(split, window, jnp.int32(len(PROMPT)), config=cfg, prefill=8)
    out["sampling tensor=2: cache shape"] = list(cache["k"].shape)
    out["sampling tensor=2: device 0's cache"] = list(cache["k"].addressable_shards[0].data.shape)
    decode = _decode_many.lower(split, last, window, cache, jnp.int32(len(PROMPT)), jnp.stack([jax.random.PRNGKey(0)]),
                                jnp.float32(0.0), config=cfg, max_new_tokens=12, top_k=0, greedy=True, top_p=1.0)
    gathered = re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} all-gather(?:-start)?\(", decode.compile().as_text())
    out["sampling tensor=2: largest all-gather"] = max((int(np.prod([int(d) for d in g.split(",") if d])) for g in gathered),
                                                       default=0)
    return out


def collectives(config, mesh, blocks, x, r, sequence) -> dict:
    """The manual forward and backward's collectives, counted in the program as lowered (the
    scans' bodies once: one layer) and as compiled: all-reduces over the tensor axis and over
    the others, and every other kind (an all-gather would be a weight or an activation gathered)."""
    import re

    import jax

    from manual_grads.parallel.tensor import tensor_blocks_bwd, tensor_blocks_fwd

    def step(blocks, x):
        return tensor_blocks_bwd(tensor_blocks_fwd(blocks, x, config, mesh, sequence=sequence)[1], r)

    lowered = jax.jit(step).lower(blocks, x)
    text = lowered.as_text()
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    axis = mesh.axis_names.index("tensor")
    groups = np.moveaxis(ids, axis, -1).reshape(-1, ids.shape[axis]).tolist()
    tensor_groups = f"replica_groups = dense<{groups}>".replace(" ", "")
    reduces = re.findall(r"stablehlo\.all_reduce.*?replica_groups = dense<[^>]*>", text.replace("\n", " "))
    tensor = sum(tensor_groups in r.replace(" ", "") for r in reduces)
    kinds = re.findall(r"stablehlo\.(all_gather|reduce_scatter|all_to_all|collective_permute)", text)
    compiled = re.findall(r" (all-gather|all-to-all|collective-permute)(?:-start)?\(", lowered.compile().as_text())
    return {"tensor all-reduces": tensor, "other all-reduces": len(reduces) - tensor,
            "all-gathers": kinds.count("all_gather"), "reduce-scatters": kinds.count("reduce_scatter"),
            "compiled all-gathers": compiled.count("all-gather"),
            "permutes": len(kinds) - kinds.count("all_gather") - kinds.count("reduce_scatter") + len(compiled)
            - compiled.count("all-gather")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return once_per_run(tmp_path_factory, "tensor_parallel", lambda: run_cases_on_8_devices("test_tensor_parallel"))  # one run, not one a worker


@pytest.mark.parametrize("name", REGIONS)
def test_region_backward_equals_vjp(results, name):
    assert results[f"region {name}"] <= TOL


@pytest.mark.parametrize("case", [case_name(*c) for c in CASES])
def test_blocks_equal_one_device(results, case):
    assert results[f"{case}: leaves"] >= 12  # every block leaf compared
    for what in ("loss", "manual = one device", "jax.grad sharded = one device",
                 "manual = jax.grad sharded"):
        assert results[f"{case}: {what}"] <= TOL, (what, results[f"{case}: {what}"])


@pytest.mark.parametrize("names, shape, cap, chunk", VOCAB_MESHES)
def test_vocab_split_head_and_loss_equal_one_device(results, names, shape, cap, chunk):
    """Loss and gradients (w, b, x) equal one device's to 1e-10, by hand and by jax.grad, with a
    vocabulary the axis does not divide (padded), and with the logits' softcap and loss_chunk;
    the manual program reduces over the tensor axis four times (the max, the sum of
    exponentials, the target's logit, dx: a chunked scan's body counted once), over the batch
    axes four more (the loss's sums, dw, db), and gathers nothing: no device holds a (..., V) row."""
    case = vocab_case(names, shape, cap, chunk)
    for what in ("loss", "manual = one device", "jax.grad sharded = one device"):
        assert results[f"{case}: {what}"] <= TOL, what
    assert results[f"{case}: all-reduces"] == 4 + (4 if "data" in names else 0)
    assert results[f"{case}: other collectives"] == 0


def test_a_model_split_over_devices_samples_as_one_device(results):
    """generate_many on params split as training stores them (inference/mesh.py): the greedy and
    the seeded draws equal one device's token for token on tensor=2, the seeded on fsdp=2 x tensor=2; the
    prefill's key/value cache is split along its heads (device 0 holds 1 of the 2); the decode
    gathers no weight (the smallest, a layer's wk, has 16 x 8 entries), only vectors (the MLP's
    split biases of 24, the head's argmax over its vocabulary split)."""
    for text, draws in SAMPLED.items():
        for draw in draws:
            assert results[f"sampling {text}: {draw} tokens differ"] == 0, (text, draw)
    L, B, Hkv, S, Dh = results["sampling tensor=2: cache shape"]
    assert (L, B, Hkv, Dh) == (2, 1, 2, 4) and S >= len(PROMPT) + 12
    assert results["sampling tensor=2: device 0's cache"] == [L, B, Hkv // 2, S, Dh]
    assert 0 < results["sampling tensor=2: largest all-gather"] < 16 * 8


def test_lora_adapters_on_a_tensor_mesh_equal_one_device(results):
    """The adapters' loss and every leaf of their gradient (q, k, v, o, gate, up, down's A and B),
    by hand and by jax.grad, equal one device's to 1e-10: column-parallel weights' B split by
    columns, row-parallel weights' A by rows, the replicated key/value weights' B read through
    kv_columns, with the activations split along T between the sublayers and the adapters'
    dropout (each device its piece of one device's masks; the masks change the loss)."""
    assert_adapters_equal_one_device(results, LORA_CASE, 14, TOL)


def test_sampling_mesh_refusals():
    import jax

    from jaxformer.inference.mesh import model_mesh
    for text, message in [("data=2,tensor=2", "sampling splits the model, not the batch or the sequence (data=2)"),
                          ("tensor=2,context=2", "(context=2)"), ("tensor=2", "needs 2 devices; 1 in use")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            model_mesh(text, jax.devices()[:1])
    assert model_mesh("tensor=1", jax.devices()[:1]).size == 1


@pytest.mark.parametrize("cname", WHOLE)
def test_whole_model_on_a_tensor_mesh_equals_one_device(results, cname):
    """GPT-2's block with its own head (and again with sequence_parallel and remat "block"); the
    Llama-like ones tied to the embedding, with the logits' soft cap and loss_chunk: the head's
    vocabulary and the embedding's rows split (11 tokens, padded to 12) in each."""
    import jax

    from jaxformer.model.params import init_params
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), configs()[cname]))
    assert results[f"whole {cname}: leaves"] == len(jax.tree_util.tree_leaves(params))  # every leaf compared
    # sequence_parallel: each sublayer gathers its input along T (two a layer, forward and backward;
    # remat "block": two more, the block's forward run again in the backward); a whole-projection
    # QK-norm: its two scales' gradients, each device's block of them (scatter_to_tensor_bwd)
    config = configs()[cname]
    assert results[f"whole {cname}: all-gathers"] == (4 + 2 * (config.remat == "block")) * config.sequence_parallel \
        + 2 * (config.qk_norm_scope == "projection")
    for name in ("manual", "jax.grad"):
        assert results[f"whole {cname}: {name} table slices"] == 1, name  # the embedding's rows split too
        assert results[f"whole {cname}: {name} whole tables"] == 0, name
        assert results[f"whole {cname}: {name} loss"] <= TOL
        assert results[f"whole {cname}: {name} = one device"] <= TOL, name
        if config.attention_impl == "pallas":  # the kernels ran on each device's heads: forward (and backward)
            assert results[f"whole {cname}: {name} kernels"] > 0, name
    if config.dropout:  # the masks dropped something (the equalities above hold each device to its piece)
        assert results[f"whole {cname}: dropout's effect"] > 1e-3


def psum_leaves(config, t: int, sequence: bool) -> int:
    """The replicated leaves whose gradient the manual backward sums over the tensor axis: those
    each device reads per head (attention_local_params: QK-norm's scales, the key/value weights
    when t does not divide their heads) and, with sequence parallelism, those the token-split
    layers read (the norms, the row-parallel biases)."""
    import jax

    from jaxformer.model.parallel.tensor import KV, ROW_BIAS, split_kv
    from jaxformer.model.params import init_params
    blocks = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))["blocks"]
    attn = blocks["attn"]
    names = ["q_norm", "k_norm"] + ([] if split_kv(config, t) else list(KV))
    n = sum(len(jax.tree_util.tree_leaves(attn[k])) for k in names if k in attn)
    if sequence:
        n += sum(len(jax.tree_util.tree_leaves(blocks[k])) for k in ("ln1", "ln2", "ln1_post", "ln2_post") if k in blocks)
        n += sum(b in blocks[s] for s in ("attn", "ffn") for b in np.atleast_1d(ROW_BIAS[s]))
    return n


@pytest.mark.parametrize("cname, names, shape, sequence", CASES)
def test_collectives_are_the_regions_and_the_batch_sum(results, cname, names, shape, sequence):
    """A layer's manual forward and backward over the tensor axis: the two row-parallel sums
    (forward) and the two copy_to_tensor transposes (backward), or with sequence parallelism two
    all-gathers and two reduce-scatters each way; one psum for each replicated leaf summed over the
    tensor axis (psum_leaves); over the batch axes one psum per gradient leaf; nothing else: no
    weight is gathered, and without sequence parallelism no activation either."""
    import jax

    from jaxformer.model.params import init_params
    config = configs()[cname]
    case = case_name(cname, names, shape, sequence)
    t = dict(zip(names, shape))["tensor"]
    regions = 0 if sequence else 4
    assert results[f"{case}: tensor all-reduces"] == regions + psum_leaves(config, t, sequence)
    assert results[f"{case}: all-gathers"] == results[f"{case}: reduce-scatters"] == (4 if sequence else 0)
    if not sequence:
        assert results[f"{case}: compiled all-gathers"] == 0
    n_leaves = len(jax.tree_util.tree_leaves(jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))["blocks"]))
    assert results[f"{case}: other all-reduces"] == (n_leaves if len(names) > 1 else 0)
    assert results[f"{case}: permutes"] == 0


@pytest.mark.parametrize("field, value, t, words", [
    ("n_heads", 4, 8, "mesh axis tensor=8 does not divide n_heads 4: the tensor size must divide n_heads"),
    ("d_ff", 24, 16, "mesh axis tensor=16 does not divide n_heads 4"),
    ("d_ff", 30, 4, "mesh axis tensor=4 does not divide d_ff 30: the tensor size must divide d_ff"),
])
def test_mesh_that_does_not_divide_is_refused(field, value, t, words):
    config = configs()["llama"]
    config = dataclasses.replace(config, **{field: value})
    with pytest.raises(ValueError) as err:
        check_tensor(config, t)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_sequence_that_does_not_divide_is_refused():
    with pytest.raises(ValueError) as err:
        check_tensor(configs()["gpt2"], 4, seq_len=10)
    assert str(err.value) == ("mesh axis tensor=4 does not divide the sequence length 10: "
                              "the tensor size must divide the sequence length")
    check_tensor(configs()["gpt2"], 4)  # without sequence parallelism T is not split


def test_key_value_heads_that_do_not_divide_are_replicated():
    check_tensor(configs()["llama"], 4)  # 2 key/value heads over tensor=4: replicated, not refused


def test_whole_projection_qk_norm_needs_the_key_value_heads_split():
    config = configs()["llama"].replace(qk_norm_scope="projection")  # 2 key/value heads
    check_tensor(config, 2)
    with pytest.raises(ValueError) as err:
        check_tensor(config, 4)
    assert str(err.value) == ("mesh axis tensor=4 does not divide n_kv_heads 2: with qk_norm_scope 'projection' the "
                              "tensor size must divide n_kv_heads (k's norm over its heads' features)")


@pytest.mark.parametrize("changes, what", [
    (dict(attention_impl="cudnn", compute_dtype="bfloat16"), "attention_impl 'cudnn'"),
])
def test_unsupported_options_are_refused(changes, what):
    with pytest.raises(ValueError, match=f"tensor=2: tensor parallelism does not run {what}"):
        check_tensor(dataclasses.replace(configs()["gpt2"], **changes), 2)
    check_tensor(dataclasses.replace(configs()["gpt2"], **changes), 1)  # one device runs them
