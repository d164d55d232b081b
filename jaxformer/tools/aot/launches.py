"""Kernel launches per step, read from a compiled program's HLO text (``compiled.as_text()``).

A proxy for a GPU step's speed that needs no GPU: XLA's GPU compiler turns a program into
kernels (fusions, library calls such as cuBLAS's GEMMs and the Triton kernels, copies,
collectives); every kernel is one more launch and, for the elementwise ones, one more pass
over HBM. ``launches(text)`` counts them as the device runs them: the instructions of the
entry computation and of the computations it calls, a while loop's body once per trip (its
``known_trip_count``), a conditional's largest branch. Bookkeeping instructions that run no
kernel (parameters, constants, tuples, get-tuple-element, bitcasts) are not counted.
``traffic(text)`` adds up the bytes each launch reads and writes (its operands' and its
result's shapes; a compiled program's text names its operands without their shapes, so each
is looked up where its computation defines it): a second proxy, for the memory-bound kernels.
It counts whole operands, so a fusion that reads a slice of a buffer or updates one in place (a
scan's stacked residuals) counts the whole buffer: compare programs of one structure with it.

    python -m jaxformer.tools.aot.launches FILE.hlo     prints the count, its kinds and bytes
"""

from __future__ import annotations

import collections
import math
import re
import sys

FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
                  "partition-id", "replica-id", "opt-barrier", "add-dependency"})

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OPCODE = re.compile(r"[\]})]\s([a-z][a-z0-9\-]*)\(")  # "f32[2,3]{1,0} fusion(" -> fusion
_SHAPE = re.compile(r"\b(pred|[a-z]+?)(\d*)\[([\d,]*)\]")  # "bf16[16,1024]" -> bf, 16, "16,1024"
_ATTRIBUTES = re.compile(r", (?:kind|calls|custom_call_target|backend_config|metadata|to_apply|"
                         r"slice|dimensions|replica_groups|channel_id|index)=")


_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)")


def computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """({computation: [(opcode, line), ...]}, the entry computation's name) of HLO text."""
    out: dict[str, list[tuple[str, str]]] = {}
    current, entry = None, None
    for line in text.splitlines():
        if not line.startswith((" ", "}")):
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(2)
                out[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            m = _OPCODE.search(line.split(" = ", 1)[1])
            if m:
                out[current].append((m.group(1), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return out, entry


def called(line: str, *attributes: str) -> list[str]:
    """The computations an instruction names in ``attributes`` (one name, or a {list})."""
    names = []
    for attribute in attributes:
        m = re.search(rf"\b{attribute}=(\{{[^}}]*\}}|%?[\w.\-]+)", line)
        if m:
            names += [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", m.group(1))]
    return names


def _trips(line: str) -> int:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
    if m is None:
        raise ValueError(f"a while loop without a known trip count: {line.strip()[:200]}")
    return int(m.group(1))


def _shape_bytes(text: str) -> int:
    """The bytes of the shapes ``text`` names ("f32[16,1024]", tuples: each element)."""
    total = 0
    for kind, bits, dims in _SHAPE.findall(text):
        width = 1 if kind == "pred" else int(bits or 8) // 8
        total += width * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _result_bytes(lines: list[tuple[str, str]]) -> dict[str, int]:
    """{instruction name: its result's bytes} of one computation's lines."""
    sizes = {}
    for opcode, line in lines:
        m = _NAME.match(line)
        if m:
            rhs = line.split(" = ", 1)[1]
            sizes[m.group(1)] = _shape_bytes(rhs[:rhs.index(f" {opcode}(") + 1])
    return sizes


def _bytes(line: str, sizes: dict[str, int]) -> int:
    """The bytes an instruction reads and writes: its result's and its operands' shapes, an
    operand printed without its shape looked up in ``sizes`` (its computation's results)."""
    rhs = _ATTRIBUTES.split(line.split(" = ", 1)[1])[0]
    m = _OPCODE.search(rhs)
    result, operands = rhs[:m.start() + 1], rhs[m.end():]
    total = _shape_bytes(result)
    for operand in re.split(r",\s*(?![^\[]*\])", operands.rstrip(")")):
        if _SHAPE.search(operand):
            total += _shape_bytes(operand)
        else:
            names = _OPERAND.findall(operand)
            total += sum(sizes.get(n, 0) for n in names)
    return total


def tally(text: str) -> tuple[collections.Counter, collections.Counter]:
    """({opcode: launches per run}, {opcode: bytes read and written per run}): one walk of the
    program for both counts."""
    comps, entry = computations(text)

    sizes = {name: _result_bytes(lines) for name, lines in comps.items()}

    def walk(name: str, times: int, count: collections.Counter, moved: collections.Counter) -> None:
        for opcode, line in comps[name]:
            if opcode == "while":
                trips = _trips(line)
                for body in called(line, "body"):
                    walk(body, times * trips, count, moved)
                for cond in called(line, "condition"):
                    walk(cond, times * (trips + 1), count, moved)
            elif opcode == "conditional":
                branches = []
                for branch in called(line, "branch_computations", "true_computation", "false_computation"):
                    branches.append((collections.Counter(), collections.Counter()))
                    walk(branch, times, *branches[-1])
                if branches:
                    most = max(branches, key=lambda b: sum(b[0].values()))
                    count.update(most[0])
                    moved.update(most[1])
            elif opcode == "call":
                for callee in called(line, "to_apply"):
                    walk(callee, times, count, moved)
            elif opcode not in FREE:
                count[opcode] += times
                moved[opcode] += times * _bytes(line, sizes[name])

    count: collections.Counter = collections.Counter()
    moved: collections.Counter = collections.Counter()
    walk(entry, 1, count, moved)
    return count, moved


def kinds(text: str) -> collections.Counter:
    """{opcode: kernels launched per run of the program} (fusion, custom-call, copy, ...)."""
    return tally(text)[0]


def launches(text: str) -> int:
    """Kernels launched per run of the compiled program whose HLO text is ``text``."""
    return sum(kinds(text).values())


def traffic(text: str) -> int:
    """Bytes the program's kernels read and write per run (each launch's operands and result)."""
    return sum(tally(text)[1].values())


def main(argv=None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as f:
            found, moved = tally(f.read())
        detail = ", ".join(f"{n:,} {op}" for op, n in found.most_common())
        print(f"{path}: {sum(found.values()):,} kernels per run ({detail}); "
              f"{sum(moved.values()) / 2**30:.2f} GiB read and written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
