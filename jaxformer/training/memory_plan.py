"""XLA's memory plan of a compiled program: ``MemoryPlan.of(compiled)`` reads
``compiled.memory_analysis()`` (of ``jax.jit(f).lower(...).compile()``), bytes per
device, without running it. The memory check before the first step, ``jaxformer
memory``, the ahead-of-time compiles and the benchmark all read it through here."""

from __future__ import annotations

from typing import NamedTuple


class MemoryPlan(NamedTuple):
    temp: int  # scratch buffers alive at once: activations, gradients, optimizer scratch
    argument: int  # the inputs: e.g. train state and batch
    output: int  # the outputs: e.g. new state and metrics
    alias: int = 0  # outputs written over donated inputs (counted in both above)
    code: int = 0  # generated code

    @property
    def total(self) -> int:
        """What the program holds at its peak: inputs, outputs not aliased, temporaries, code."""
        return self.argument + self.output - self.alias + self.temp + self.code

    def half_batch(self) -> int:
        """The estimated total with half the batch: half the temporaries."""
        return self.total - self.temp // 2

    def as_dict(self) -> dict[str, int]:
        """The plan under XLA's names: temp_bytes, argument_bytes, output_bytes,
        alias_bytes, generated_code_bytes (a report's JSON)."""
        return {"temp_bytes": self.temp, "argument_bytes": self.argument, "output_bytes": self.output,
                "alias_bytes": self.alias, "generated_code_bytes": self.code}

    @classmethod
    def of(cls, compiled) -> MemoryPlan | None:
        """The plan of a compiled function; None where the backend has no memory analysis."""
        try:
            m = compiled.memory_analysis()
        except NotImplementedError:
            return None
        if m is None:
            return None
        read = lambda name: int(getattr(m, f"{name}_size_in_bytes", 0) or 0)  # noqa: E731
        return cls(read("temp"), read("argument"), read("output"), read("alias"), read("generated_code"))
