"""The package's layout rules, checked on the import graph (module-level and function-level imports alike;
imports under `if TYPE_CHECKING:` are annotations only and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vocalis"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, deferred: bool = True) -> set[str]:
    """The vocalis modules `path` imports (outside `if TYPE_CHECKING:` blocks; with deferred=False only those run
    at import time, not the ones inside functions)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif not deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip.update(id(n) for n in ast.walk(node))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("vocalis"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("vocalis"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph(deferred: bool = True) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(p, deferred) if m in files} for name, p in files.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(graph: dict[str, set[str]], sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    def under(module: str, roots: tuple[str, ...]) -> bool:
        return any(module == f"vocalis.{r}" or module.startswith(f"vocalis.{r}.") for r in roots)

    return sorted(f"{a} -> {b}" for a, deps in graph.items() if under(a, sources)
                  for b in deps if under(b, targets) and not under(b, sources))


def test_no_import_cycles() -> None:
    """At import time (an import inside a function runs when it is called, after both modules are loaded)."""
    graph = _graph(deferred=False)
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue  # a package and its own submodules
            if seen.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in seen:
                visit(dep, stack)
        stack.pop()
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_point_down() -> None:
    graph = _graph()
    bad = (_violations(graph, ("models",), ("frontend", "engine", "token2wav", "runtime", "serve", "train",
                                             "reference", "batch", "bench"))
           + _violations(graph, ("engine",), ("token2wav",)) + _violations(graph, ("token2wav",), ("engine",))
           + [v for v in _violations(graph, ("kernels",), ("",)) if not v.split(" -> ")[1].startswith("vocalis.kernels")]
           + _violations(graph, ("tts", "cli", "serve", "runtime", "batch", "engine", "token2wav", "frontend"),
                         ("reference",)))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_training_code_off_the_inference_path() -> None:
    graph = _graph()
    bad = _violations(graph, ("tts", "serve", "runtime", "engine", "token2wav", "frontend", "models", "batch"),
                      ("train",))
    assert not bad, "inference modules importing training code:\n" + "\n".join(bad)
