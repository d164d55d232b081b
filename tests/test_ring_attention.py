"""Context parallelism: ring attention (jaxformer/model/parallel/ring.py) and its hand-derived
backward (manual_grads/parallel/ring.py) equal one device's full core.

One subprocess on 8 forced CPU devices, float64, runs every multi-device case (B=2, H=2,
T=16, Dh=4) and returns the largest differences: the ring's output and row log-sum-exp
against cores.full (and a logsumexp of its masked scores) on one device, the manual (dq, dk,
dv) and jax.vjp through the ring's forward (its shard_map and ppermutes) against jax.vjp of
cores.full with the same random cotangent, each to 1e-10; cases: context=2 and 4, causal,
zig-zag; packed documents whose boundaries cut through the chunks; 1 key/value head for 2
query heads; non-causal with documents; the contiguous layout; the scores' soft cap with a
sliding window, and the blockwise core's visits (keys 2 at a time) with and without them; the
probabilities' dropout (0.25) against one device's core with the same key: the full core's
(context=4, documents, one key/value head), the blockwise core's (a mask per block pair: keys 2
at a time on context=2 with documents, and blocks of 8 keys, wider than the pieces, on context=4). The programs' collectives are
counted as lowered (sites) and in the jaxpr with each scan's trip count (hops actually sent).
The Pallas kernels' ring (ring_flash.py, the kernels interpreted) runs four cases against the
same references (context=4 causal with documents and one key/value head, context=2 non-causal
with documents, a sliding window of 6 on context=4 zig-zag with documents and contiguous
without: the kernels read the tokens' global positions), its collectives counted alike.
The layout's helpers (round trip, equal causal work, every unmasked pair inside the block a
visit computes) and the refusals run in this process."""


import numpy as np
import pytest
from helpers import once_per_run, run_cases_on_8_devices

from jaxformer.model.parallel.ring import (CONTIGUOUS, EARLIER, LATER, SELF, ZIGZAG, check_context, chunk_positions,
                                           from_layout, from_zigzag, layout_order, pair_kind, to_layout, to_zigzag,
                                           visited)

pytestmark = pytest.mark.xdist_group("test_ring_attention")  # one worker: the other goes on while its subprocess runs

TOL = 1e-10
B, H, T, DH = 2, 2, 16, 4
DOCUMENTS = [[0] * 5 + [1] * 11, [0] * 11 + [1] * 5]  # two documents a row: boundaries at 5 and 11
CAPPED_WINDOW = {"softcap": 2.0, "window": 6}  # the scores capped, a query reading its 6 latest keys
# (context size, causal, segments, key/value heads, layout, the ring's options: block K > 0 folds a
# visit's keys K at a time, the blockwise core's way)
CASES = [(2, True, False, 2, ZIGZAG, {}), (4, True, False, 2, ZIGZAG, {}), (4, True, True, 2, ZIGZAG, CAPPED_WINDOW),
         (2, True, True, 1, ZIGZAG, {"block": 2, **CAPPED_WINDOW}), (4, False, True, 2, ZIGZAG, {"block": 2}),
         (4, True, False, 1, CONTIGUOUS, {}), (4, True, True, 1, ZIGZAG, {"dropout": 0.25}),
         (2, True, True, 1, ZIGZAG, {"block": 2, "dropout": 0.25}), (4, True, False, 2, ZIGZAG, {"block": 8, "dropout": 0.25})]
DIFFS = ("output", "lse", "manual = one device", "jax.grad ring = one device", "manual = jax.grad ring")
# The Pallas kernels' ring (ring_flash.py), interpreted: (context size, causal, segments, key/value heads, layout,
# options: a sliding window, read on the global positions)
WINDOW = {"window": 6}  # wider than a piece (2 tokens on context=4): some visits see part of a row's keys, some none
PALLAS_CASES = [(4, True, True, 1, ZIGZAG, {}), (2, False, True, 2, ZIGZAG, {}), (4, True, True, 2, ZIGZAG, WINDOW),
                (4, True, False, 2, CONTIGUOUS, WINDOW)]
PALLAS_DIFFS = ("output", "manual = one device", "jax.grad ring = one device")


def case_name(c, causal, segments, hkv, layout, options) -> str:
    return (f"context={c} {'causal' if causal else 'non-causal'}{' documents' if segments else ''}"
            f"{f' Hkv={hkv}' if hkv != H else ''} {layout}" + "".join(f" {k}={v}" for k, v in options.items()))


def ppermutes_sent(jaxpr, times: int = 1) -> int:
    """The arrays ppermute sends when ``jaxpr`` runs: each ppermute's operands, times the trip
    count of every scan around it."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            n += times * len(eqn.invars)
        inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    n += ppermutes_sent(getattr(sub, "jaxpr", sub), inner)
    return n


def collectives(fn, *args) -> dict:
    """fn(*args)'s collectives: each kind's sites in the lowered StableHLO, and the arrays its
    ppermutes send when run (``ppermutes_sent``); one trace read both ways."""
    import re

    import jax

    traced = jax.jit(fn).trace(*args)
    kinds = re.findall(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)",
                       traced.lower().as_text())
    return {"permute sites": kinds.count("collective_permute"),
            "other collectives": len(kinds) - kinds.count("collective_permute"),
            "arrays sent": ppermutes_sent(traced.jaxpr.jaxpr)}


def run_cases() -> dict:
    """The subprocess' body: {name: number}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxformer.model.blockwise import blockwise
    from jaxformer.model.cores import AttentionSpec, capped_scores, full, repeat_kv
    from jaxformer.model.parallel.ring import (on_mesh, pair_mask, ring_attention, ring_attention_fwd_stats,
                                               ring_attention_on_mesh)
    from manual_grads.parallel.ring import ring_attention_grads_on_mesh

    devices = np.array(jax.devices())
    rng = np.random.default_rng(0)
    out = {}
    leaves = jax.tree_util.tree_leaves
    jdiff = lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(u - v)) for u, v in zip(leaves(a), leaves(b), strict=True)]))  # noqa: E731
    for case in CASES:
        c, causal, documents, hkv, layout, options = case
        q, do = (jnp.asarray(rng.standard_normal((B, H, T, DH))) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((B, hkv, T, DH))) for _ in range(2))
        segments = jnp.asarray(DOCUMENTS) if documents else None
        mesh = Mesh(devices[:c], ("context",))
        spec = AttentionSpec(causal=causal, softcap=options.get("softcap", 0.0), window=options.get("window", 0),
                             dropout=options.get("dropout", 0.0))
        key = jax.random.PRNGKey(5) if spec.dropout else None  # one device's (T, T) mask; each visit its piece
        options = dict(options, key=key) if key is not None else options
        core = full
        if spec.dropout and options.get("block"):  # the masks are one device's blockwise core's, a block pair each
            spec = AttentionSpec(causal=causal, block=options["block"], dropout=spec.dropout)
            core = lambda q, k, v, spec, key, segments: blockwise(  # noqa: E731
                q, repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1]), spec, key, segments)

        @jax.jit
        def differences(q, k, v, do, segments):
            one, one_vjp = jax.vjp(lambda q, k, v: core(q, k, v, spec, key, segments), q, k, v)
            expected = one_vjp(do)
            scores = capped_scores(q, repeat_kv(k, H // hkv), spec)  # (B, H, T, T), natural order
            mask = pair_mask(jnp.arange(T), jnp.arange(T), spec, segments, segments)
            lse1 = jax.nn.logsumexp(scores if mask is None else jnp.where(mask, scores, -jnp.inf), axis=-1)
            stats = lambda q, k, v, s: ring_attention_fwd_stats(q, k, v, causal=causal, segments=s,  # noqa: E731
                                                                layout=layout, **options)
            o, lse = on_mesh(stats, mesh, (q, k, v), segments, layout=layout, n_out=2)
            ring, ring_vjp = jax.vjp(lambda q, k, v: ring_attention_on_mesh(q, k, v, mesh, causal, segments,
                                                                            layout=layout, **options), q, k, v)
            auto = ring_vjp(do)
            manual = ring_attention_grads_on_mesh(q, k, v, do, mesh, causal, segments, layout=layout, **options)
            return {"output": jnp.maximum(jnp.max(jnp.abs(ring - one)), jnp.max(jnp.abs(o - one))),
                    "lse": jnp.max(jnp.abs(lse - lse1)),
                    "manual = one device": jdiff(manual, expected), "jax.grad ring = one device": jdiff(auto, expected),
                    "manual = jax.grad ring": jdiff(manual, auto)}

        name = case_name(*case)
        out.update({f"{name}: {what}": float(d) for what, d in differences(q, k, v, do, segments).items()})
        ring = lambda q, k, v, s: ring_attention_on_mesh(q, k, v, mesh, causal, s, layout=layout, **options)  # noqa: E731
        manual = lambda q, k, v, s: ring_attention_grads_on_mesh(q, k, v, q, mesh, causal, s,  # noqa: E731
                                                                 layout=layout, **options)
        for what, fn in (("forward", ring), ("manual", manual)):
            out.update({f"{name}: {what} {kind}": n for kind, n in collectives(fn, q, k, v, segments).items()})

    out.update(pallas_differences(devices, rng))
    out.update(bfloat16_errors(devices, rng))
    # the refusal inside shard_map: 12 tokens on context=4, 3 a device (2 x 4 = 8 does not divide 12)
    mesh = Mesh(devices[:4], ("context",))
    x = jnp.zeros((1, 1, 12, DH))
    try:
        jax.shard_map(ring_attention, mesh=mesh, in_specs=P(None, None, "context"),
                      out_specs=P(None, None, "context"))(x, x, x)
        out["refusal"] = ""
    except ValueError as error:
        out["refusal"] = str(error)
    return out


def pallas_differences(devices, rng) -> dict:
    """Each PALLAS_CASES case: the Pallas ring's output, its backward (ring_flash_fwd and _bwd, what
    the manual source runs) and jax.vjp through ring_flash_attention (its custom_vjp) against one
    device's full core and jax.vjp of it, with the kernels' collectives counted as the ring's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jaxformer.model.cores import AttentionSpec, full
    from jaxformer.model.parallel.ring import on_mesh
    from jaxformer.model.parallel.ring_flash import ring_flash_attention, ring_flash_bwd, ring_flash_fwd

    out, leaves = {}, jax.tree_util.tree_leaves
    jdiff = lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(u - v)) for u, v in zip(leaves(a), leaves(b), strict=True)]))  # noqa: E731
    for case in PALLAS_CASES:
        c, causal, documents, hkv, layout, options = case
        q, do = (jnp.asarray(rng.standard_normal((B, H, T, DH))) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((B, hkv, T, DH))) for _ in range(2))
        segments = jnp.asarray(DOCUMENTS) if documents else None
        mesh, spec = Mesh(devices[:c], ("context",)), AttentionSpec(causal=causal, **options)

        def ring(q, k, v, segments):
            local = lambda q, k, v, s: ring_flash_attention(q, k, v, s, spec, "context", layout)  # noqa: E731
            return on_mesh(local, mesh, (q, k, v), segments, layout=layout)

        def manual(q, k, v, do, segments):
            def local(q, k, v, do, s):
                return ring_flash_bwd(ring_flash_fwd(q, k, v, s, spec, "context", layout)[1], do)
            return on_mesh(local, mesh, (q, k, v, do), segments, layout=layout, n_out=3)

        @jax.jit
        def differences(q, k, v, do, segments):  # one program: one device's core, the ring, its two backwards
            one, one_vjp = jax.vjp(lambda q, k, v: full(q, k, v, spec, segments=segments), q, k, v)
            expected = one_vjp(do)
            o, ring_vjp = jax.vjp(lambda q, k, v: ring(q, k, v, segments), q, k, v)
            return {"output": jdiff(o, one), "jax.grad ring = one device": jdiff(ring_vjp(do), expected),
                    "manual = one device": jdiff(manual(q, k, v, do, segments), expected)}

        name = "pallas " + case_name(*case)
        out.update({f"{name}: {what}": float(d) for what, d in differences(q, k, v, do, segments).items()})
        for what, fn in (("forward", ring), ("manual", lambda q, k, v, s: manual(q, k, v, q, s))):
            out.update({f"{name}: {what} {kind}": n for kind, n in collectives(fn, q, k, v, segments).items()})
    return out


def bfloat16_errors(devices, rng) -> dict:
    """float32 q, k, v with compute_dtype bfloat16 on context=4 (causal, documents, 1 key/value
    head): each one's largest error against the float64 full core's output and jax.vjp, for the
    ring's forward, its manual backward, jax.vjp through the ring's forward and one device's full
    core with the same compute dtype; and how far the bfloat16 ring is from the float32 one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jaxformer.model.cores import AttentionSpec, full
    from jaxformer.model.parallel.ring import ring_attention_on_mesh
    from manual_grads.parallel.ring import ring_attention_grads_on_mesh

    mesh, bf16, segments = Mesh(devices[:4], ("context",)), jnp.bfloat16, jnp.asarray(DOCUMENTS)
    q, do = (jnp.asarray(rng.standard_normal((B, H, T, DH))) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, 1, T, DH))) for _ in range(2))
    err = lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float64) - y)) for x, y in zip(a, b)]))  # noqa: E731

    @jax.jit
    def errors(q, k, v, do):  # one program (op by op, its dozens of eager dispatches took 25 s)
        ref, ref_vjp = jax.vjp(lambda q, k, v: full(q, k, v, AttentionSpec(causal=True), segments=segments), q, k, v)
        ref_grads = ref_vjp(do)
        q32, k32, v32, do32 = (a.astype(jnp.float32) for a in (q, k, v, do))
        ring = lambda dtype: (lambda q, k, v: ring_attention_on_mesh(q, k, v, mesh, True, segments,  # noqa: E731
                                                                     compute_dtype=dtype))
        out, ring_vjp = jax.vjp(ring(bf16), q32, k32, v32)
        one, one_vjp = jax.vjp(lambda q, k, v: full(q, k, v, AttentionSpec(causal=True, compute_dtype=bf16),
                                                    segments=segments), q32, k32, v32)
        manual = ring_attention_grads_on_mesh(q32, k32, v32, do32, mesh, True, segments, compute_dtype=bf16)
        return {"bf16 ring output": err([out], [ref]), "bf16 one device output": err([one], [ref]),
                "bf16 ring manual grads": err(manual, ref_grads), "bf16 ring jax.grad": err(ring_vjp(do32), ref_grads),
                "bf16 one device grads": err(one_vjp(do32), ref_grads),
                "bf16 ring - f32 ring": err([out], [ring(None)(q32, k32, v32).astype(jnp.float64)])}
    return {what: float(e) for what, e in errors(q, k, v, do).items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return once_per_run(tmp_path_factory, "ring_attention", lambda: run_cases_on_8_devices("test_ring_attention"))  # one run, not one a worker


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_ring_equals_one_device(results, case):
    """Output, lse, the manual gradients and jax.grad through the ring's forward, to 1e-10."""
    name = case_name(*case)
    for what in DIFFS:
        assert results[f"{name}: {what}"] <= TOL, (what, results[f"{name}: {what}"])


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_collectives_are_the_ring_hops(results, case):
    """Only ppermutes, one site a travelling array (k, v, and the segment ids): the forward
    sends each c - 1 times; the manual program adds the backward's c - 1 hops of k, v (ids)
    with dK, dV beside them and one final hop of dK, dV. No all-gather, no all-reduce: no
    device ever holds the whole sequence's keys."""
    name, (c, _, documents, *_) = case_name(*case), case
    n = 3 if documents else 2  # k, v (and the ids)
    assert results[f"{name}: forward other collectives"] == results[f"{name}: manual other collectives"] == 0
    assert results[f"{name}: forward permute sites"] == n
    assert results[f"{name}: manual permute sites"] == n + (n + 2) + 2
    assert results[f"{name}: forward arrays sent"] == (c - 1) * n
    assert results[f"{name}: manual arrays sent"] == (c - 1) * n + (c - 1) * (n + 2) + 2


@pytest.mark.parametrize("case", PALLAS_CASES, ids=[case_name(*c) for c in PALLAS_CASES])
def test_pallas_ring_equals_one_device(results, case):
    """The Pallas kernels' ring (interpreted, float64): output, its backward and jax.grad through
    its custom_vjp equal one device's full core to 1e-10, and its collectives are the ring's
    hops, as the other cores' (test_collectives_are_the_ring_hops)."""
    c, _, documents, *_ = case
    name, n = "pallas " + case_name(*case), 3 if documents else 2
    for what in PALLAS_DIFFS:
        assert results[f"{name}: {what}"] <= TOL, (what, results[f"{name}: {what}"])
    assert results[f"{name}: forward other collectives"] == results[f"{name}: manual other collectives"] == 0
    assert results[f"{name}: forward arrays sent"] == (c - 1) * n
    assert results[f"{name}: manual arrays sent"] == (c - 1) * n + (c - 1) * (n + 2) + 2


def test_bfloat16_products_err_as_one_device_s(results):
    """With compute_dtype bfloat16 the ring's products run in it (its output is a bfloat16
    rounding away from the float32 ring's) and its errors against the float64 reference are
    those of one device's full core with the same compute dtype: the output, the manual
    gradients and jax.grad through the ring's forward, each within 2x of one device's."""
    assert results["bf16 ring - f32 ring"] > 1e-4  # the compute dtype is read
    assert results["bf16 ring output"] <= 2 * results["bf16 one device output"]
    for what in ("manual grads", "jax.grad"):
        assert results[f"bf16 ring {what}"] <= 2 * results["bf16 one device grads"], (what, results)


def test_refusal_inside_shard_map(results):
    assert results["refusal"] == ("mesh axis context=4 does not fit the sequence length 12: 2 x context = 8 "
                                  "(the zig-zag layout's equal pieces) must divide the sequence length")


# ---------------------------------------------------------------- in this process: the layout


def test_refused_lengths():
    with pytest.raises(ValueError) as err:
        check_context(20, 4)
    assert str(err.value) == ("mesh axis context=4 does not fit the sequence length 20: 2 x context = 8 "
                              "(the zig-zag layout's equal pieces) must divide the sequence length")
    with pytest.raises(ValueError, match="^mesh axis context=3 does not fit the sequence length 10: context must"):
        check_context(10, 3, layout=CONTIGUOUS)
    check_context(16, 4)
    check_context(12, 4, layout=CONTIGUOUS)


def test_on_mesh_refuses_before_running():
    import jax
    import jax.numpy as jnp

    from jaxformer.model.parallel.ring import ring_attention_on_mesh
    mesh = jax.sharding.AbstractMesh((4,), ("context",))
    x = jnp.zeros((1, 1, 12, DH))
    with pytest.raises(ValueError, match=r"^mesh axis context=4 does not fit the sequence length 12: 2 x context = 8"):
        ring_attention_on_mesh(x, x, x, mesh)


@pytest.mark.parametrize("c", [1, 2, 4])
def test_zigzag_round_trip_and_positions(c):
    x = np.arange(2 * T * 3).reshape(2, T, 3)
    z = np.asarray(to_zigzag(x, c))
    assert np.array_equal(np.asarray(from_zigzag(z, c)), x)
    assert np.array_equal(np.asarray(from_layout(to_layout(x, c, 1, CONTIGUOUS), c, 1, CONTIGUOUS)), x)
    n = T // (2 * c)
    for i in range(c):  # device i's slots hold pieces i and 2c - 1 - i, and chunk_positions says so
        held = z[0, i * (T // c):(i + 1) * (T // c), 0] // 3
        assert held.tolist() == list(range(i * n, (i + 1) * n)) + list(range((2 * c - 1 - i) * n, (2 * c - i) * n))
        assert np.array_equal(np.asarray(chunk_positions(i, T, c)), held)
    assert sorted(layout_order(T, c).tolist()) == list(range(T))


def causal_work(c: int, layout: str):
    """Per device: the unmasked causal (query, key) pairs of its queries, and the pairs of the
    blocks its c visits compute (``visited``)."""
    Tc = T // c
    pairs, computed = [], []
    for i in range(c):
        q = np.asarray(chunk_positions(i, T, c, layout))
        pairs.append(int(np.sum(q + 1)))  # query t reads keys 0 .. t
        blocks = [visited(int(pair_kind(i, j)), Tc, True, layout) for j in range(c)]
        computed.append(sum(len(range(Tc)[r]) * len(range(Tc)[col]) for r, col in filter(None, blocks)))
    return pairs, computed


def test_zigzag_balances_causal_work():
    for c in (2, 4):
        pairs, computed = causal_work(c, ZIGZAG)
        assert len(set(pairs)) == 1 and sum(pairs) == T * (T + 1) // 2
        Tc = T // c
        assert computed == [Tc * Tc + (c - 1) * Tc * Tc // 2] * c  # the own block, then half blocks
        pairs, computed = causal_work(c, CONTIGUOUS)
        assert pairs == sorted(pairs) and pairs[0] < pairs[-1]  # device c - 1 has the most
        assert computed == [(i + 1) * Tc * Tc for i in range(c)]


@pytest.mark.parametrize("layout", [ZIGZAG, CONTIGUOUS])
@pytest.mark.parametrize("c", [2, 4])
def test_each_visit_computes_every_unmasked_pair(layout, c):
    """For every device i and chunk j: the causally unmasked (query, key) pairs all lie in the block
    ``visited`` names for the pair's kind (the rest of the T/c x T/c block is masked)."""
    Tc = T // c
    for i in range(c):
        q = np.asarray(chunk_positions(i, T, c, layout))
        for j in range(c):
            kind = int(pair_kind(i, j))
            assert kind == (SELF if i == j else EARLIER if j < i else LATER)
            unmasked = np.asarray(chunk_positions(j, T, c, layout))[None, :] <= q[:, None]  # (Tc, Tc)
            where = visited(kind, Tc, True, layout)
            inside = np.zeros((Tc, Tc), bool)
            if where is not None:
                inside[where[0], where[1]] = True
            assert not np.any(unmasked & ~inside), (i, j)
            assert visited(kind, Tc, False, layout) == (slice(None), slice(None))  # non-causal: whole blocks
