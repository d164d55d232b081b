"""The tools room: what a developer runs to check and measure the model, as computation
and reports (no argument parsing: the command lines are in ``jaxformer.cli``).

    compare/        manual vs automatic gradients, leaf by leaf; finite differences; the
                    comparison's table, JSON / Markdown and PNG reports
    bench/          step time, MFU and memory against jax.grad and PyTorch; sweeps; reports
    aot/            every train step compiled ahead of time for a TPU topology or an H100
    doctor/         `jaxformer doctor`: the kernels, gradients, training and speed on the
                    device JAX sees, one report
    torch_ref/      an independent PyTorch model, GPT-2's block and the modern one (imports
                    torch: only the benchmark's PyTorch contestants and tests load it)
    memory          what each backward keeps

May import: ``jaxformer.training``, ``jaxformer.inference`` and every room below them,
and ``manual_grads``; never ``jaxformer.cli``.
"""
