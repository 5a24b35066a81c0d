"""The installed library's folders form layers, each importing only from the layers below it, and no
function outside a Triton kernel is too long to read.

The layers, lowest first: the kernels (math only), the package's own top-level modules (the public ops,
their checks and settings), the adapters (where each model calls its core), patching, models, parity,
verify, training, bench, and the command line. ``rewy_hf/__init__.py`` and ``__main__.py`` sit above
all of them: they gather the public names. A lower layer that needed a higher one would make the import
picture run back up, the loop that made the package hard to follow (cli -> bench -> training -> cli).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (folder on disk, the package it installs as)
SOURCES = (("rewy_hf", "rewy_hf"), ("kernels", "rewy_hf.kernels"), ("adapters", "rewy_hf.adapters"))
LAYERS = ("rewy_hf.kernels", "rewy_hf", "rewy_hf.adapters", "rewy_hf.patching", "rewy_hf.models",
          "rewy_hf.parity", "rewy_hf.verify", "rewy_hf.training", "rewy_hf.bench", "rewy_hf.cli")
FACADE = ("rewy_hf.__init__", "rewy_hf.__main__")
MAX_FUNCTION_LINES = 100


def _modules():
    for folder, package in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            yield path, ".".join((package, *rel.parts))


def _layer(module: str) -> str:
    """The layer a module belongs to: the longest layer name that is a package prefix of it; a module
    directly under rewy_hf belongs to the layer "rewy_hf"."""
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    if best == "rewy_hf" and module.count(".") > 1:
        raise AssertionError(f"{module} lies in a folder that no layer names; add it to LAYERS")
    return best


def _imports(path: Path, module: str):
    """(line, imported module) for every import of rewy_hf, relative ones resolved, at any depth (imports
    inside functions count: they are dependencies all the same)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "rewy_hf" or name.startswith("rewy_hf."):
                yield node.lineno, name


def _module_layer(name: str, known: set[str]) -> str:
    """The layer of an imported name, which may be a module or a name inside one."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return _layer(name)


def test_every_import_points_down_the_layers():
    modules = dict((m, p) for p, m in _modules())
    known = set(modules) | {m.removesuffix(".__init__") for m in modules}
    upward = []
    for module, path in modules.items():
        if module in FACADE:
            continue
        own = LAYERS.index(_layer(module.removesuffix(".__init__")))
        for line, target in _imports(path, module):
            theirs = LAYERS.index(_module_layer(target, known))
            if theirs > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]})")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: a module in kernels that imports the patching layer is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..patching import dispatch\n")
    [(line, target)] = list(_imports(bad, "rewy_hf.kernels.bad"))
    known = {"rewy_hf.patching.dispatch", "rewy_hf.kernels.bad"}
    assert LAYERS.index(_module_layer(target, known)) > LAYERS.index(_layer("rewy_hf.kernels.bad"))


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("triton" in ast.unparse(d) or ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list)


def test_no_function_outside_a_triton_kernel_is_longer_than_the_limit():
    long = []
    for path, module in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("module, layer", [("rewy_hf.kernels.core", "rewy_hf.kernels"), ("rewy_hf.ops", "rewy_hf"),
                                           ("rewy_hf.cli.bench", "rewy_hf.cli")])
def test_modules_map_to_their_layers(module, layer):
    assert _layer(module) == layer
