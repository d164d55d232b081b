"""How long a checkpoint holds the training loop, beside the step time (a benchmark,
not a test).

For each preset: compile the step, time a few steps, then time how long the loop is
held by one checkpoint (the call returns; the files are still being written):

    after   checkpoints.Saver.save: finiteness on device + orbax's async start
    before  the synchronous save this replaced: the whole state gathered to the host,
            every array hashed, orbax writing synchronously, every file hashed

    python experiments/checkpoint_stall.py --preset loopos
    python experiments/checkpoint_stall.py --preset gpt2 --batch-size 1 --compute-dtype bfloat16 \\
        --attention-impl blockwise --loss-chunk 256 --remat block

The machine may be shared: the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxformer.checkpoints import checkpoint
from jaxformer.checkpoints.digests import array_digests, write_file_digests
from jaxformer.checkpoints.store import manager
from jaxformer.training.settings import settings_for
from jaxformer.training.sharding import make_mesh
from jaxformer.training.step import StepSpec, compiled_step, init_fn


def synchronous_save(run_dir, state, meta) -> None:
    """The save as it was: gather to host, hash arrays, write synchronously, hash files."""
    host = checkpoint.to_host(state)
    meta = dict(meta, step=int(host.step), digests=array_digests(host))
    mgr = manager(run_dir, create=True)
    mgr.save(int(host.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()
    mgr.close()
    write_file_digests(checkpoint.checkpoint_dir(run_dir) / str(int(host.step)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="loopos")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--compute-dtype")
    p.add_argument("--attention-impl")
    p.add_argument("--loss-chunk", type=int)
    p.add_argument("--remat")
    a = p.parse_args()
    model = {k: v for k, v in dict(compute_dtype=a.compute_dtype, attention_impl=a.attention_impl,
                                   loss_chunk=a.loss_chunk, remat=a.remat).items() if v is not None}
    settings = settings_for(a.preset, model=model, **({"batch_size": a.batch_size} if a.batch_size else {}))
    config = settings.model_config(256)
    mesh = make_mesh(None, settings.mesh)
    spec = StepSpec.of_run(settings, config, mesh)
    state = init_fn(spec)(0)
    step = compiled_step(spec)
    rng = np.random.default_rng(0)
    B, T = settings.batch_size, settings.seq_len
    batch = {"inputs": rng.integers(0, 256, (B, T), dtype=np.int32),
             "targets": rng.integers(0, 256, (B, T), dtype=np.int32)}
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / a.steps
    meta = {"config": config.to_dict(), "settings": settings.to_dict()}
    with tempfile.TemporaryDirectory() as d:
        saver = checkpoint.Saver(os.path.join(d, "after"))
        saver.save(state, meta)  # the first save compiles the finiteness check, opens orbax
        saver.wait()
        state = state._replace(step=state.step + 1)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        saver.save(state, meta)
        after = time.perf_counter() - t0
        saver.close()
        t0 = time.perf_counter()
        synchronous_save(os.path.join(d, "before"), state, meta)
        before = time.perf_counter() - t0
    load = os.getloadavg()
    print(f"{a.preset} {model or ''} batch {B}x{T}: step {step_s:.3f} s; loop held by a checkpoint: "
          f"before {before:.3f} s ({before / step_s:.1%} of a step), after {after:.3f} s "
          f"({after / step_s:.1%} of a step); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
