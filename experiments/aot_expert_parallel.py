"""The olmoe-1b-7b train step with its experts split over an "expert" mesh axis, compiled
for a TPU v5e topology this machine does not have: XLA's per-chip memory plan, nothing run.

The step is the project's (training/step.py ``make_train_step`` with the mesh and the
state's layout from training/sharding.py: the batch over every axis, the 64 experts of each
layer over "expert", the rest over "fsdp"), the preset's fine-tuning AdamW, float32 params,
bfloat16 products, full attention, batch B x 2048; manual and jax.grad gradients. The MoE
layer exchanges tokens with all_to_all under shard_map (jaxformer/model/moe_parallel.py).

    python experiments/aot_expert_parallel.py --layers 16,8,4 --mesh expert=4
    python experiments/aot_expert_parallel.py --layers 16 --mesh fsdp=2,expert=4 --topology v5e:2x4

Prints one line per compile and a markdown table (docs/moe.md quotes it).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU plugin only compiles here
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from jaxformer.model.config import get_preset  # noqa: E402
from jaxformer.model.params import init_params  # noqa: E402
from jaxformer.tools.aot.steps import oom_line  # noqa: E402
from jaxformer.training.memory_plan import MemoryPlan  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.settings import settings_for  # noqa: E402
from jaxformer.training.sharding import make_mesh, mesh_shardings, state_shardings  # noqa: E402
from jaxformer.training.step import grad_source, init_state, make_train_step  # noqa: E402

GiB = 2**30
GRAD_NAMES = {"manual": "manual", "auto": "jax.grad"}


def placed(tree, shardings):
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def compile_one(config, grads, mesh, batch_size, seq_len):
    """(seconds, MemoryPlan or None, the refusal's line or ""): the step compiled on ``mesh``."""
    optimizer = make_optimizer(**settings_for("olmoe-1b-7b").optimizer_kwargs())
    start = time.perf_counter()
    try:
        with jax.enable_x64(False):
            params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32))
            state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
            layout = state_shardings(state, mesh)
            _, split = mesh_shardings(mesh)
            batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=split)
                     for k in ("inputs", "targets")}
            step = make_train_step(grad_source(grads, config), optimizer, mesh=mesh, state_sharding=layout)
            compiled = step.lower(placed(state, layout), batch).compile()
    except Exception as error:  # noqa: BLE001 - every row is reported, a refusal with its one line
        said = str(error)
        if "RESOURCE_EXHAUSTED" in said or "Ran out of memory" in said:
            return time.perf_counter() - start, None, oom_line(said)
        return time.perf_counter() - start, None, f"{type(error).__name__}: {said.strip().splitlines()[0][:200]}"
    return time.perf_counter() - start, MemoryPlan.of(compiled), ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="aot_expert_parallel.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="16,8,4", help="the olmoe-1b-7b stack's depths to compile")
    parser.add_argument("--mesh", default="expert=4", help="the mesh over the topology's chips")
    parser.add_argument("--topology", default="v5e:2x2", help="libtpu's topology name")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = make_mesh(devices, args.mesh)
    print(f"{args.topology} ({len(devices)} chips), mesh {dict(mesh.shape)}, batch {args.batch_size} x "
          f"{args.seq_len}", flush=True)
    rows = ["| layers, B x T | mesh | gradients | arguments | temp | total |", "|---|---|---|---:|---:|---:|"]
    for layers in (int(n) for n in args.layers.split(",")):
        config = get_preset("olmoe-1b-7b").replace(n_layers=layers, compute_dtype="bfloat16")
        for grads in ("manual", "auto"):
            seconds, plan, refusal = compile_one(config, grads, mesh, args.batch_size, args.seq_len)
            head = f"| {layers}, {args.batch_size} x {args.seq_len} | {args.mesh} | {GRAD_NAMES[grads]} |"
            if plan is None:
                rows.append(f"{head} {refusal} | | |")
            else:
                rows.append(f"{head} {plan.argument / GiB:.2f} | {plan.temp / GiB:.2f} | {plan.total / GiB:.2f} |")
            print(f"{rows[-1]}  ({seconds:.0f} s)", flush=True)
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
