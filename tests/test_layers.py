"""The layers of hss point one way: no import cycle among hss modules, and no import against the declared order.

Imports are read from the source (module level and inside functions alike: a lazy import still runs); imports
under ``if TYPE_CHECKING:`` never run and are skipped. No GPU needed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hss"

# Lowest first. A module may import modules of its own layer or of a lower one; the package face (``hss``
# itself) is for users only. Prefixes name a module and everything under it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hss.errors", "hss._version", "hss._util"),       # every exception; the version; the shared helpers
    ("hss.reference",),                                # float64 numpy references (numpy and ml_dtypes only)
    ("hss.checkpoint",),                               # model files (GGUF, safetensors, HF), tokenizers, numpy forward
    ("hss._interop",),                                 # reading foreign arrays and streams (torch, CuPy, CAI, DLPack)
    ("hss._args",),                                    # the argument rules
    ("hss._dlpack", "hss._params"),                    # DLPack export, parameter packing
    ("hss.decls",),                                    # kernel declarations
    ("hss.emulator",),                                 # the CPU driver
    ("hss.cuda", "hss.cuda._driver"),                  # the seam: cuda.bindings or the emulator
    ("hss.cuda._context",),                            # contexts, streams, events
    ("hss.cuda._memory",),                             # buffers, copies
    ("hss.cuda._launch",),                             # modules, launches, graphs
    ("hss.cuda_min", "hss.cuda._blas"),                # the original's driver surface; cuBLAS
    ("hss.cuda.ptx", "hss.predictor.projection", "hss.predictor.calibrate"),   # PTX table; P; its calibration
    ("hss.cuda.gpu", "hss.predictor", "hss.attention"),   # the QSA kernel backend, the predictor, the attention
    ("hss.qsa", "hss.swap"),                           # the indexer; the high-speed swap
    ("hss.model",),                                    # a real decoder on the device (weights, forward, KV modes)
    ("hss.demo",),
    ("hss.bench", "hss.__main__"),                     # nothing imports these
    ("hss",),                                          # the package face
)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str) -> set[str]:
    """The hss modules that module ``name`` imports (a ``from X import Y`` of a submodule Y counts as X.Y)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "hss")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] != "hss":
                    continue
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_imports_follow_the_layer_order():
    wrong = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
             for a, deps in GRAPH.items() for b in sorted(deps) if layer_of(b) > layer_of(a)]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_cycles():
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                walk(dep)
        path.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            walk(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_reference_imports_only_numpy():
    for name, path in MODULES.items():
        if not name.startswith("hss.reference"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= {"numpy", "ml_dtypes", "hss", "__future__", "math", "typing", "dataclasses",
                             "functools", "itertools"}, f"{name} imports {roots}"


@pytest.mark.parametrize("bad", [("hss._args", "hss.cuda._context"), ("hss._interop", "hss._args"),
                                 ("hss.decls", "hss.cuda_min")])
def test_the_checker_sees_an_upward_import(bad):
    a, b = bad
    assert layer_of(b) > layer_of(a)
