"""The layers import one way (docs/ARCHITECTURE.md): the scheduler, the core loop and the whole server import
without torch; the server names only the engine's public surface (engine/__init__.py); no project modules import
each other in a circle, type-only imports (under TYPE_CHECKING) included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "server", "voicelane_wire", "voicelane_client", "client_demo", "bench")

# Circles nobody has cut yet, each with why. The test fails when one is cut (drop it here) or a new one appears.
# (engine.kernels.attention <-> engine.model.layers was cut by engine/model/attention_ops.py.)
KNOWN_CYCLES: set[frozenset[str]] = set()

BLOCK_TORCH = """
import importlib, sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ImportError("torch is blocked in this test: " + name)
sys.meta_path.insert(0, BlockTorch())
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


ALL = {name: path for package in PACKAGES for name, path in modules(package).items()}


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in the file, relative ones made absolute; function bodies and
    TYPE_CHECKING blocks included."""
    out = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
            out.append((base if node.level else node.module, [a.name for a in node.names]))
    return out


def project_module(name: str) -> str | None:
    while name and name not in ALL:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in ALL.items():
        deps = set()
        for module, names in imports(name, path):
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in ALL] or [module]:
                found = project_module(target)
                if found and found != name:
                    deps.add(found)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_scheduler_core_and_server_import_without_torch():
    names = ["engine", "engine.scheduler", "engine.core", "voicelane_wire", *modules("server")]
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *names], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_blocker_does_block_torch():
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "engine.engine"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "torch is blocked" in r.stderr


def test_server_imports_only_the_engines_public_names():
    import engine

    public = set(engine.__all__)
    offenders = []
    for name, path in modules("server").items():
        for module, names in imports(name, path):
            if module == "engine" and set(names) <= public:
                continue
            if module == "engine" or module.startswith("engine."):
                offenders.append(f"{path.relative_to(ROOT)}: {module} {names}")
    assert not offenders, offenders


def test_server_never_imports_torch():
    """Not even inside a function (server/cli.py included): what needs torch, the engine's public names do."""
    offenders = [f"{path.relative_to(ROOT)}: {module}" for name, path in modules("server").items()
                 for module, _ in imports(name, path) if module.split(".")[0] in ("torch", "triton")]
    assert not offenders, offenders


def test_every_public_name_exists():
    import engine

    missing = [n for n in engine.__all__ if n not in ("Engine", "EngineContext") and not hasattr(engine, n)]
    assert not missing


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), "new import cycles"
    assert KNOWN_CYCLES - found == set(), "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
