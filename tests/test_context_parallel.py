"""Context parallelism for the whole model (jaxformer/model/parallel/context.py, its manual pair
manual_grads/parallel/context.py) equals one device.

One subprocess on 8 forced CPU devices, float64, runs every multi-device case and returns the
largest differences: the whole model (B=4, T=16, 2 layers) under ``jax.set_mesh`` of a mesh with
a context axis, its blocks ring-attention context parallel (model/parallel/context.context_mesh):
the GPT-2-like config (learned positions, pre layer norm, GELU, biases) on data=2 x context=2,
the Llama-like one (post RMS norm, gated SiLU, rotary positions at each token's global position,
2 key/value heads for 4 query heads, QK-norm, tied head, logits' soft cap, loss_chunk; the full
core) with remat "block" (each block's forward run again in the backward) and dropout 0.1 on
context=2 with packed documents whose boundaries cut through the chunks; with a tensor axis
beside (the blocks tensor parallel, the vocabulary split): the GPT-2-like one with dropout 0.1 on
data=2 x tensor=2 x context=2 (the dropout cases: one step key for every source, and the masks
change the loss), the Llama-like one with the blockwise core (each ring visit's keys 2 at a time;
dropout 0.1, its masks one per block pair), the scores' soft cap, layers of two kinds (a sliding
window with its own rotary base, then full attention), documents and remat "block" on tensor=2 x
context=4; a mixture of experts (the Llama-like one with 4 experts, 2 a token, a shared expert,
the load-balancing and z losses) with documents on expert=2 x context=2 (the batch's rows split
over expert, the experts whole on each device inside the ring); the Llama-like one with the
Pallas kernels in the ring's visits (interpreted), packed documents and a sliding window of 6
keys (read on the global positions) on data=2 x context=2; LoRA adapters over the full-core one
with dropout and documents on data=2 x context=2 and tensor=2 x context=2. Each mesh's loss and
every gradient leaf, of manual_grads.value_and_grad and of jax.grad of loss_fn, against one
device's manual ones, to 1e-10; the manual program's collectives counted, and every program's
logits shapes. The refusals run in this process."""

import dataclasses
import time

import numpy as np
import pytest
from helpers import adapter_differences, assert_adapters_equal_one_device, once_per_run, run_cases_on_8_devices

from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_kinds import mixed
from jaxformer.model.parallel.context import check_context_model

pytestmark = pytest.mark.xdist_group("test_context_parallel")  # one worker: the other goes on while its subprocess runs

TOL = 1e-10
B, T = 4, 16
# packed rows: boundaries inside the zig-zag pieces (n = 4 tokens on context=2)
DOCUMENTS = [[0] * 5 + [1] * 11, [0] * 11 + [1] * 5, [0] * 3 + [1] * 6 + [2] * 7, [0] * 16]
# (model, mesh axes, sizes, packed documents)
CASES = [("gpt2", ("data", "context"), (2, 2), False), ("llama-remat-dropout", ("context",), (2,), True),
         ("moe", ("expert", "context"), (2, 2), True), ("llama-pallas", ("data", "context"), (2, 2), True)]
# with a tensor axis beside: the blocks tensor parallel (heads, key/value heads, MLP columns and
# rows split over it), attention the ring, the head's vocabulary split over tensor (V = 11 padded)
TENSOR_CASES = [("gpt2-dropout", ("data", "tensor", "context"), (2, 2, 2), False),
                ("llama-blockwise-remat-dropout", ("tensor", "context"), (2, 4), True)]


def case_name(cname, names, shape, documents) -> str:
    return f"{cname} {'x'.join(f'{n}={s}' for n, s in zip(names, shape))}{' documents' if documents else ''}"


def configs():
    base = dict(vocab_size=11, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=T)
    gpt2 = ModelConfig(**base)
    llama = ModelConfig(**base, norm="post", norm_type="rms", mlp="gated", activation="silu", positions="rope",
                        n_kv_heads=2, qk_norm=True, tie_embeddings=True, head_bias=False, logit_softcap=3.0,
                        loss_chunk=5)
    # the blockwise core's visits (keys 2 at a time: the pieces of context=4 hold 2 tokens), the
    # scores capped, layers of two kinds: a sliding window of 6 keys (its own rotary base), then full attention
    blockwise = llama.replace(attention_impl="blockwise", attention_block=2, attn_softcap=5.0, sliding_window=6,
                              layer_types=("sliding_attention", "full_attention"), rope_local_theta=100.0)
    # mixture of experts (4, 2 a token) with a shared expert, the load-balancing and z losses
    moe = llama.replace(bias=False, n_experts=4, experts_per_token=2, shared_expert_d_ff=8, moe_aux_loss_coef=0.1,
                        router_z_loss_coef=0.01)
    # dropout (0.1, one step key): each device draws its rows', heads' and tokens' piece of one device's masks
    return {"gpt2": gpt2, "gpt2-dropout": gpt2.replace(dropout=0.1), "llama": llama,
            "llama-remat-dropout": llama.replace(remat="block", dropout=0.1),
            # the kernels interpreted, in float64; every layer a sliding window of 6 keys (the kernels
            # read the tokens' global positions; layers of two kinds, a lax.switch of two rings, are
            # the blockwise case's: here they doubled the interpreted kernels' trace and compile)
            "llama-pallas": llama.replace(attention_impl="pallas", sliding_window=6),
            "llama-blockwise-remat-dropout": blockwise.replace(remat="block", dropout=0.1), "moe": moe}


def collectives(lowered, compiled) -> dict:
    """A program's collectives as lowered (the shard_maps' own: what the manual code writes, a
    scan's body counted once) and as compiled (with what the partitioner adds outside them)."""
    import re

    kinds = re.findall(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)",
                       lowered.as_text())
    done = re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                      compiled.as_text())
    out = {f"lowered {k}": kinds.count(k) for k in ("collective_permute", "all_reduce", "all_gather",
                                                      "reduce_scatter", "all_to_all")}
    out.update({f"compiled {k}": done.count(k) for k in ("collective-permute", "all-reduce", "all-gather",
                                                           "reduce-scatter", "all-to-all")})
    return out


def table_scatters(text: str, config) -> list[int]:
    """The row counts of the (rows, D) arrays the lowered program scatter-adds into: the
    embedding's backward writes its rows of tok_embed (V = 11, or V/t = 6 of the padded 12 a
    device of tensor=2 holds)."""
    import re

    shapes = re.findall(r'"stablehlo\.scatter"\(%[^,]+, [^)]*\)[\s\S]*?\) -> tensor<(\d+)x(\d+)xf64>', text)
    return sorted(int(r) for r, d in shapes if int(d) == config.d_model)


def logits_shapes(compiled, config, rows: int, t: int) -> dict:
    """How many of the compiled (per device) program's values are logits over the whole
    sequence (rows, T, V/t) and over one device's tokens (rows, T/c, V/t), ``rows`` the batch's
    rows on a device, V/t its columns of a tensor axis of t (V padded to a multiple of t)."""
    import re

    v = -(-config.vocab_size // t)
    shapes = [tuple(map(int, s)) for s in re.findall(r"f64\[(\d+),(\d+),(\d+)\]", compiled.as_text())]
    return {"full-sequence logits": sum(s == (rows, T, v) for s in shapes),
            "local logits": sum(s[0] == rows and s[1] < T and s[2] == v for s in shapes)}


def run_cases() -> dict:
    """The subprocess' body: {name: number}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import manual_grads
    from jaxformer import loss_fn
    from jaxformer.model.parallel.regions import batch_axes
    from jaxformer.model.params import init_params

    out, leaves = {}, jax.tree_util.tree_leaves
    devices = np.array(jax.devices())
    diff = lambda a, b: max(float(jnp.max(jnp.abs(u - v)))  # noqa: E731
                            for u, v in zip(leaves(a), leaves(b), strict=True))
    start = time.perf_counter()
    for case in CASES + TENSOR_CASES:
        cname, names, shape, documents = case
        name, config = case_name(*case), configs()[cname]
        rng = np.random.default_rng(2)
        shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
        params = jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), shapes)
        inputs = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)))
        batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1)}
        if documents:
            batch["segments"] = jnp.asarray(DOCUMENTS)
        key = jax.random.PRNGKey(7) if config.dropout else None  # one step's dropout key, every source's
        loss1, grads1 = jax.jit(manual_grads.value_and_grad, static_argnums=2)(params, batch, config, key)
        if key is not None:  # the masks change the loss (without the key: the loss alone, no gradient)
            out[f"{name}: dropout's effect"] = abs(float(loss1) - float(jax.jit(loss_fn, static_argnums=2)(
                params, batch, config)))
        mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape), names)
        rows = P(batch_axes(mesh) or None)  # the rows over data (or expert), where the mesh has it
        sizes = dict(zip(names, shape))
        per_device = B // int(np.prod([sizes[a] for a in batch_axes(mesh)]))  # the batch's rows on a device
        params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
        batch = jax.device_put(batch, NamedSharding(mesh, rows))
        with jax.set_mesh(mesh):
            sources = (("manual", lambda p, b, c: manual_grads.value_and_grad(p, b, c, key)),
                       ("jax.grad", jax.value_and_grad(lambda p, b, c: loss_fn(p, b, c, key=key))))
            for what, f in sources:
                traced = jax.jit(f, static_argnums=2).trace(params, batch, config)  # one trace, read twice
                if config.attention_impl == "pallas":  # the kernels are in the program, not a stand-in
                    out[f"{name}: {what} pallas_calls"] = str(traced.jaxpr).count("pallas_call")
                lowered = traced.lower()
                compiled = lowered.compile()
                if what == "manual":
                    out.update({f"{name}: {k}": n for k, n in collectives(lowered, compiled).items()})
                    out[f"{name}: table rows scattered into"] = table_scatters(lowered.as_text(), config)
                out.update({f"{name}: {what} {k}": n for k, n in logits_shapes(compiled, config, per_device, sizes.get("tensor", 1)).items()})
                loss, grads = compiled(params, batch)
                out[f"{name}: {what} loss"] = abs(float(loss) - float(loss1))
                out[f"{name}: {what} = one device"] = diff(grads, grads1)
                out[f"{name}: {what} leaves"] = len(leaves(grads))
        out[f"{name}: leaves"] = len(leaves(grads1))
    out.update(lora_differences(devices))
    out["seconds"] = time.perf_counter() - start
    return out


LORA_CASE = "lora llama data=2xcontext=2 documents dropout"
LORA_TENSOR_CASE = "lora llama tensor=2xcontext=2 documents dropout"


def lora_differences(devices) -> dict:
    """LoRA adapters with dropout 0.25 on every projection over the Llama-like base, with packed
    documents, on data=2 x context=2 and on tensor=2 x context=2 (helpers.adapter_differences):
    each device draws its rows' and zig-zag tokens' piece of one device's masks (on the tensor axis
    a row-parallel adapter's features' block too). The adapters act token by token: the core is
    the full one (the ring's blockwise core is the whole-model cases'). Both meshes' batch is one:
    one device's programs (the reference and the loss without the key) compile once."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    config = configs()["llama"]
    inputs = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (B, T)))
    out = adapter_differences(LORA_CASE, config, Mesh(devices[:4].reshape(2, 2), ("data", "context")), inputs,
                              jnp.asarray(DOCUMENTS), dropout=0.25)
    return out | adapter_differences(LORA_TENSOR_CASE, config, Mesh(devices[:4].reshape(2, 2), ("tensor", "context")),
                                     inputs, jnp.asarray(DOCUMENTS), dropout=0.25)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return once_per_run(tmp_path_factory, "context_parallel", lambda: run_cases_on_8_devices("test_context_parallel"))  # one run, not one a worker


@pytest.mark.parametrize("case", CASES + TENSOR_CASES, ids=[case_name(*c) for c in CASES + TENSOR_CASES])
def test_whole_model_on_a_context_mesh_equals_one_device(results, case):
    """Loss and every gradient leaf, by hand and by jax.grad through the ring's forward, equal one
    device's manual ones to 1e-10."""
    import jax

    from jaxformer.model.params import init_params
    name = case_name(*case)
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), configs()[case[0]]))
    n = len(jax.tree_util.tree_leaves(params))
    assert results[f"{name}: leaves"] == n  # every leaf compared
    for what in ("manual", "jax.grad"):
        assert results[f"{name}: {what} leaves"] == n
        assert results[f"{name}: {what} loss"] <= TOL, (what, results[f"{name}: {what} loss"])
        assert results[f"{name}: {what} = one device"] <= TOL, (what, results[f"{name}: {what} = one device"])
        if configs()[case[0]].attention_impl == "pallas":  # the ring's visits are the kernels
            assert results[f"{name}: {what} pallas_calls"] > 0, what
    if configs()[case[0]].dropout:  # one key for every source: the masks are one device's, and they act
        assert results[f"{name}: dropout's effect"] > 1e-4


@pytest.mark.parametrize("case", [LORA_CASE, LORA_TENSOR_CASE])
def test_lora_adapters_on_a_context_mesh_equal_one_device(results, case):
    """The adapters' loss and every leaf of their gradient (q, k, v, o, gate, up, down's A and B:
    14 leaves), with their dropout, by hand and by jax.grad, equal one device's manual ones to
    1e-10 (and the masks change the loss)."""
    assert_adapters_equal_one_device(results, case, 14, TOL)


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_without_tensor_the_embedding_backward_scatters_into_the_whole_table(results, case):
    """Without a tensor axis each device scatter-adds its tokens' rows into the whole (11, 16)
    table (then summed over the devices): the count above sees the table where it is."""
    assert configs()[case[0]].vocab_size in results[f"{case_name(*case)}: table rows scattered into"]


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_manual_collectives_are_the_ring_and_the_gradient_sums(results, case):
    """As lowered (the layer scans' bodies once): the ring's ppermutes, k and v (and the ids) in the
    forward (twice with remat "block": the backward's forward again), the same with dK, dV beside
    them in the backward and dK, dV's final hop; one all-reduce
    per gradient leaf (summed over context and the batch axes; a tied head's w and tok_embed's each
    once), two for the loss (each device's token count, its share of the mean) and, with experts,
    three for the router's statistics over the whole batch (their pmeans); no all-gather,
    no all-to-all, no reduce-scatter, as lowered or as compiled: no device gathers a (B, T, D)
    activation, nor the keys and values, nor the tokens around the embedding and the head."""
    import jax

    from jaxformer.model.params import init_params
    name, documents = case_name(*case), case[3]
    config = configs()[case[0]]
    n = 3 if documents else 2  # k, v (and the ids)
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    # remat "block" and mixed layer kinds: the backward runs the forward's ring again; with mixed
    # kinds each kind's branch of the layer (lax.switch) is lowered, with its own ring
    kinds = 2 if mixed(config) else 1
    forwards = 2 if config.remat == "block" or kinds > 1 else 1
    assert results[f"{name}: lowered collective_permute"] == kinds * (forwards * n + (n + 2) + 2)
    stats = 3 if config.n_experts else 0  # MoE: the pmeans of the router's statistics (load, probs, z)
    assert results[f"{name}: lowered all_reduce"] == (len(jax.tree_util.tree_leaves(params)) + config.tie_embeddings
                                                      + 2 + stats)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert results[f"{name}: lowered {kind}"] == 0, kind
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert results[f"{name}: compiled {kind}"] == 0, kind


@pytest.mark.parametrize("case", [CASES[0], TENSOR_CASES[0]], ids=[case_name(*CASES[0]), case_name(*TENSOR_CASES[0])])
def test_no_device_holds_the_whole_sequence_s_logits(results, case):
    """The compiled programs of the unchunked head (GPT-2-like on data=2 x context=2, and with
    tensor=2 beside: the vocabulary split too), per device: logits of the device's own T/c tokens,
    never of all T, by hand and through jax.grad (the tokens are put in the ring's order before
    the embedding and never put back)."""
    name = case_name(*case)
    for what in ("manual", "jax.grad"):
        assert results[f"{name}: {what} full-sequence logits"] == 0, what
        assert results[f"{name}: {what} local logits"] > 0, what  # the count sees logits where they are


@pytest.mark.parametrize("case", TENSOR_CASES, ids=[case_name(*c) for c in TENSOR_CASES])
def test_tensor_beside_context_gathers_no_activation(results, case):
    """With a tensor axis beside the context axis, the manual program as lowered: the ring's
    permutes as without it, no all-gather, reduce-scatter or all-to-all (the row-parallel sums and
    the vocabulary's reductions are all-reduces; with remat "block" the forward's permutes twice);
    the embedding's backward scatters into a device's 6 rows of tok_embed (V = 11 padded to 12
    over tensor=2), never into the whole table; compiled, at most the gradient leaves split along
    V over tensor (the head's w and b, tok_embed; tied: tok_embed alone), gathered into the
    replicated arrays the test asks for (training stores them split)."""
    name, documents = case_name(*case), case[3]
    n = 3 if documents else 2
    config = configs()[case[0]]
    kinds = 2 if mixed(config) else 1  # mixed layer kinds: each kind's branch lowered, as above
    forwards = 2 if config.remat == "block" or kinds > 1 else 1  # remat "block": the ring's forward again
    assert results[f"{name}: lowered collective_permute"] == kinds * (forwards * n + (n + 2) + 2)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert results[f"{name}: lowered {kind}"] == 0, kind
    assert 6 in results[f"{name}: table rows scattered into"]
    assert config.vocab_size not in results[f"{name}: table rows scattered into"]
    split_leaves = 1 if config.tie_embeddings else 3
    assert results[f"{name}: compiled all-gather"] <= split_leaves


# ---------------------------------------------------------------- in this process: the refusals


def refusal(config, c=2, seq_len=T, t=1) -> str:
    with pytest.raises(ValueError) as err:
        check_context_model(config, c, seq_len, t)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("changes, what", [
    (dict(attention_impl="cudnn"), "attention_impl 'cudnn' (the ring's visits are the full or the blockwise "
                                   "core's math, or the Pallas kernels: use attention_impl 'full', 'blockwise' or "
                                   "'pallas')"),
    (dict(attention_impl="blockwise", attention_block=3), "attention_block 3 with pieces of 4 tokens (the ring's "
                                                          "visits fold 4 or 8 keys: the block must divide 4, or be "
                                                          "at least 8)"),
])
def test_unsupported_options_are_refused(changes, what):
    config = dataclasses.replace(configs()["gpt2"], **changes)
    assert refusal(config).startswith(f"mesh axis context=2: context parallelism does not run {what}")
    check_context_model(config, 1, T)  # one device runs them


def test_blockwise_blocks_that_fit_the_pieces_run():
    """On context=2 (pieces of 4 tokens, visits of 4 or 8 keys) a block dividing 4, or of 8 keys
    and more (a visit's keys at once), runs; 3, 5 and 6 are refused (above)."""
    for block in (1, 2, 4, 8, 128):
        check_context_model(configs()["gpt2"].replace(attention_impl="blockwise", attention_block=block), 2, T)
    for block in (3, 5, 6):
        assert "attention_block" in refusal(configs()["gpt2"].replace(attention_impl="blockwise", attention_block=block))


def test_sequence_parallel_beside_context_is_refused():
    config = dataclasses.replace(configs()["llama"], sequence_parallel=True)
    assert refusal(config, t=2) == ("mesh axis context=2: context parallelism does not run sequence_parallel beside "
                                    "a tensor axis (tensor=2: the tokens are split over context already) yet; "
                                    "use context=1")
    check_context_model(configs()["llama"], 2, T, 2)  # tensor beside context runs


def test_sequence_that_does_not_fit_is_refused():
    assert refusal(configs()["gpt2"], c=4, seq_len=20) == (
        "mesh axis context=4 does not fit the sequence length 20: 2 x context = 8 (the zig-zag layout's equal "
        "pieces) must divide the sequence length")
    check_context_model(configs()["gpt2"], 4, 16)


def test_tap_and_custom_layers_are_refused():
    """Under a mesh with a context axis (abstract: traced only), a tap and custom layers are refused."""
    import jax
    import jax.numpy as jnp

    import manual_grads
    from jaxformer import loss_fn
    from jaxformer.model.params import init_params
    from jaxformer.model.transformer import MODEL_LAYERS

    config = configs()["gpt2"]
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    batch = {"inputs": jnp.zeros((B, T), jnp.int32), "targets": jnp.zeros((B, T), jnp.int32)}

    class Tap:
        def forward(self, *args):
            pass

        def backward(self, *args):
            pass

    layers = MODEL_LAYERS._replace(block=lambda *a, **k: MODEL_LAYERS.block(*a, **k))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("context",))):
        with pytest.raises(ValueError, match="^mesh axis context=2: a tap runs on one device; use context=1"):
            jax.eval_shape(lambda p, b: manual_grads.value_and_grad(p, b, config, tap=Tap()), params, batch)
        with pytest.raises(ValueError, match="^mesh axis context=2: context parallelism runs the model's own layers"):
            jax.eval_shape(lambda p, b: loss_fn(p, b, config, layers), params, batch)
