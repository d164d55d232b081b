"""The tools room: what a developer runs to check and measure the model, as computation
and reports (no argument parsing: the command lines are in ``jaxformer.cli``).

    compare, compare_fd     manual vs automatic gradients, leaf by leaf; finite differences
    compare_report, compare_plot, leaves
                            the comparison's terminal table, JSON / Markdown and PNG reports,
                            and the names and order of the leaves they show
    bench, bench_contestants, bench_report
                            step time, MFU and memory against jax.grad and PyTorch; the report
    memory                  what each backward keeps
    torch_ref, torch_ref_layers
                            an independent PyTorch model, GPT-2's block and the modern one
                            (imports torch: only the benchmark's PyTorch contestants and tests
                            load it)
    doctor, doctor_checks, doctor_report
                            `jaxformer doctor`: the kernels, gradients, training and speed on
                            the device JAX sees, one report

May import: ``jaxformer.training``, ``jaxformer.inference`` and every room below them,
and ``manual_grads``; never ``jaxformer.cli``.
"""
