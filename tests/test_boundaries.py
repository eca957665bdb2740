"""The package map's one-way arrows (docs/architecture.md), checked on every import statement in the tree.

    launch ──▶ tools ──▶ engine ◀── data_tools (only the .bin/.idx format and the atomic-write helper)
       └──────────────────────────────▶ data_tools

Lazy imports inside functions count as much as module-level ones: they fail the same way when the
layer below is installed without the one above.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("engine", "data_tools", "launch", "tools")
# What each layer must not import; None means the whole layer.
FORBIDDEN = {
    "engine": {"launch": None, "tools": None, "data_tools": None},
    "data_tools": {"launch": None, "tools": None},
    "tools": {"launch": None},
    "launch": {},
}
DATA_TOOLS_MAY_USE_FROM_ENGINE = {"loom.engine.data.indexed", "loom.engine.data.tokenizer_json", "loom.engine.atomic"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    return "loom." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources() -> dict[str, str]:
    return {
        module_name(path): path.read_text() for layer in LAYERS for path in sorted((PACKAGE_ROOT / layer).rglob("*.py"))
    }


def imported_modules(name: str, source: str, known: set[str]) -> set[str]:
    """Every loom module `source` imports, at any depth of the file; `from pkg import module` names the module."""
    is_package = any(other.startswith(name + ".") for other in known)  # relative imports start from it, not its parent
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known}
    return {module for module in found if module == "loom" or module.startswith("loom.")}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def boundary_violations(sources: dict[str, str]) -> list[str]:
    known = set(sources)
    problems = []
    for name, source in sources.items():
        layer = layer_of(name)
        for target in sorted(imported_modules(name, source, known)):
            target_layer = layer_of(target)
            if target_layer in FORBIDDEN.get(layer, {}):
                problems.append(f"{name} imports {target}: {layer} must not import {target_layer}")
            elif layer == "data_tools" and target_layer == "engine":
                if not any(
                    target == allowed or target.startswith(allowed + ".") for allowed in DATA_TOOLS_MAY_USE_FROM_ENGINE
                ):
                    problems.append(
                        f"{name} imports {target}: data_tools may use only {DATA_TOOLS_MAY_USE_FROM_ENGINE}"
                    )
    return problems


def import_cycles(sources: dict[str, str], within: str) -> list[list[str]]:
    """Strongly connected groups of more than one module inside one layer (Tarjan's algorithm)."""
    known = set(sources)
    members = [name for name in sources if layer_of(name) == within]
    edges = {name: sorted(imported_modules(name, sources[name], known) & set(members) - {name}) for name in members}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in edges[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in members:
        if name not in index:
            visit(name)
    return cycles


def test_every_layer_imports_only_what_the_package_map_allows():
    assert boundary_violations(package_sources()) == []


@pytest.mark.parametrize(
    "module, line, complaint",
    [
        ("loom.engine.train", "from loom.launch.local import launch_local", "engine must not import launch"),
        ("loom.engine.model.gpt", "    from loom.tools import ckpt", "engine must not import tools"),
        ("loom.engine.flops", "import loom.data_tools.jsonl", "engine must not import data_tools"),
        ("loom.tools.hf", "from loom.launch import cli", "tools must not import launch"),
        ("loom.data_tools.build", "from loom.engine.train import Trainer", "data_tools may use only"),
        ("loom.data_tools.clean", "from ..tools import ckpt", "data_tools must not import tools"),
    ],
)
def test_an_added_forbidden_import_is_caught(module, line, complaint):
    sources = package_sources()
    sources[module] += f"\n\ndef _added():\n{line if line.startswith(' ') else '    ' + line}\n"
    problems = boundary_violations(sources)
    assert problems and all(complaint in problem and module in problem for problem in problems), problems


def test_data_tools_filters_and_their_registry_form_no_import_cycle():
    sources = package_sources()
    assert import_cycles(sources, "data_tools") == []
    sources["loom.data_tools.quality_filters"] += "\nfrom loom.data_tools.pipeline import step_types\n"
    (cycle,) = import_cycles(sources, "data_tools")
    assert {"loom.data_tools.pipeline", "loom.data_tools.quality_filters"} <= set(cycle)


def test_data_tools_import_without_torch():
    names = [name for name in package_sources() if layer_of(name) == "data_tools"]
    probe = "import sys\n" + "".join(f"import {name}\n" for name in names) + "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
