"""The dependency rules of docs/architecture.md, checked on the source by reading its imports.

- `kernels` imports nothing of ours: it sits below everything.
- `stages` never imports `cli` or `recipes`; `recipes` imports only `stages`; `scripts` never imports `tests`.
- No module imports another module's private (`_`) name, nor a private module of another package.
- No two siblings import each other: at every level of the tree (the root packages; the packages and
  modules of `stages`; the modules of one stage), the units that import one another form no circle.

Imports inside functions count as much as those at the top of a file. `python -m tests.test_layering`
prints every break.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "stages", "kernels", "recipes")  # installed as llmopt.<name>
TREES = (*PACKAGES, "scripts", "tests")


def module_name(path: Path) -> tuple[str, ...]:
    """('stages', 'serve', 'engine', 'config') for stages/serve/engine/config.py; a package is its folder."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve(module: tuple[str, ...], is_package: bool, node: ast.ImportFrom) -> tuple[str, ...] | None:
    """The absolute module (our dotted parts, without `llmopt`) an ImportFrom names; None if not ours."""
    if node.level:
        base = module if is_package else module[:-1]
        base = base[:len(base) - (node.level - 1)]
        return base + tuple((node.module or "").split(".")) if node.module else base
    return _ours(node.module or "")


def _ours(dotted: str) -> tuple[str, ...] | None:
    parts = tuple(dotted.split("."))
    if parts[0] == "llmopt" and len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1:]
    if parts[0] in ("tests", "scripts"):
        return parts
    return None


def imports(path: Path) -> list[tuple[tuple[str, ...], str | None, int]]:
    """(target module, imported name or None, line) for every import of ours in the file."""
    module = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name)
                if target:
                    found.append((target, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            if target:
                for alias in node.names:
                    found.append((target, alias.name, node.lineno))
    return found


def sources() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if ".venv" not in p.parts)


def _private(parts) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _module_exists(parts: tuple[str, ...]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def breaks() -> list[str]:
    """Every broken rule, one line each: 'file:line: what'."""
    found: list[str] = []
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
    for path in sources():
        me = module_name(path)
        where = lambda line: f"{path.relative_to(ROOT)}:{line}"  # noqa: E731
        for target, name, line in imports(path):
            # `from pkg import mod` names a module; `from mod import name` a name in it
            full = target + (name,) if name and _module_exists(target + (name,)) else target
            top, dest = me[0], full[0]
            if top == "kernels" and dest != "kernels":
                found.append(f"{where(line)}: kernels imports {'.'.join(full)} (kernels import nothing of ours)")
            if top == "stages" and dest in ("cli", "recipes"):
                found.append(f"{where(line)}: stages imports {'.'.join(full)} (stages never import cli or recipes)")
            if top == "recipes" and dest not in ("recipes", "stages"):
                found.append(f"{where(line)}: recipes imports {'.'.join(full)} (recipes import only stages)")
            if top == "scripts" and dest == "tests":
                found.append(f"{where(line)}: a script imports {'.'.join(full)} (scripts never import tests)")
            if dest != "tests":  # tests too use only the public names of what they test
                found += [f"{where(line)}: {msg}" for msg in _private_use(me, full, name)]
            if top != "tests":
                edges[me].add(full)
    return found + _circles(edges)


def _private_use(me: tuple[str, ...], full: tuple[str, ...], name: str | None) -> list[str]:
    """A private name may be imported only by the module that defines it (never), a private module
    only from inside the package that holds it."""
    out = []
    if name and name not in full[-1:] and name.startswith("_") and not name.startswith("__"):
        out.append(f"imports the private name {name} from {'.'.join(full)}")
    for i, part in enumerate(full):
        if _private([part]) and me[:i] != full[:i]:
            out.append(f"imports the private module {'.'.join(full[:i + 1])} from outside its package")
            break
    return out


def _circles(edges: dict) -> list[str]:
    """Siblings (children of one package) that import each other, directly or around a circle."""
    sibling_edges: dict[tuple[str, ...], dict] = defaultdict(lambda: defaultdict(set))
    for src, targets in edges.items():
        for dst in targets:
            common = 0
            while common < min(len(src), len(dst)) and src[common] == dst[common]:
                common += 1
            if common < len(src) and common < len(dst) and src[0] != "tests":
                parent = src[:common]
                sibling_edges[parent][src[common]].add(dst[common])
    out = []
    for parent, graph in sorted(sibling_edges.items()):
        for cycle in _strongly_connected(graph):
            if len(cycle) > 1:
                where = ".".join(parent) or "the root"
                out.append(f"{where}: {', '.join(sorted(cycle))} import each other (a circle)")
    return out


def _strongly_connected(graph: dict) -> list[set]:
    """Tarjan's components of a small graph {node: {successors}}."""
    index, low, stack, on, result = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            result.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return result


def test_the_layers_hold():
    found = breaks()
    assert not found, f"{len(found)} import rule(s) broken:\n" + "\n".join(found)


def test_the_checker_sees_each_kind_of_break(tmp_path, monkeypatch):
    # a tree that breaks every rule once: the checker must name each
    files = {
        "kernels/__init__.py": "", "kernels/op.py": "from llmopt.stages import artifact\n",
        "stages/__init__.py": "", "stages/artifact.py": "from llmopt.cli import main\n",
        "stages/a.py": "from .b import thing\n", "stages/b.py": "from .a import _helper\n",
        "cli/__init__.py": "", "cli/main.py": "from llmopt.kernels._backend import x\n",
        "recipes/__init__.py": "", "recipes/spec.py": "import llmopt.cli.main\n",
        "scripts/bench.py": "from tests.helpers import make_model\n", "tests/__init__.py": "",
        "tests/helpers.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = "\n".join(breaks())
    for expected in ("kernels imports stages.artifact", "stages imports cli.main", "recipes imports cli.main",
                     "a script imports tests.helpers", "private name _helper", "private module kernels._backend",
                     "stages: a, b import each other", "the root: cli, kernels, stages import each other"):
        assert expected in found, (expected, found)


if __name__ == "__main__":
    lines = breaks()
    print("\n".join(lines) or "no breaks")
    print(f"{len(lines)} break(s)")
