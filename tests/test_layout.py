"""The package's layout rules: no import cycles, no file over `MAX_LINES`, layers that import only downwards, and
the inference path off the training and corpus code. Checked on the import graph (module-level and function-level
imports alike: an import inside a function that would close a cycle only hides it; imports under
`if TYPE_CHECKING:` are annotations only and do not count)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vocalis"
MAX_LINES = 450


# The layers, lowest first: each imports nothing from the layers above it. (The shared leaves, `errors`, `config`,
# `checkpoint` and `model_dir`, stand outside the order.)
LAYERS = (("kernels",), ("models",), ("precision",), ("engine", "token2wav", "frontend"), ("backends",),
          ("runtime",), ("tts", "serve", "batch", "bench", "cli", "eval"))
# What `vocalis speak` and every other synthesis path loads.
INFERENCE = ("tts", "serve", "runtime", "engine", "token2wav", "frontend", "models", "batch", "backends",
             "precision", "kernels")
# `vocalis.cli`'s functions on the `vocalis speak` path, and the subcommands' parser modules it loads for its
# `--help` (argument parsers only: what they run loads when their command runs).
SPEAK_PATH = ("_speak", "_whole", "build_parser", "main")
PARSERS_ONLY = ("vocalis.train.cli", "vocalis.corpus.cli")


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


@functools.cache
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def test_no_import_cycles() -> None:
    """Function-level imports count: one that closes a cycle only defers it to the first call."""
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path: Path) -> None:
    (tmp_path / "vocalis").mkdir()
    source = tmp_path / "vocalis" / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vocalis import b\n"
                      "def f():\n    from vocalis.c import d\n")
    global PKG
    saved, PKG = PKG, tmp_path / "vocalis"
    try:
        assert _imports(source) == {"vocalis.c", "vocalis.c.d"}
        assert _imports(source, deferred=False) == set()
    finally:
        PKG = saved
    assert _cycles({"vocalis.a": {"vocalis.b"}, "vocalis.b": {"vocalis.a"}}) == [["vocalis.a", "vocalis.b", "vocalis.a"]]


def test_no_file_over_the_line_limit() -> None:
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES)
    assert not over, f"files over {MAX_LINES} lines (split them by concept):\n" + "\n".join(over)


def test_layers_point_down() -> None:
    graph = _graph()
    bad = (_violations(graph, ("models",), ("frontend", "engine", "token2wav", "runtime", "serve", "train",
                                             "reference", "batch", "bench"))
           + _violations(graph, ("engine",), ("token2wav",)) + _violations(graph, ("token2wav",), ("engine",))
           + [v for v in _violations(graph, ("kernels",), ("",)) if not v.split(" -> ")[1].startswith("vocalis.kernels")]
           + _violations(graph, ("tts", "cli", "serve", "runtime", "batch", "engine", "token2wav", "frontend",
                                 "backends", "precision", "kernels"), ("reference",)))
    for i, layer in enumerate(LAYERS):
        above = tuple(p for higher in LAYERS[i + 1:] for p in higher)
        bad += _violations(graph, layer, above)
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(set(bad)))


def _speak_path() -> set[str]:
    """The modules `vocalis speak` can load: `vocalis.cli`'s module-level imports and those of its `SPEAK_PATH`
    functions, then every import (function-level too) of what they reach, except that the `PARSERS_ONLY` modules
    count only with their module-level imports."""
    full, at_import = _graph(), _graph(deferred=False)
    tree = ast.parse((PKG / "cli.py").read_text())
    start = set(at_import["vocalis.cli"])
    for f in tree.body:
        if isinstance(f, ast.FunctionDef) and f.name in SPEAK_PATH:
            for n in ast.walk(f):
                if isinstance(n, ast.ImportFrom) and n.module:
                    start.update(m for m in (n.module, *(f"{n.module}.{a.name}" for a in n.names)) if m in full)
                elif isinstance(n, ast.Import):
                    start.update(a.name for a in n.names if a.name in full)
    reached: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend((at_import if module in PARSERS_ONLY else full)[module])
    return reached


def test_training_and_corpus_code_off_the_inference_path() -> None:
    graph = _graph()
    bad = _violations(graph, INFERENCE, ("train", "corpus"))
    assert not bad, "inference modules importing training or corpus code:\n" + "\n".join(bad)
    reached = _speak_path()
    loaded = sorted(m for m in reached if _top(m) in ("train", "corpus") and m not in PARSERS_ONLY)
    assert not loaded, "`vocalis speak` loads training or corpus code:\n" + "\n".join(loaded)
    assert "vocalis.tts" in reached  # the path is followed at all
