"""The package's import rules, read with ``ast`` (nothing is imported or executed).

Rooms and ranks: a module imports its own room and rooms of lower rank, never one
above, never in a circle (between rooms or between modules); manual_grads imports
the model only and is imported only by training, tools and cli; nothing imports
the cli. ``jaxformer/__init__.py`` (the public API) imports only the model,
``jaxformer/__main__.py`` only the cli. No private name (``_x``) crosses rooms.
Imports sit at the top of a module, except of the optional heavy dependencies.

``check(root)`` returns every breach as a Violation (file, line, rule, what).
"""

from __future__ import annotations

import ast
import pathlib
from typing import NamedTuple

PACKAGES = ("jaxformer", "manual_grads")
PUBLIC_API, ENTRY_POINT, CLI, MANUAL = "jaxformer", "jaxformer.__main__", "jaxformer.cli", "manual_grads"
RANKS = {
    "jaxformer.kernels": -1,  # device kernels and their tuning: below the model, which names them as cores
    "jaxformer.model": 0,
    "jaxformer.data": 1, MANUAL: 1,
    "jaxformer.checkpoints": 2, "jaxformer.observe": 2,  # orbax train states; metrics and reports
    "jaxformer.formats": 2,  # Hugging Face, GGUF and PEFT files: beside the checkpoints, neither imports the other
    "jaxformer.training": 3,
    "jaxformer.inference": 4,  # restores a run's train state, whose layout training defines
    "jaxformer.tools": 5,
    CLI: 6,
}
MANUAL_IMPORTERS = {"jaxformer.training", "jaxformer.tools", CLI}  # rooms that may import manual_grads
# Optional heavy dependencies: imported inside the function that needs them, so that
# importing jaxformer neither needs them installed nor pays their start-up time.
HEAVY_OPTIONAL = frozenset({"torch", "matplotlib", "tensorboardX", "transformers", "tokenizers", "datasets",
                            "pyarrow", "safetensors", "huggingface_hub", "gguf", "jinja2",
                            "jaxformer.tools.torch_ref.model", "jaxformer.tools.torch_ref.layers"})  # import torch at their top


class Import(NamedTuple):
    line: int
    target: str  # the module imported from, absolute ("jaxformer.model.linear", "numpy")
    names: tuple  # the names taken from it ("from m import a, b"); () for "import m"
    binds: tuple  # the local names bound: ("c",) for "import m as c", ("m.sub",) for "import m.sub"
    in_function: bool


class Violation(NamedTuple):
    path: str
    line: int
    rule: str
    what: str

    def __str__(self):
        return f"{self.path}:{self.line}: [{self.rule}] {self.what}"


# ------------------------------------------------------------------ reading the sources


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{module name: path} of jaxformer/**/*.py and manual_grads/*.py under ``root``."""
    paths = sorted((root / PACKAGES[0]).rglob("*.py")) + sorted((root / PACKAGES[1]).rglob("*.py"))
    return {module_name(root, p): p for p in paths}


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <node.module> import ...``, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(module: str, is_package: bool, tree: ast.Module) -> list[Import]:
    """Every import statement of a module's ``tree``, with whether it sits inside a function."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(child.lineno, a.name, (), (a.asname or a.name,), in_function)
                             for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append(Import(child.lineno, absolute(module, is_package, child),
                                    tuple(a.name for a in child.names),
                                    tuple(a.asname or a.name for a in child.names), in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


# ------------------------------------------------------------------ rooms


def room_of(module: str) -> str | None:
    """The room a module belongs to; None for a jaxformer module outside every room."""
    if module in (PUBLIC_API, ENTRY_POINT):
        return module
    if module.split(".")[0] == MANUAL:
        return MANUAL
    room = ".".join(module.split(".")[:2])
    return room if room in RANKS else None


def may_import(src: str, dst: str) -> bool:
    """Whether a module of room ``src`` may import one of room ``dst``."""
    if src == dst:
        return True
    if src == ENTRY_POINT:
        return dst == CLI
    if src in (PUBLIC_API, MANUAL):
        return dst in ("jaxformer.model", "jaxformer.kernels")
    if dst == MANUAL:
        return src in MANUAL_IMPORTERS
    if dst == PUBLIC_API:  # the public API sits just above the model
        return RANKS[src] > 0
    if dst == ENTRY_POINT:
        return False
    return RANKS[dst] < RANKS[src] or src == CLI


def resolve(imp: Import, modules: dict) -> list[str]:
    """The package modules an import reaches: ``from pkg import sub`` reaches pkg.sub."""
    if imp.target.split(".")[0] not in PACKAGES:
        return []
    subs = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
    rest = len(subs) < len(imp.names) or not imp.names
    return subs + ([imp.target] if rest else [])


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ------------------------------------------------------------------ the rules


def direction_violations(rel: str, module: str, imp: Import, targets: list[str]) -> list[Violation]:
    src = room_of(module)
    out = []
    for target in targets:
        dst = room_of(target)
        if dst is None or src is None:
            continue  # a module outside every room is reported once, by check()
        if not may_import(src, dst):
            why = "nothing may import the cli" if dst == CLI else f"{src} may not import {dst}"
            out.append(Violation(rel, imp.line, "direction", f"{why} ({target})"))
    return out


def private_violations(rel: str, module: str, imp: Import) -> list[Violation]:
    """``from other_room.module import _x`` or ``import other_room._module``."""
    if imp.target.split(".")[0] not in PACKAGES or room_of(imp.target) == room_of(module):
        return []
    private = [p for p in imp.target.split(".") if is_private(p)] + [n for n in imp.names if is_private(n)]
    return [Violation(rel, imp.line, "private", f"{name} taken from {imp.target} into {room_of(module)}")
            for name in private]


def bound_modules(imports: list[Import], modules: dict) -> dict[str, str]:
    """{local name: package module} that imports bind (``import a.b`` binds the dotted
    name a.b, read back as such by ``dotted``)."""
    bound = {}
    for imp in imports:
        if not imp.names and imp.target in modules:
            bound[imp.binds[0]] = imp.target
        for name, local in zip(imp.names, imp.binds):
            if f"{imp.target}.{name}" in modules:
                bound[local] = f"{imp.target}.{name}"
    return bound


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def private_attribute_violations(rel: str, module: str, tree: ast.Module, bound: dict) -> list[Violation]:
    """``other_room_module._x`` read through a module that was imported whole."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        base = dotted(node.value)
        target = bound.get(base)
        if target and room_of(target) != room_of(module):
            out.append(Violation(rel, node.lineno, "private",
                                 f"{base}.{node.attr} read from {target} into {room_of(module)}"))
    return out


def function_violations(rel: str, imp: Import) -> list[Violation]:
    if not imp.in_function or imp.target.split(".")[0] in HEAVY_OPTIONAL or imp.target in HEAVY_OPTIONAL:
        return []
    return [Violation(rel, imp.line, "function-level", f"import of {imp.target} inside a function")]


def strongly_connected(edges: dict[str, set]) -> list[set]:
    """The groups of nodes of ``edges`` ({node: {nodes it imports}}) that reach each other
    (Tarjan's algorithm); a group of one only when the node imports itself."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1 or v in edges.get(v, ()):
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return groups


def circle_through(start: str, group: set, edges: dict) -> list[str]:
    """The shortest path start -> ... -> start inside ``group`` (breadth first)."""
    paths, frontier = {start: [start]}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def cycle_violations(kind: str, edges: dict, sites: dict) -> list[Violation]:
    """A Violation per group of nodes in a circle, at the circle's first edge;
    ``sites[a, b]`` is the (file, line) of an import a -> b."""
    out = []
    for group in strongly_connected(edges):
        circle = circle_through(min(group), group, edges)
        what = " -> ".join(circle) + " (at " + ", ".join(
            "{}:{}".format(*sites[a, b]) for a, b in zip(circle, circle[1:])) + ")"
        if len(group) > len(circle) - 1:
            what += "; the circles join " + ", ".join(sorted(group))
        out.append(Violation(*sites[circle[0], circle[1]], f"{kind} circle", what))
    return out


def check(root) -> list[Violation]:
    """Every breach of the import rules in the packages under ``root``, sorted."""
    root = pathlib.Path(root)
    modules = find_modules(root)
    found, module_edges, room_edges, module_sites, room_sites = [], {}, {}, {}, {}
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        src = room_of(module)
        if src is None:
            found.append(Violation(rel, 1, "room", f"{module} belongs to no room (give it a rank in RANKS)"))
        tree = ast.parse(path.read_text(), rel)
        imports = read_imports(module, path.name == "__init__.py", tree)
        found += private_attribute_violations(rel, module, tree, bound_modules(imports, modules))
        for imp in imports:
            targets = resolve(imp, modules)
            found += direction_violations(rel, module, imp, targets)
            found += private_violations(rel, module, imp)
            found += function_violations(rel, imp)
            for target in targets:
                module_edges.setdefault(module, set()).add(target)
                module_sites.setdefault((module, target), (rel, imp.line))
                dst = room_of(target)
                if src and dst and src != dst:
                    room_edges.setdefault(src, set()).add(dst)
                    room_sites.setdefault((src, dst), (rel, imp.line))
    found += cycle_violations("room", room_edges, room_sites)
    found += cycle_violations("module", module_edges, module_sites)
    return sorted(set(found))
