"""A pod planned ahead of time (jaxformer/tools/aot/plan.py, ``jaxformer memory``): the meshes a
model takes and why the others are refused, the collective bytes read from a compiled program's
HLO text (a hand-written one here), and one real plan: the tiny preset's train step compiled for
each mesh of a 4-chip TPU v5e slice (libtpu, in a subprocess as tests/test_aot.py does: the TPU
plugin stays out of this process)."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxformer.cli.main import main
from jaxformer.model.config import get_preset
from jaxformer.model.params import count_params, init_params
from jaxformer.tools.aot import plan as aot_plan
from jaxformer.tools.aot.targets import TARGETS, cuda_plugin, tpu_topology
from jaxformer.training.memory_plan import MemoryPlan

TINY = get_preset("tiny")  # 2 heads, d_ff 24, no experts


def test_candidate_meshes_of_a_tiny_model_and_why_the_others_are_refused():
    blockwise = TINY.replace(attention_impl="blockwise")
    assert aot_plan.candidate_meshes(blockwise, 4) == [
        "data=4,fsdp=1", "data=2,fsdp=2", "data=1,fsdp=4", "data=2,fsdp=1,tensor=2", "data=1,fsdp=2,tensor=2"]
    refused = dict(aot_plan.refused_meshes(blockwise, 4))
    assert refused["data=1,fsdp=1,tensor=4"] == ("mesh axis tensor=4 does not divide n_heads 2: the tensor size "
                                                 "must divide n_heads")
    assert "no experts" in refused["data=2,fsdp=1,expert=2"] and "no experts" in refused["data=1,fsdp=1,expert=4"]
    # every factorization of 4 into (data, fsdp, expert, tensor) is taken or refused, once
    assert len(refused) + 5 == len(aot_plan.factorizations(4, 4)) == 10

    # the Pallas kernels run on each device's heads: the same meshes as the blockwise core's
    pallas = TINY.replace(attention_impl="pallas")
    assert aot_plan.candidate_meshes(pallas, 4) == aot_plan.candidate_meshes(blockwise, 4)
    # cuDNN's attention runs on GPUs alone: no tensor axis with it (the region is proven on CPUs)
    cudnn = TINY.replace(attention_impl="cudnn", compute_dtype="bfloat16")
    assert aot_plan.candidate_meshes(cudnn, 4) == ["data=4,fsdp=1", "data=2,fsdp=2", "data=1,fsdp=4"]
    assert "does not run attention_impl 'cudnn'" in dict(aot_plan.refused_meshes(cudnn, 4))["data=2,fsdp=1,tensor=2"]

    # the batch splits over data x fsdp x expert: a global batch of 2 over 4 devices needs a tensor axis of 2
    assert aot_plan.candidate_meshes(blockwise, 4, batch_size=2) == ["data=2,fsdp=1,tensor=2", "data=1,fsdp=2,tensor=2"]
    assert "global batch 2 does not divide over data x fsdp x expert = 4" in \
        dict(aot_plan.refused_meshes(blockwise, 4, batch_size=2))["data=4,fsdp=1"]

    # experts: an expert axis that divides n_experts (4), and a tensor axis (each expert's hidden
    # features split over it), alone or beside an expert axis
    moe = get_preset("tiny-moe")
    taken = aot_plan.candidate_meshes(moe, 8)
    assert {"data=4,fsdp=1,expert=2", "data=2,fsdp=1,expert=4", "data=1,fsdp=2,expert=4", "data=4,fsdp=1,tensor=2",
            "data=2,fsdp=1,expert=2,tensor=2"} <= set(taken)
    assert not any("expert=8" in m for m in taken)
    refused = dict(aot_plan.refused_meshes(moe, 8))
    assert "n_experts 4 does not divide over the mesh's expert axis (expert=8)" in refused["data=1,fsdp=1,expert=8"]

    # a context axis (the sequence split, ring attention) only when asked for, on the full, the
    # blockwise or the Pallas core, where 2 x context divides the sequence
    full = TINY.replace(attention_impl="full")
    assert aot_plan.candidate_meshes(full, 4, seq_len=16) == aot_plan.candidate_meshes(blockwise, 4)
    with_context = aot_plan.candidate_meshes(full, 4, seq_len=16, context=True)
    assert with_context[:5] == aot_plan.candidate_meshes(blockwise, 4) and set(with_context[5:]) == {
        "data=2,fsdp=1,context=2", "data=1,fsdp=2,context=2", "data=1,fsdp=1,tensor=2,context=2",
        "data=1,fsdp=1,context=4"}
    assert "does not fit the sequence length 12" in dict(aot_plan.refused_meshes(
        full, 4, seq_len=12, context=True))["data=1,fsdp=1,context=4"]
    assert aot_plan.candidate_meshes(blockwise.replace(attention_block=4), 4, seq_len=16, context=True) == with_context
    assert aot_plan.candidate_meshes(pallas, 4, seq_len=16, context=True) == with_context
    assert "does not run attention_impl 'cudnn'" in dict(aot_plan.refused_meshes(
        cudnn, 4, seq_len=16, context=True))["data=2,fsdp=1,context=2"]


def test_the_devices_a_target_has():
    assert [tpu_topology(n) for n in (1, 4, 8, 16, 256)] == ["v5e:2x2", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:16x16"]
    assert aot_plan.device_problem(TARGETS["tpu-v5e"], 3) == (
        "tpu-v5e has no slice of 3 chips: a TPU v5e slice has 1, 4, 8, 16, 32, 64, 128, 256 chips")
    assert aot_plan.device_problem(TARGETS["tpu-v5e"], 16) is None
    assert aot_plan.device_problem(TARGETS["h100"], 3) is None  # H100s come in any number
    with pytest.raises(ValueError, match="not 12"):
        tpu_topology(12)


HLO = """HloModule plan

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

%wrapped_reduce_scatter (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(f32[64]{0} %p), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%sum
}

%body (arg: (s32[], f32[64])) -> (s32[], f32[64]) {
  %arg = (s32[], f32[64]{0}) parameter(0)
  %x = f32[64]{0} get-tuple-element((s32[], f32[64]{0}) %arg), index=1
  %rs-start = ((f32[64]{0}), f32[16]{0}) async-start(f32[64]{0} %x), calls=%wrapped_reduce_scatter
  %rs-done = f32[16]{0} async-done(((f32[64]{0}), f32[16]{0}) %rs-start), calls=%wrapped_reduce_scatter
  %i = s32[] get-tuple-element((s32[], f32[64]{0}) %arg), index=0
  ROOT %t = (s32[], f32[64]{0}) tuple(s32[] %i, f32[64]{0} %x)
}

%cond (arg.1: (s32[], f32[64])) -> pred[] {
  %arg.1 = (s32[], f32[64]{0}) parameter(0)
  ROOT %go = pred[] custom-call((s32[], f32[64]{0}) %arg.1), custom_call_target="go_on"
}

%tpu_body (arg.2: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %arg.2 = (s32[], bf16[4,8]{1,0:T(8,128)(2,1)}) parameter(0)
  %y = bf16[4,8]{1,0:T(8,128)(2,1)} get-tuple-element(%arg.2), index=1
  %a2a = bf16[4,8]{1,0:T(8,128)(2,1)} all-to-all(%y), replica_groups={{0,1,2,3}}, dimensions={0}
  %cps = (s32[2]{0}, s32[2]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%k), source_target_pairs={{0,1},{1,0}}
  %cpd = s32[2]{0} collective-permute-done(%cps)
  %j = s32[]{:T(128)} get-tuple-element(%arg.2), index=0
  ROOT %t.2 = (s32[], bf16[4,8]{1,0:T(8,128)(2,1)}) tuple(%j, %a2a)
}

%tpu_cond (arg.3: (s32[], bf16[4,8])) -> pred[] {
  %three = s32[]{:T(128)} constant(3)
  %arg.3 = (s32[], bf16[4,8]{1,0:T(8,128)(2,1)}) parameter(0)
  %n = s32[]{:T(128)} get-tuple-element(%arg.3), index=0
  ROOT %lt = pred[]{:T(512)} compare(%n, %three), direction=LT
}

%gather_start (p.1: bf16[8]) -> (bf16[8], bf16[32], u32[]) {
  %p.1 = bf16[8]{0} parameter(0)
  %ag.1 = bf16[32]{0} all-gather(%p.1), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %s = (bf16[8]{0}, bf16[32]{0}, u32[]) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (p.2: bf16[8], q.2: bf16[32]) -> (f32[4], bf16[32]) {
  %p.2 = bf16[8]{0} parameter(0)
  %ag.2 = bf16[32]{0} all-gather(%p.2), replica_groups={{0,1,2,3}}, dimensions={0}
  %work = f32[4]{0} constant({1, 2, 3, 4})
  ROOT %c = (f32[4]{0}, bf16[32]{0}) tuple(%work, %ag.2)
}

%gather_done (p.3: bf16[8], q.3: bf16[32]) -> bf16[32] {
  %p.3 = bf16[8]{0} parameter(0)
  %q.3 = bf16[32]{0} parameter(1)
  %ag.3 = bf16[32]{0} all-gather(%p.3), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %d = bf16[32]{0} custom-call(%p.3, %q.3, %ag.3), custom_call_target="AsyncCollectiveDone"
}

%all-reduce-scatter.1 (input: f32[64]) -> f32[16] {
  %input = f32[64]{0} parameter(0)
  %whole = f32[64]{0} all-reduce(%input), replica_groups={{0,1,2,3}}, to_apply=%sum
  %offset = s32[] constant(0)
  ROOT %share = f32[16]{0} dynamic-slice(%whole, %offset), dynamic_slice_sizes={16}
}

%small (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %r.1 = f32[4]{0} all-reduce(f32[4]{0} %q), to_apply=%sum
}

%large (r: f32[32]) -> f32[32] {
  %r = f32[32]{0} parameter(0)
  ROOT %r.2 = f32[32]{0} all-reduce(f32[32]{0} %r), to_apply=%sum
}

ENTRY %main (x: f32[256], h: bf16[8], k: s32[]) -> f32[256] {
  %x.0 = f32[256]{0} parameter(0)
  %h = bf16[8]{0} parameter(1)
  %k = s32[] parameter(2)
  %ar = f32[256]{0} all-reduce(f32[256]{0} %x.0), replica_groups={{0,1,2,3}}, to_apply=%sum
  %ags = (bf16[8]{0}, bf16[32]{0}) all-gather-start(bf16[8]{0} %h), replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = bf16[32]{0} all-gather-done((bf16[8]{0}, bf16[32]{0}) %ags)
  %init = (s32[], f32[64]{0}) tuple(s32[] %k, f32[64]{0} %x.0)
  %w = (s32[], f32[64]{0}) while((s32[], f32[64]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  %init.2 = (s32[], bf16[4,8]{1,0}) tuple(%k, %h)
  %w.2 = (s32[], bf16[4,8]{1,0}) while(%init.2), condition=%tpu_cond, body=%tpu_body
  %acs = (bf16[8]{0}, bf16[32]{0}, u32[]) fusion(%h), kind=kCustom, calls=%gather_start
  %cont = (f32[4]{0}, bf16[32]{0}) fusion(%h, %agd), kind=kCustom, calls=%async_collective_fusion.1
  %acd = bf16[32]{0} fusion(%h, %agd), kind=kCustom, calls=%gather_done
  %ars = f32[16]{0} fusion(%x.0), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %out = f32[4]{0} conditional(s32[] %k, f32[4]{0} %ar, f32[32]{0} %ar), branch_computations={%small, %large}
}
"""


def test_collective_bytes_of_a_hand_written_program():
    """Per run: the entry's all-reduce (f32[256]) and the larger branch's (f32[32]); the
    all-gather-start/done pair once at its done (bf16[32], not the start's tuple), and libtpu's
    asynchronous collective fusion once, at its start's computation (its continuation and done
    repeat the all-gather); the reduce-scatter of the async-start wrapper in a loop of 10 trips
    (known_trip_count), and libtpu's all-reduce-scatter fusion as a reduce-scatter of its share;
    the all-to-all and collective-permute of a loop of 3 (its condition: counter < 3)."""
    assert aot_plan.collective_bytes(HLO) == {
        "all-reduce": 256 * 4 + 32 * 4, "all-gather": 32 * 2 + 32 * 2, "reduce-scatter": 10 * 16 * 4 + 16 * 4,
        "all-to-all": 3 * 4 * 8 * 2, "collective-permute": 3 * 2 * 4}
    with pytest.raises(ValueError, match="trip count"):
        aot_plan.collective_bytes(HLO.replace(', backend_config={"known_trip_count":{"n":"10"}}', ""))
    assert aot_plan.shape_bytes("(f32[2,3]{1,0}, pred[4], bf16[8]{0:T(8)(2,1)})") == 24 + 4 + 16


PLAN = """
import json, sys
from jaxformer.model.config import get_preset
from jaxformer.tools.aot import plan
rows = plan.plan(get_preset("tiny"), 4, "tpu-v5e", attention="pallas", meshes=sys.argv[1:])
rows += plan.plan(get_preset("tiny"), 4, "tpu-v5e", attention="full", meshes=[CONTEXT])
print(json.dumps([dict(mesh=r.mesh, shape=r.shape, memory=r.memory and r.memory._asdict(), fits=r.fits,
                       collectives=r.collectives, seconds=r.seconds, error=r.error) for r in rows]))
"""


PLANNED = ["data=4,fsdp=1", "data=1,fsdp=4"]  # two of its five candidates: the suite stays fast
CONTEXT = "data=2,fsdp=1,context=2"  # and a context mesh (full attention: the ring's core)
PLAN = PLAN.replace("[CONTEXT]", repr([CONTEXT]))


def test_a_plan_of_four_tpu_v5e_chips():
    """The tiny preset's manual step (pallas, bfloat16 products, batch 4 x 16) on a v5e:2x2 slice
    as data=4 and as fsdp=4: each compiles and fits; the data-only mesh moves the least (its one
    all-reduce of the float32 gradients, about the params' bytes) and is proposed; fsdp splits
    the state (fewer argument bytes) and gathers the params. And data=2 x context=2 (full
    attention): it compiles and fits, its ring's hops collective-permutes."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jaxformer[tpu]'): the TPU compile needs it")
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", PLAN, *PLANNED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [aot_plan.Row(r["mesh"], tuple(r["shape"]), MemoryPlan(**r["memory"]), r["fits"], r["collectives"],
                         r["seconds"], r["error"]) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    assert [r.mesh for r in rows] == PLANNED + [CONTEXT]
    ring = rows.pop()
    assert ring.error == "" and ring.fits and ring.collectives["collective-permute"] > 0, ring
    assert set(PLANNED) < set(aot_plan.candidate_meshes(TINY.replace(attention_impl="pallas"), 4))
    for r in rows:
        assert r.error == "" and r.fits and 0 < r.memory.total < TARGETS["tpu-v5e"].hbm_bytes, r
        assert r.memory.argument > 0 and r.memory.temp > 0 and r.collective_total > 0, r
    by_mesh = {r.mesh: r for r in rows}
    data = by_mesh["data=4,fsdp=1"]
    grads = 4 * count_params(jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), TINY)))  # float32
    assert set(k for k, v in data.collectives.items() if v) == {"all-reduce"}
    assert grads <= data.collectives["all-reduce"] <= 1.25 * grads, (data.collectives, grads)
    assert all(data.collective_total < r.collective_total for r in rows if r is not data)
    assert aot_plan.propose(rows)[0] is data
    assert all(r.collectives["all-gather"] > 0 for r in rows if r.shape[1] > 1)  # fsdp gathers the params
    assert by_mesh["data=1,fsdp=4"].memory.argument < data.memory.argument / 2
    with pytest.raises(ValueError, match="mesh data=1,fsdp=1,tensor=4: .*does not divide n_heads 2"):
        aot_plan.plan(TINY, 4, "tpu-v5e", attention="blockwise", meshes=["data=1,fsdp=1,tensor=4"])


def test_propose_takes_what_fits_by_collective_bytes_then_memory():
    plan = lambda total: MemoryPlan(temp=total, argument=0, output=0)  # noqa: E731
    rows = [aot_plan.Row("a", (4, 1, 1, 1), plan(5), True, {"all-reduce": 9}, 1.0),
            aot_plan.Row("b", (2, 2, 1, 1), plan(3), True, {"all-reduce": 9}, 1.0),
            aot_plan.Row("c", (1, 4, 1, 1), plan(2), True, {"all-reduce": 20}, 1.0),
            aot_plan.Row("d", (1, 4, 1, 1), plan(1), False, {"all-reduce": 1}, 1.0),
            aot_plan.Row("e", (1, 4, 1, 1), None, False, None, 1.0, "too big"),
            aot_plan.Row("f", (1, 4, 1, 1), plan(1), True, None, 1.0, "collectives not counted")]
    assert [r.mesh for r in aot_plan.propose(rows)] == ["b", "a", "c", "f"]


def test_the_command(capsys):
    """``jaxformer memory``: its help, and bad input in one error line before any compile."""
    assert main(["memory", "--help"]) == 0
    assert "--devices N" in capsys.readouterr().out

    def error(*argv):
        assert main(["memory", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    tpu = importlib.util.find_spec("libtpu") is not None
    said = error("--preset", "tiny", "--devices", "3")
    assert ("has no slice of 3 chips" if tpu else "libtpu is not installed") in said
    if tpu:
        assert "does not divide n_heads 2" in error("--preset", "tiny", "--devices", "4", "--attention", "blockwise",
                                                    "--mesh", "data=1,fsdp=1,tensor=4")
        said = error("--preset", "tiny", "--devices", "4", "--seq-len", "32")
        assert "longer than the model's max_seq_len 16" in said
    if cuda_plugin() is None:  # the suite's own process: the plugin sits apart (tests/test_aot.py)
        assert "CUDA plugin is not installed" in error("--preset", "tiny", "--devices", "8", "--target", "h100")
    assert "invalid choice" in error("--preset", "nope", "--devices", "4")


def test_the_compilers_refusals_in_one_line():
    """libtpu's out-of-memory refusal keeps its figures (the table shortens it); a Pallas
    kernel's scoped-VMEM overflow (the TPU flash backward at T = 8192, seen planning llama3.2-1b)
    names the kernel and the sizes; any other error its first line, with the next where the first
    only names the error."""
    from jaxformer.cli.plan import refusal_text
    hbm = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (1.16T) exceeds available HBM (15.75G).\nmore")
    assert aot_plan.refusal(hbm) == ("Ran out of memory on HBM, the total memory required for HLO temporaries "
                                     "(1.16T) exceeds available HBM (15.75G).")
    assert refusal_text(aot_plan.refusal(hbm)) == "too big: temporaries alone 1.16T of 15.75G"
    vmem = RuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space "
                        "vmem while allocating on stack for %flash_attention_dkdv.1 = (f32[1,32,8192,64]) "
                        "custom-call(...). Scoped allocation with size 24.25M and limit 16.00M exceeded scoped "
                        "vmem limit by 8.25M.")
    assert aot_plan.refusal(vmem) == "scoped VMEM: flash_attention_dkdv.1 needs 24.25M, the limit is 16.00M"
    assert aot_plan.refusal(ValueError("E7: Oops:\nthe reason\nmore")) == "ValueError: E7: Oops: the reason"
