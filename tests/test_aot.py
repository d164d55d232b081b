"""Every train-step variant (attention full / blockwise / pallas / cudnn x manual / auto
gradients x float32 / bfloat16 products x one device / a 2 x 2 data x fsdp mesh) lowers
for cuda and for tpu from this CPU machine, and a pairwise covering set of them compiles
for a TPU v5e topology when jax[tpu] is installed (in subprocesses, so the TPU plugin stays
out of this one), and for an H100 when JAX's CUDA plugin is (jaxformer/tools/aot/steps.py).
A block size Triton cannot take fails the cuda lowering by name. The model is GPT-2's block at a small size:
2 layers (1 in the H100 mesh compile), width 128, two heads of 64, T = 128, batch 4."""

import importlib.util
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxformer.model.attention import cudnn_core
from jaxformer.model.config import get_preset
from jaxformer.tools.aot import steps as aot
from jaxformer.tools.aot.plugin import cudnn_apart_problem, plugin_dir
from jaxformer.tools.aot.report import describe, table
from jaxformer.tools.aot.targets import CUDA_PLUGINS, cuda_plugin, cudnn_problem
from jaxformer.training.optim import make_optimizer
from jaxformer.training.settings import settings_for

CONFIG = get_preset("gpt2", n_layers=2, d_model=128, n_heads=2, d_ff=512, max_seq_len=128, vocab_size=256)
B = 4  # divides over the 2 x 2 mesh
OPTIMIZER = make_optimizer(**settings_for("gpt2").optimizer_kwargs())  # AdamW, clipping, cosine


def lowering_cases() -> list:
    cases = []
    for platform in aot.PLATFORMS:
        for variant in aot.variants():
            if aot.absent(variant, platform):
                continue  # test_variants_a_platform_does_not_have_are_skipped_with_the_reason
            if variant.attention == "cudnn":
                continue  # compiled for an H100 in a subprocess with the plugin (test_cudnn_compiles_for_an_h100)
            cases.append(pytest.param(platform, variant, id=f"{platform}-{variant.name}"))
    return cases


@pytest.mark.parametrize("platform,variant", lowering_cases())
def test_every_variant_lowers(platform, variant):
    """Exported for the platform; the Pallas kernels are its custom calls (Triton on cuda, Mosaic
    on tpu: the forward and three backward kernels at least), and on cuda the manual Pallas
    step's norms are Triton kernels too (manual_grads/norms.py: each layer's two and ln_f,
    forward and backward); with full or blockwise attention the program holds no custom call.
    cuDNN's variants are compiled in test_cudnn_compiles_for_an_h100's subprocess, where the
    CUDA plugin and cuDNN are."""
    if aot.skip_reason(variant, platform):
        pytest.skip(aot.skip_reason(variant, platform))
    outcome = aot.lower_for(CONFIG, variant, platform, OPTIMIZER, B)
    assert outcome.stage == "lowered", describe(outcome)
    if variant.attention == "pallas":
        norms = 2 * (2 * CONFIG.n_layers + 1) if (platform, variant.grads) == ("cuda", "manual") else 0
        assert outcome.kernels >= 4 + norms, describe(outcome)
    else:
        assert outcome.kernels == 0, describe(outcome)


def test_variants_a_platform_does_not_have_are_skipped_with_the_reason():
    cudnn = {(v.grads, v.dtype): v for v in aot.variants(attentions=("cudnn",), meshes=(None,))}
    assert "only on a GPU" in aot.lower_for(CONFIG, cudnn["auto", "bfloat16"], "tpu", OPTIMIZER, B).reason
    assert "float32 products" in aot.skip_reason(cudnn["auto", "float32"], "cuda")
    with pytest.raises(ValueError, match="attention_impl 'cudnn' cannot run with compute_dtype 'float32'"):
        aot.variant_config(CONFIG, cudnn["auto", "float32"])  # the config refuses it too
    assert aot.absent(cudnn["manual", "bfloat16"], "cuda") is None  # cuDNN's kernels in the hand-derived step
    assert all(aot.absent(v, p) is None for v in aot.variants(attentions=("full", "blockwise", "pallas"))
               for p in aot.PLATFORMS)


def test_a_block_size_triton_cannot_take_fails_the_cuda_lowering_by_name():
    """pallas_block_q 24 (a multiple of 8, not a power of two): the tpu program lowers,
    the cuda one fails naming the field and the value."""
    config = CONFIG.replace(pallas_block_q=24)
    variant = aot.Variant("pallas", "manual", "bfloat16")
    assert aot.lower_for(config, variant, "tpu", OPTIMIZER, B).stage == "lowered"
    with pytest.raises(ValueError, match="ModelConfig.pallas_block_q must be a power of two >= 16 on a GPU "
                                         "\\(Triton's tiles\\), got 24"):
        aot.lower_for(config, variant, "cuda", OPTIMIZER, B)


def test_cudnn_follows_the_platform_lowered_for():
    """The cuda program holds cuDNN's calls (with JAX's CUDA plugin and the cuDNN library)
    or fails its lowering naming what is missing; lowered for cpu or tpu it fails naming
    the platform."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: cudnn_core(q, k, v, True))

    def export(platform):
        return jax.export.export(f, platforms=[platform], disabled_checks=aot.EXPORT_CHECKS)(q, q, q)

    for platform in ("cpu", "tpu"):
        with pytest.raises(ValueError, match=f"runs only on a GPU .*lowered for '{platform}'"):
            export(platform)
    if cuda_plugin() is None:
        with pytest.raises(ValueError, match="cannot be lowered for cuda here: .*CUDA plugin"):
            export("cuda")
    elif cudnn_problem():
        with pytest.raises(ValueError, match="cannot be lowered for cuda here: cuDNN not found"):
            export("cuda")
    else:
        assert aot.kernel_count(export("cuda").mlir_module()) == 1


def test_largest_batch_bisects_over_compiles(monkeypatch):
    """A stand-in compiler whose program takes 1 GiB per row: 15 rows fit the 15.75 GiB
    libtpu gives a program on a v5e chip."""
    tried = []

    def compile_for(config, variant, target, optimizer, batch_size, seq_len=None):
        tried.append(batch_size)
        memory = aot.Memory(temp=batch_size * 2**30 - 1024, argument=1024, output=0, alias=0, code=0)
        return aot.Outcome(variant, target, "compiled", 0.0, 0, memory, batch_size=batch_size)

    monkeypatch.setattr(aot, "compile_for", compile_for)
    variant = aot.Variant("full", "manual", "bfloat16")
    assert aot.TARGETS["tpu-v5e"].hbm_bytes == 15.75 * 2**30
    batch, outcome, outcomes = aot.largest_batch(CONFIG, variant, "tpu-v5e", OPTIMIZER, start=5)
    assert batch == 15 and outcome.memory.total == 15 * 2**30
    assert tried == [5, 10, 20, 15, 17, 16] and [o.batch_size for o in outcomes] == sorted(tried)
    assert aot.largest_batch(CONFIG, variant, "tpu-v5e", OPTIMIZER, start=64, multiple=4)[0] == 12
    assert aot.largest_batch(CONFIG, variant, "tpu-v5e", OPTIMIZER, start=8, limit=8)[0] == 8
    assert "| manual_full_bf16 | tpu-v5e | 15 | compiled |" in table([outcome])


# ---------------------------------------------------------------------------- compiled by XLA

COMPILE = """
import json, sys
from jaxformer.model.config import ModelConfig
from jaxformer.tools.aot import steps as aot
from jaxformer.training.optim import make_optimizer
from jaxformer.training.settings import settings_for
optimizer = make_optimizer(**settings_for("gpt2").optimizer_kwargs())
results = []
for config, todo, batch in json.loads(sys.argv[2]):
    todo = [aot.Variant(*v[:3], tuple(v[3]) if v[3] else None) for v in todo]
    out = aot.run(ModelConfig.from_dict(config), todo, [sys.argv[1]], optimizer, batch_size=batch)
    results.append({o.variant.name: dict(stage=o.stage, kernels=o.kernels, reason=o.reason, launches=o.launches,
                                         traffic=o.traffic,
                                         memory=o.memory and o.memory._asdict()) for o in out})
print(json.dumps(results))
"""


# JAX's CUDA plugin may sit apart from this environment, in a folder of its own
# (``python -m jaxformer.tools.aot.plugin``: .venv/cuda-plugin, or the folder
# JAXFORMER_AOT_CUDA_PLUGIN names): on a machine without a GPU the plugin prints its driver
# warnings at every start of jax, which would reach the stderr of every command the other
# tests run. Then only the H100 compiles' subprocess has it.
CUDA_PLUGIN_DIR = plugin_dir()


def h100_compiler() -> bool:
    """Whether the H100 compiles can run: the CUDA plugin installed, or in CUDA_PLUGIN_DIR."""
    apart = CUDA_PLUGIN_DIR and any((pathlib.Path(CUDA_PLUGIN_DIR) / name).is_dir() for name in CUDA_PLUGINS)
    return cuda_plugin() is not None or bool(apart)


def compiled(target: str, todo, config=CONFIG, batch: int = B) -> dict:
    """{variant name: outcome} of aot.run compiling ``todo`` for ``target`` in a subprocess."""
    return compiled_jobs(target, [(config, todo, batch)])[0]


def compiled_jobs(target: str, jobs) -> list:
    """compiled's result for each (config, todo, batch) of ``jobs``, all in one subprocess
    (JAX_PLATFORMS=cpu: the TPU plugin only compiles; no cloud metadata queries; the CUDA
    plugin's folder on its path where it sits apart)."""
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    if CUDA_PLUGIN_DIR and target == "h100":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [CUDA_PLUGIN_DIR, env.get("PYTHONPATH")]))
        # a process with the plugin keeps its CPU executables out of the suite's shared cache
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    jobs = [(config.to_dict(), [list(v) for v in todo], batch) for config, todo, batch in jobs]
    done = subprocess.run([sys.executable, "-c", COMPILE, target, json.dumps(jobs)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# (gradients, products, mesh): every pair of two of the three takes all four value pairs in
# these four rows (every variant still lowers for tpu in test_every_variant_lowers)
PAIRWISE = [("manual", "float32", None), ("manual", "bfloat16", aot.MESH),
            ("auto", "float32", aot.MESH), ("auto", "bfloat16", None)]


def complement(row):
    """The row with each of its three values swapped for the other one."""
    grads, dtype, mesh = row
    return (aot.GRADS[1 - aot.GRADS.index(grads)], aot.DTYPES[1 - aot.DTYPES.index(dtype)],
            None if mesh else aot.MESH)


TPU_ATTENTIONS = [a for a in aot.ATTENTIONS if any(aot.absent(v, "tpu") is None for v in aot.variants(attentions=(a,)))]
# each attention compiles for a TPU one row of PAIRWISE and its complement (so a mesh and a
# one-chip variant, each gradient source, each dtype): over the three attentions, a pairwise
# covering set of (attention, gradients, products, mesh) in six compiles
TPU_ROWS = {attention: [PAIRWISE[i], complement(PAIRWISE[i])] for i, attention in enumerate(TPU_ATTENTIONS)}


def test_tpu_rows_cover_every_pair():
    options = (tuple(TPU_ROWS), aot.GRADS, aot.DTYPES, (None, aot.MESH))  # aot.variants' own
    rows = [(attention, *row) for attention, pair in TPU_ROWS.items() for row in pair]
    assert len(rows) == 6 and len(TPU_ROWS) == 3
    for i, j in itertools.combinations(range(4), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(options[i], options[j])), (i, j)


@pytest.mark.parametrize("attention", TPU_ATTENTIONS)
def test_every_variant_compiles_for_a_tpu_v5e(attention):
    """libtpu compiles each attention's two variants (TPU_ROWS: over the attentions, every pair
    of attention, gradients, products and mesh values) for a v5e chip (the mesh one for four),
    Mosaic kernels included, and XLA's memory plan is sane: the arguments are the state and the batch
    (fsdp=2 halves them on each chip), the donated state is written in place (aliased),
    and the scratch is never negative. At this size the temporaries may all fit in the
    chip's VMEM (temp 0 bytes of HBM: jax.grad's, and since 2026-11-27 the manual blockwise
    float32 step's), so manual vs jax.grad is compared at GPT-2's size in docs/benchmark.md,
    not here."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jaxformer[tpu]'): the TPU compile check needs it")
    todo = [aot.Variant(attention, *row) for row in TPU_ROWS[attention]]
    assert all(aot.absent(v, "tpu") is None for v in todo)
    out = compiled("tpu-v5e", todo)  # one subprocess per attention: the suite's workers share them
    state = aot.abstract_state(CONFIG, OPTIMIZER)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    one = {}
    for v in todo:
        o = out[v.name]
        assert o["stage"] == "compiled", (v.name, o)
        assert (o["kernels"] >= 4) == (v.attention == "pallas"), (v.name, o)
        memory = o["memory"]
        share = 2 if v.mesh else 1  # the state split over fsdp = 2 (leaves it does not divide stay whole)
        batch_bytes = 2 * B * CONFIG.max_seq_len * 4  # inputs and targets, int32
        assert state_bytes / share <= memory["argument"] <= 1.05 * state_bytes / share + batch_bytes
        assert 0.99 * state_bytes / share <= memory["alias"] <= memory["argument"], (v.name, memory)
        assert memory["temp"] >= 0 and memory["code"] > 0, (v.name, memory)
        one.setdefault(v.mesh, []).append(memory["argument"])
    assert max(one[aot.MESH]) < min(one[None]), one


def skip_without_h100_compiler():
    if not h100_compiler():
        pytest.skip("JAX's CUDA plugin is not installed (python -m jaxformer.tools.aot.plugin, or "
                    "pip install 'jaxformer[cuda]'): the GPU compile check needs it; the cuda lowering "
                    "above still runs")


def test_a_mesh_compiles_for_an_h100():
    """With JAX's CUDA plugin, XLA compiles for an H100 it does not have (a GPU target
    config, no GPU opened): a data x fsdp mesh of four H100s, of CONFIG's model with one
    layer (a GPU step unrolls the layers and compiles each one's kernels: 18 s for two, 9 s
    for one; every leaf splits over fsdp along the same axis as with two; many layers: the
    manual step with the Triton kernels at GPT-2's and SmolLM's sizes,
    test_the_gpu_steps_launches_and_memory)."""
    skip_without_h100_compiler()
    out = compiled("h100", [aot.Variant("full", "manual", "float32", aot.MESH)], CONFIG.replace(n_layers=1))
    assert all(o["stage"] == "compiled" and o["memory"]["temp"] > 0 and o["launches"] > 0
               for o in out.values()), out


# The manual + Pallas bf16 step compiled for an H100 at GPT-2 small's and SmolLM's shapes, each
# with two of its layers (make_optimizer's AdamW with clipping and a cosine schedule; jax 0.10.2):
# kernels launched per step (launches.py: the layer loops counted per trip), XLA's temporaries
# and the MiB those kernels read and write (launches.traffic). A GPU step unrolls its layers, each
# compiled as the others are, so two hold every layer's kernels and the seam between layers, and
# a change that adds a kernel, a kept residual or a pass over memory to a layer adds it twice
# here; the whole depths (12 and 30 layers: 604 / 1,366 launches, 5,238 / 8,791 MiB of
# temporaries, 49.3 / 90.4 GiB moved) compile three times as long and are printed by
# experiments/gpu_launches.py (docs/benchmark.md, "Kernels per step"). A change that adds
# kernels, memory or traffic fails here; one that removes them lowers the figures.
GPU_STEPS = {"gpt2": (16, 1024, 230, 999, 8_853), "smollm": (8, 2048, 198, 725, 6_001)}
GPU_STEP_LAYERS = 2


def test_the_gpu_steps_launches_and_memory():
    """GPT-2 small (B16 T1024) and SmolLM-135M (B8 T2048), two layers each: the manual step with
    the four Triton kernels a layer compiles for an H100, and launches no more kernels and plans
    no more temporaries and moves no more bytes than GPU_STEPS says."""
    skip_without_h100_compiler()
    configs = {preset: get_preset(preset, n_layers=GPU_STEP_LAYERS) for preset in GPU_STEPS}
    outs = compiled_jobs("h100", [(configs[preset], [aot.Variant("pallas", "manual", "bfloat16")], batch)
                                  for preset, (batch, *_) in GPU_STEPS.items()])  # one subprocess
    for (preset, (batch, seq_len, most_launches, most_mib, most_traffic)), out in zip(GPU_STEPS.items(), outs,
                                                                                      strict=True):
        config = configs[preset]
        assert config.max_seq_len == seq_len
        o = out["manual_pallas_bf16"]
        assert o["stage"] == "compiled" and o["kernels"] >= 4 * config.n_layers, (preset, o)
        temp_mib = o["memory"]["temp"] / 2**20
        assert 0.5 * most_launches < o["launches"] <= most_launches, (preset, o["launches"])
        assert 0.5 * most_mib < round(temp_mib) <= most_mib, (preset, temp_mib)
        traffic_mib = o["traffic"] / 2**20
        assert 0.5 * most_traffic < round(traffic_mib) <= most_traffic, (preset, traffic_mib)


def test_cudnn_compiles_for_an_h100():
    """cuDNN's fused attention compiled for the H100, in JAX's grad's step and in the hand-derived
    one (kernels/cudnn.py's pair): each holds cuDNN's forward and backward kernels. It needs the
    cuDNN library as well as the plugin (JAX reads cuDNN's version while tracing; the plugin's
    own folder holds both: python -m jaxformer.tools.aot.plugin)."""
    if cudnn_problem() and cudnn_apart_problem():
        pytest.skip(f"cuDNN's attention cannot be traced here: {cudnn_problem()}")
    out = compiled("h100", [aot.Variant("cudnn", grads, "bfloat16", mesh) for grads in ("auto", "manual")
                            for mesh in (None, aot.MESH)], CONFIG.replace(n_layers=1))
    # one layer: cuDNN's forward and backward kernels in the lowered program (the count reads it);
    # on the 2 x 2 mesh, lowered by jit, it holds the call of their partitioning rule instead. The
    # hand-derived step adds its norms' Triton kernels (manual_grads/norms.py): the layer's two
    # and ln_f, forward and backward, per shard on the mesh
    norms = 2 * (2 + 1)
    assert {name: (o["stage"], o["kernels"]) for name, o in out.items()} == {
        "auto_cudnn_bf16": ("compiled", 2), "manual_cudnn_bf16": ("compiled", 2 + norms),
        "auto_cudnn_bf16_mesh2x2": ("compiled", 0), "manual_cudnn_bf16_mesh2x2": ("compiled", norms)}


HLO = """HloModule step

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add = f32[4]{0} add(f32[4]{0} %p0, f32[4]{0} %p0)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %arg), index=1
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_add
  %g = f32[4]{0} custom-call(f32[4]{0} %f), custom_call_target="__cublas$gemm"
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %arg), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %g)
}

%cond (arg.1: (s32[], f32[4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion((s32[], f32[4]{0}) %arg.1), kind=kLoop, calls=%fused_add
}

%small (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(f32[4]{0} %a)
}

%large (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %c1 = f32[4]{0} copy(f32[4]{0} %b)
  ROOT %c2 = f32[4]{0} fusion(f32[4]{0} %c1), kind=kLoop, calls=%fused_add
}

ENTRY %main (x: f32[4], k: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(s32[] %zero, f32[4]{0} %x)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %y = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
  %z = f32[4]{0} bitcast(f32[4]{0} %y)
  ROOT %r = f32[4]{0} conditional(s32[] %k, f32[4]{0} %z, f32[4]{0} %z), branch_computations={%small, %large}
}
"""


def test_launches_count_loops_per_trip_and_the_largest_branch():
    """launches.py on a hand-written program: the loop body's fusion and GEMM 12 times, its
    condition 13 times, the conditional's larger branch (a copy and a fusion); parameters,
    constants, tuples, get-tuple-element and bitcasts launch nothing; a fusion's own
    computation is not walked."""
    from jaxformer.tools.aot.launches import kinds, launches, traffic
    assert kinds(HLO) == {"fusion": 12 + 13 + 1, "custom-call": 12, "copy": 1}
    assert launches(HLO) == 39
    # bytes: the body's fusion and GEMM read and write f32[4] (32 bytes) 12 times, the condition
    # reads a (s32[], f32[4]) tuple and writes a pred 13 times, the larger branch copies and adds
    assert traffic(HLO) == 12 * (32 + 32) + 13 * (4 + 16 + 1) + (32 + 32)
    # a compiled program's text names its operands without their shapes: each is looked up
    bare = HLO.replace("fusion(f32[4]{0} %x)", "fusion(%x)").replace("custom-call(f32[4]{0} %f)", "custom-call(%f)")
    assert bare != HLO and traffic(bare) == traffic(HLO)
    with pytest.raises(ValueError, match="known trip count"):
        launches(HLO.replace(', backend_config={"known_trip_count":{"n":"12"}}', ""))
    with pytest.raises(ValueError, match="no ENTRY"):
        launches(HLO.replace("ENTRY ", ""))
