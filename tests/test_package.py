"""The package's shape: no import cycle, a cheap `import edgellm`, and facts where they belong
(architectures named only under architectures/, backends compared only under backends/:
test_backends.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import edgellm

PACKAGE = Path(edgellm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """edgellm modules `path` imports, at any depth of its code (function-level imports too)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("edgellm"))
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (
                node.module or "")
            if not target.startswith("edgellm"):
                continue
            for a in node.names:  # `from . import patches` imports the module, not the package
                sub = PACKAGE.parent / target.replace(".", "/") / a.name
                found.add(f"{target}.{a.name}" if sub.with_suffix(".py").is_file()
                          or (sub / "__init__.py").is_file() else target)
    return found - {here}


def test_no_import_cycle_in_the_package():
    graph = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}
    # a package's __init__ importing its own submodules is how re-exports work, not a cycle
    # unless a submodule imports the package back
    state, cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                cycle.append(path + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycle == [], " -> ".join(cycle[0])


def test_the_export_stages_import_neither_the_run_side_nor_the_sweep():
    """run/ (what uses a written program) and sweeps/ sit beside the export: only the entry
    points (cli.py, __init__.py) and those packages themselves import them."""
    sides = ("edgellm.run", "edgellm.sweeps")
    entry = {"edgellm", "edgellm.cli"}
    graph = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}
    assert {"edgellm.run.session", "edgellm.sweeps"} <= set(graph)  # the scan sees them
    crossing = {(m, i) for m, found in graph.items() if m not in entry
                and not m.startswith(sides) for i in found if i.startswith(sides)}
    assert crossing == set()
    assert any(i.startswith("edgellm.run") for i in graph["edgellm.cli"])  # the scan sees those

def test_importing_edgellm_imports_no_torch_nor_executorch():
    code = ("import sys, edgellm, edgellm.config, edgellm.cli; "
            "print(sorted(m for m in ('torch', 'executorch', 'coremltools', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_nothing_in_sources_names_an_architecture():
    """Architecture facts live with the architecture: the sources read them through the
    registry, and no code (string or name) in sources/ spells a model_type or model class."""
    from edgellm.architectures import every
    from edgellm.architectures.registry import REFUSED_CLASSES

    names = {a.model_type for a in every()} | set(REFUSED_CLASSES)
    names |= {c for a in every() if a.executorch for c in a.executorch.model_classes}
    found = []
    for path in (PACKAGE / "sources").glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(
                    node) not in docstrings and node.value.lower() in names:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.Name) and node.id.lower() in names:
                found.append(f"{path.name}:{node.lineno}: {node.id}")
    assert found == []


def test_the_installed_versions_are_the_ones_the_suite_passed_with():
    """run.sh installs with constraints.txt: every package it pins is installed at that version,
    so a fresh clone tests (and a user runs) what the suite last passed with, not whatever
    release of transformers, gguf or torchao is newest that day."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    pins = [line.split("==") for line in
            (Path(__file__).parents[1] / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert {"torch", "executorch", "transformers", "gguf", "torchao", "tokenizers"} <= {
        name.lower() for name, _ in pins}
    moved = []
    for name, pinned in pins:
        try:
            found = version(name)
        except PackageNotFoundError:
            continue  # an extra's package this install does not have
        if found != pinned:
            moved.append(f"{name} {found} (pinned {pinned})")
    assert not moved, ("installed versions differ from constraints.txt: " + ", ".join(moved)
                       + "; run `bash run.sh test` (it installs the pins) or refresh the pins "
                       "after a green suite")
