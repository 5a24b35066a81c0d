"""The import graph of rewy_hf (rewy_hf.kernels and rewy_hf.adapters included) has no cycle, no
module imports another rewy_hf module's private (underscore) name, the folders import one way
down their layers, no function outside a Triton kernel is too long to read, nothing installed
imports the developer tools of dev/, and rewy_hf/bench/ stays a bounded share of the library.

Imports are read with ``ast``, at module level and inside functions alike (an
import deferred into a function still ties the two modules together). An edge
goes to the module an import names: ``from .a import b`` is an edge to ``a.b``
when that is a module, else to ``a``; the packages a dotted name passes
through are not edges of their own, since a package importing its submodules
and a submodule importing a sibling is the ordinary shape of a package.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOTS = ("rewy_hf", "rewy_hf.kernels", "rewy_hf.adapters")


def package_dirs() -> dict[str, Path]:
    """Where each root package's files are, as the installation maps them."""
    return {name: Path(next(iter(importlib.util.find_spec(name).submodule_search_locations))) for name in ROOTS}


def walk_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every module of every root package (subpackages need an __init__.py)."""
    modules: dict[str, Path] = {}

    def walk(name: str, folder: Path) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_dir() and (path / "__init__.py").is_file():
                walk(f"{name}.{path.name}", path)
            elif path.suffix == ".py":
                modules[name if path.name == "__init__.py" else f"{name}.{path.stem}"] = path

    for name, folder in roots.items():
        walk(name, folder)
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]):
    """(target module, imported name or None, line) for each intra-package import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    yield target, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    yield submodule, None, node.lineno
                elif source in modules:
                    yield source, alias.name, node.lineno


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _, _ in imports_of(name, path, modules):
            if target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    found = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:                       # follow edges inside the component until the path closes
            nxt = sorted(w for w in graph[path[-1]] if w in component)
            back = [w for w in nxt if w in seen]
            if back:
                found.append(path[path.index(back[0]):] + [back[0]])
                break
            path.append(nxt[0])
            seen.add(nxt[0])
    return found


def private_imports(modules: dict[str, Path]) -> list[str]:
    out = []
    for name, path in modules.items():
        for target, imported, line in imports_of(name, path, modules):
            leaf = imported if imported is not None else target.rpartition(".")[2]
            if leaf.startswith("_") and not (leaf.startswith("__") and leaf.endswith("__")) and target != name:
                out.append(f"{path}:{line}: {name} imports {target + ('.' + imported if imported else '')}")
    return out


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    found = walk_modules(package_dirs())
    for root in ROOTS[1:]:
        assert any(m.startswith(root + ".") for m in found), f"no module found under {root}"
    return found


def test_no_import_cycle(modules):
    found = cycles(import_graph(modules))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_private_name_imported_across_modules(modules):
    found = private_imports(modules)
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_verify_does_not_depend_on_the_bench_engine(modules):
    """`rewy-hf verify` must work where the bench does not: what both need lives outside rewy_hf.bench."""
    graph = import_graph(modules)
    for start in [m for m in modules if m.startswith("rewy_hf.verify")] + ["rewy_hf.cli.verify", "rewy_hf.cli.demo"]:
        assert not {m for m in reachable(graph, start) if m.startswith("rewy_hf.bench")}, start


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` holding ``files`` (path inside it -> text)."""
    pkg = tmp_path / "pkg"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_checks_find_a_planted_cycle_and_private_import(tmp_path):
    pkg = _planted(tmp_path, {"__init__.py": "", "a.py": "from .sub import b\n", "sub/__init__.py": "",
                              "sub/b.py": "def f():\n    from ..a import _helper\n", "c.py": "import pkg.a\n"})
    modules = walk_modules({"pkg": pkg})
    assert set(modules) == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c"}
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    (found,) = private_imports(modules)
    assert found.endswith("pkg.sub.b imports pkg.a._helper")


def test_every_package_is_listed_for_installation():
    """pyproject.toml lists the packages explicitly (kernels/ and adapters/ map into rewy_hf); a
    subpackage missing there works in an editable install and is absent from a wheel."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in walk_modules(package_dirs()).items() if path.name == "__init__.py"}
    assert packages == listed, (sorted(packages - listed), sorted(listed - packages))


# --- layers ---------------------------------------------------------------------------------------

# The installed library's folders, lowest first: the kernels (math only), the package's own top-level
# modules (the public ops, their checks and settings), the adapters, patching, models, parity, verify,
# training, bench and the command line. Each imports only from the layers below it (the loop
# cli -> bench -> training -> cli once ran back up). The package's __init__ and __main__ gather the
# public names and sit above them all.
LAYERS = ("rewy_hf.kernels", "rewy_hf", "rewy_hf.adapters", "rewy_hf.patching", "rewy_hf.models",
          "rewy_hf.parity", "rewy_hf.verify", "rewy_hf.training", "rewy_hf.bench", "rewy_hf.cli")
FACADE = ("rewy_hf", "rewy_hf.__main__")
MAX_FUNCTION_LINES = 100


def layer_of(module: str, layers: tuple[str, ...]) -> str:
    """The longest layer that is ``module`` or a package above it; a module directly in the root
    package (the second layer) belongs to that layer, a deeper one to a layer of its own."""
    best = max((x for x in layers if module == x or module.startswith(x + ".")), key=len)
    if best == layers[1] and module.count(".") > best.count(".") + 1:
        raise AssertionError(f"{module} lies in a folder that no layer names; add it to the layers")
    return best


def upward_imports(modules: dict[str, Path], layers: tuple[str, ...], facade: tuple[str, ...] = ()) -> list[str]:
    """Imports of a module in a layer above the importing module's own (``facade`` modules excepted)."""
    out = []
    for name, path in modules.items():
        if name in facade:
            continue
        own = layers.index(layer_of(name, layers))
        for target, imported, line in imports_of(name, path, modules):
            theirs = layers.index(layer_of(target, layers))
            if theirs > own:
                out.append(f"{path}:{line}: {name} ({layers[own]}) imports "
                           f"{target + ('.' + imported if imported else '')} ({layers[theirs]})")
    return out


def test_every_import_points_down_the_layers(modules):
    """Among them: rewy_hf.kernels, the lowest layer, imports no rewy_hf module outside itself
    (rewy_hf.errors, rewy_hf.validation and rewy_hf.settings re-export what the kernels define)."""
    found = upward_imports(modules, LAYERS, FACADE)
    assert not found, "imports that run up the layers:\n" + "\n".join(found)


@pytest.mark.parametrize("module, layer", [("rewy_hf.kernels.core", "rewy_hf.kernels"), ("rewy_hf.ops", "rewy_hf"),
                                           ("rewy_hf.cli.bench", "rewy_hf.cli"), ("rewy_hf", "rewy_hf")])
def test_modules_map_to_their_layers(module, layer):
    assert layer_of(module, LAYERS) == layer


def test_the_layering_check_finds_a_planted_upward_import(tmp_path):
    pkg = _planted(tmp_path, {"__init__.py": "", "errors.py": "", "low/__init__.py": "",
                              "low/a.py": "from . import b\n", "low/b.py": "def f():\n    from ..errors import E\n"})
    (found,) = upward_imports(walk_modules({"pkg": pkg}), ("pkg.low", "pkg"))
    assert found.endswith("pkg.low.b (pkg.low) imports pkg.errors.E (pkg)")


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("triton" in ast.unparse(d) or ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list)


def test_no_function_outside_a_triton_kernel_is_longer_than_the_limit(modules):
    long = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


# --- the developer tools stay out of the installed package ------------------------------------------

# rewy_hf/bench/ holds what a user of `rewy-hf bench` runs; the developer measurements and reports live in
# dev/bench_lab/ (not installed), so the bench is at most this share of the installed library's lines.
MAX_BENCH_SHARE = 0.15
DEV = Path(__file__).resolve().parents[1] / "dev"


def lines_of(folder: Path) -> int:
    """Lines of every .py file under ``folder``, as ``find folder -name '*.py' | xargs cat | wc -l``."""
    return sum(path.read_bytes().count(b"\n") for path in folder.rglob("*.py"))


def test_the_bench_is_at_most_its_share_of_the_installed_library():
    """The installed library is every .py under the folders the installation maps into rewy_hf
    (rewy_hf/, kernels/, adapters/)."""
    dirs = package_dirs()
    library = sum(lines_of(folder) for folder in dirs.values())
    bench = lines_of(dirs["rewy_hf"] / "bench")
    assert bench <= MAX_BENCH_SHARE * library, (
        f"rewy_hf/bench/ has {bench} of the installed library's {library} lines ({bench / library:.1%}, at most "
        f"{MAX_BENCH_SHARE:.0%}): developer measurements belong in dev/bench_lab/")


def dev_imports(modules: dict[str, Path], dev_names: set[str]) -> list[str]:
    """Imports of a module named by dev/ (a script or package there, or ``dev`` itself)."""
    out = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            out += [f"{path}:{node.lineno}: {name} imports {t}" for t in targets if t.split(".")[0] in dev_names]
    return out


def test_nothing_installed_imports_from_dev(modules):
    names = {"dev"} | {p.stem for p in DEV.glob("*.py")}
    names |= {p.name for p in DEV.iterdir() if (p / "__init__.py").is_file()}
    assert {"bench_lab", "kernel_registers"} <= names
    found = dev_imports(modules, names)
    assert not found, "installed modules that import the developer tools (dev/, not installed):\n" + "\n".join(found)


def test_the_dev_import_check_finds_a_planted_import(tmp_path):
    pkg = _planted(tmp_path, {"__init__.py": "", "a.py": "import os\nfrom bench_lab.merge import merge_runs\n",
                              "b.py": "def f():\n    import dev.first_calls\n"})
    found = dev_imports(walk_modules({"pkg": pkg}), {"dev", "bench_lab"})
    assert [f.rpartition(": ")[2] for f in found] == ["pkg.a imports bench_lab.merge", "pkg.b imports dev.first_calls"]


# --- one vocabulary ------------------------------------------------------------------------------

def _vocabulary() -> dict[str, frozenset]:
    from rewy_hf.kernels import vocabulary as voc

    return {"FAMILIES": frozenset(voc.FAMILIES), "public op names": frozenset(voc.PUBLIC_OPS.values()),
            "report names": frozenset(voc.REPORT_OPS.values()), "BACKENDS": frozenset(voc.BACKENDS),
            "CORE_BACKENDS": frozenset(voc.CORE_BACKENDS), "POLICIES": frozenset(voc.POLICIES),
            "GATE_KINDS": frozenset(voc.GATE_KINDS)}


def _strings(node) -> list[str] | None:
    """The strings of a tuple / list / set literal of string constants only, else None."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]
    return None


def _spelled_groups(value) -> list[list[str]]:
    """The string lists a bound value spells out: a literal of strings (also as a call's argument, as in
    ``frozenset({...})``), or a string-to-string dict literal's keys and its values."""
    groups = []
    for node in [value] + (list(value.args) if isinstance(value, ast.Call) else []):
        if (found := _strings(node)) is not None:
            groups.append(found)
        elif isinstance(node, ast.Dict) and node.keys and all(
                isinstance(x, ast.Constant) and isinstance(x.value, str) for x in node.keys + node.values):
            groups += [[k.value for k in node.keys], [v.value for v in node.values]]
    return groups


def vocabulary_spelled_out(modules: dict[str, Path], home: str) -> list[str]:
    """Names bound outside ``home`` to one of the vocabulary's lists spelled by its members (in any
    order), or to a name mapping (string to string) over them: a second definition, which may drift.
    ``__all__`` lists exports and is not a definition."""
    vocabulary = _vocabulary()
    out = []
    for name, path in modules.items():
        if name == home:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
            for group in _spelled_groups(node.value):
                for what, members in vocabulary.items():
                    if frozenset(group) == members:
                        out.append(f"{path}:{node.lineno}: {name} spells out {what} {sorted(members)}")
    return out


def test_each_vocabulary_list_is_defined_once(modules):
    """Families, op names, backends, policies and gate kinds are defined in kernels/vocabulary.py
    alone; the modules that export them under their own names hand out the same objects."""
    found = vocabulary_spelled_out(modules, "rewy_hf.kernels.vocabulary")
    assert not found, "vocabulary defined again outside kernels/vocabulary.py:\n" + "\n".join(found)

    from rewy_hf import op_inputs, validation
    from rewy_hf.kernels import vocabulary as voc

    assert validation.BACKENDS is voc.BACKENDS and validation.POLICIES is voc.POLICIES
    assert op_inputs.OPS is voc.FAMILIES and op_inputs.DISPATCH_NAME is voc.REPORT_OPS
    assert set(voc.BACKENDS) - {"auto"} <= set(voc.CORE_BACKENDS)


def test_the_vocabulary_check_finds_a_planted_second_definition(tmp_path):
    pkg = _planted(tmp_path, {
        "__init__.py": "__all__ = ['chunk_delta_rule', 'chunk_gated_delta_rule', 'chunk_kda', 'chunk_gdn2']\n",
        "a.py": "MODES = ('full', 'recompute')\nOK = ('full', 'recompute', 'both')\n"
                "def f():\n    choices: frozenset = frozenset({'triton', 'auto', 'torch'})\n",
        "b.py": "NAMES = {'delta_rule': 'x', 'gdn': 'y', 'kda': 'z', 'gdn2': 'w'}\n"
                "FUNCTIONS = {'delta_rule': f, 'gdn': f, 'kda': f, 'gdn2': f}\n"})
    found = vocabulary_spelled_out(walk_modules({"pkg": pkg}), "pkg.vocabulary")
    assert [f.rpartition(": ")[2].split(" [")[0] for f in found] == [
        "pkg.a spells out POLICIES", "pkg.a spells out BACKENDS", "pkg.b spells out FAMILIES"], found
