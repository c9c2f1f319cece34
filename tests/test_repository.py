"""The repository's own rules: the layout the README shows, imports that point one way,
documentation in this repository's words (no pointers to files that are not in it)."""

from __future__ import annotations

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_muon"
README = REPO / "README.md"


def _text_files():
    for sub in ("megatron_muon", "tests", "tools", "examples", "docs", "patches", ".ci"):
        for path in sorted((REPO / sub).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path
    yield README


def _imports(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_pointers_to_files_outside_the_repository():
    # Design notes live in docs/design.md; nothing may cite notes that are not shipped.
    pattern = re.compile(r"\bSPEC\b|SPEC\.md|ENVIRONMENT\.md")
    me = pathlib.Path(__file__).resolve()
    found = [f"{p.relative_to(REPO)}:{i}" for p in _text_files() if p.resolve() != me
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert not found, found


def test_readme_is_a_short_front_door_with_a_line_per_folder():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    tree = text[text.index("## Layout"):]
    tree = tree[tree.index("```"):]
    tree = tree[: tree.index("```", 3)]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    shown = set(re.findall(r"^\s+(\w+)/", tree, re.M))
    assert folders == shown, (sorted(folders), sorted(shown))
    for top in ("patches", "examples", "tools", "tests", "docs"):
        assert re.search(rf"^{top}/", tree, re.M), top
    for py in PACKAGE.glob("*.py"):  # modules live in a concern's folder
        assert py.name == "__init__.py", py


def test_imports_point_one_way():
    """core/ imports nothing else of the package, nor Megatron, nor torch.distributed;
    kernels/ and distributed/ do not import Megatron or the adapter."""
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for name in _imports(path):
            assert not (name == "megatron" or name.startswith(("megatron.", "torch.distributed"))), \
                (path, name)
            assert not name.startswith("megatron_muon.") or \
                name.startswith("megatron_muon.core"), (path, name)
    for folder in ("kernels", "distributed"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for name in _imports(path):
                assert not (name == "megatron" or name.startswith("megatron.")), (path, name)
                assert not name.startswith(("megatron_muon.megatron", "megatron_muon.peft",
                                            "megatron_muon.islands",
                                            "megatron_muon.testing")), (path, name)


def test_library_code_does_not_import_the_test_harness():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        bad = {n for n in _imports(path) if n.startswith("megatron_muon.testing")}
        assert not bad, (path, bad)


def _harness_imports(path: pathlib.Path) -> set:
    """What ``path`` imports of ``megatron_muon.testing``, however it is spelled:
    ``import megatron_muon.testing.x``, ``from megatron_muon.testing.x import y``,
    ``from megatron_muon import testing`` or ``importlib.import_module("megatron_muon.testing...")``
    (also inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__"):
            names.add(str(node.args[0].value))
    return {n for n in names
            if n == "megatron_muon.testing" or n.startswith("megatron_muon.testing.")}


def test_examples_stand_alone_without_the_test_harness():
    """An example is what a user copies: it builds its model and optimizer from the library
    (``megatron_muon.megatron.models``, ``.config``), never from ``megatron_muon.testing``."""
    examples = sorted(p for p in (REPO / "examples").rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    assert any(p.suffix == ".py" for p in examples)
    for path in examples:
        if path.suffix == ".py":
            bad = _harness_imports(path)
        else:  # launch scripts: no ``python -m megatron_muon.testing...`` either
            bad = set(re.findall(r"megatron_muon\.testing[\w.]*", path.read_text(errors="replace")))
        assert not bad, (str(path.relative_to(REPO)), sorted(bad))


def _module_graph() -> dict:
    """{module: modules of the package it imports}, at any depth of the file (a deferred
    import inside a function is still a dependency)."""
    def module_of(path):
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        return ".".join(parts)

    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = {d for d in deps if not (name.startswith(d + ".") and
                                                 modules[d].name == "__init__.py")}
    return graph


def test_no_import_cycles_between_modules():
    """Two modules that import each other (even inside a function) share something that
    belongs in a leaf module of its own."""
    graph = _module_graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
