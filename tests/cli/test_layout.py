"""The package's layout: no import cycles between its parts, and the light commands stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nextoken"


def part_of(module: str) -> str:
    """``nextoken.engine.scheduler`` -> ``engine``; ``nextoken.cli`` -> ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, dict[str, str]]:
    """part -> {imported part: "file imports module"}, for every import in the package, at the
    top of a file or inside a function alike."""
    graph: dict[str, dict[str, str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module == "nextoken":  # the lazy top-level names; no imports of its own
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("nextoken.") and part_of(name) != part_of(module):
                    graph.setdefault(part_of(module), {})[part_of(name)] = f"{module} imports {name}"
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of the graph as a list of edges' descriptions, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                return [graph[a][b] for a, b in zip(loop, loop[1:])]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in list(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles_between_parts():
    assert find_cycle(import_graph()) is None, find_cycle(import_graph())


# Each part's layer, lowest first: a part imports only parts of its own layer or below (within a
# layer the cycle test above keeps the imports one-way). A new part must be placed here.
LAYERS = [
    {"errors", "config", "catalog", "structured", "tokenizer", "bodies", "sampling_params", "request_options", "outputs",
     "cli_args", "engine_args", "sampling_defaults"},  # values and formats: no model, no engine
    {"kernels", "kv_cache", "sample"},  # the C kernels, the KV cache's bookkeeping, the sampler
    {"layers"},  # PyTorch layers over the kernels
    {"models", "loader", "distributed"},  # architectures, reading checkpoints, process groups
    {"runner", "trace", "beam", "evaluate", "embedding", "lora"},  # one forward pass; adapters; what runs over the
    # engine's outputs
    {"spec_decode"},  # speculative decoding over runners
    {"engine"},  # requests, scheduling, the step
    {"llm", "inspect"},  # the Python API; the inspector's numbers
    {"server", "bench"},  # HTTP, benchmarks
    {"cli", "__main__"},  # the command line
]


def test_no_part_imports_a_higher_layer():
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    graph = import_graph()
    parts = set(graph) | {p for deps in graph.values() for p in deps}
    assert not parts - set(level), f"place these parts in LAYERS: {sorted(parts - set(level))}"
    upward = [why for src, deps in graph.items() for dst, why in deps.items() if level[dst] > level[src]]
    assert not upward, upward


def test_only_the_command_line_imports_the_bench_harness():
    """`nextoken bench` is a tool over the engine, not part of it: the core never imports it."""
    graph = import_graph()
    users = sorted(src for src, deps in graph.items() if "bench" in deps)
    assert users == ["cli"], users


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b": "a->b"}, "b": {"c": "b->c"}, "c": {"a": "c->a"}}) == ["a->b", "b->c", "c->a"]
    assert find_cycle({"a": {"b": "a->b"}, "b": {}}) is None


@pytest.mark.subprocess
def test_models_and_help_do_not_import_torch():
    code = ("import sys, contextlib, io\n"
            "from nextoken.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['models'])\n"
            "    for argv in (['--help'], ['run', '--help'], ['serve', '--help'], ['bench', '--help']):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _private_reaches() -> list[str]:
    """Imports of a private name from another part, and (in the inspector) attribute reads of a
    private name on anything but ``self``/``cls``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nextoken") \
                    and part_of(node.module) != part_of(module):
                found += [f"{module} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if part_of(module) == "inspect" and isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{module} reads .{node.attr}")
    return found


def test_no_private_name_crosses_a_part():
    assert not _private_reaches(), _private_reaches()


# The server's packages, lowest first: what every API builds on, the chat core, the APIs, the
# app over them, and the launch (the same rule as `LAYERS`, one level down).
SERVER_LAYERS = [{"api", "args"}, {"chat"}, {"openai", "anthropic", "ollama", "pooling"}, {"app"},
                 {"serve", "replicas", "batch"}, {"api_servers"}]


def test_the_servers_packages_import_downward():
    """`server/`'s packages show its architecture: nothing in `api/` knows the chat core or an
    API, the chat core knows no API, no API knows the app that serves it (within a layer, one
    way only: Ollama's embedding routes use the pooling package's service)."""
    level = {part: i for i, layer in enumerate(SERVER_LAYERS) for part in layer}
    edges: dict[str, dict[str, str]] = {}
    for path in (PACKAGE / "server").rglob("*.py"):
        rel = path.relative_to(PACKAGE / "server").with_suffix("")
        if rel.parts == ("__init__",):
            continue
        src = rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("nextoken.server.") and name.split(".")[2] != src:
                    edges.setdefault(src, {})[name.split(".")[2]] = f"{'/'.join(rel.parts)} imports {name}"
    parts = set(edges) | {p for deps in edges.values() for p in deps}
    assert not parts - set(level), f"place these in SERVER_LAYERS: {sorted(parts - set(level))}"
    upward = [why for src, deps in edges.items() for dst, why in deps.items() if level[dst] > level[src]]
    assert not upward, upward
    assert find_cycle(edges) is None, find_cycle(edges)


def test_the_slowest_first_list_names_test_modules_that_exist():
    """tests/conftest.py's `SLOWEST_FIRST` (the order pytest-xdist hands files out in) names test
    modules that exist: a renamed one would silently fall back to the end."""
    from tests.conftest import SLOWEST_FIRST

    root = PACKAGE.parent
    assert all((root / name).is_file() for name in SLOWEST_FIRST), SLOWEST_FIRST
