"""The package's layers: a module may import its own layer and the ones below, never above.

Lowest first. Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "twophase"

LAYERS = [
    ["twophase.errors", "twophase.paths", "twophase.device"],       # machine facts, errors
    ["twophase.backends.base", "twophase.backends.hookspecs"],     # the plugin contract
    ["twophase.core"],                                              # scheduling, KV, sampling
    ["twophase.config"],
    ["twophase.models", "twophase.graph"],                          # the model; graph signature, inputs
    ["twophase.exporters"],                                         # build artefacts offline
    ["twophase.backends"],                                          # runtimes (and the registry)
    ["twophase.llm", "twophase.draft", "twophase.quality", "twophase.workload", "twophase.plan",
     "twophase.routing", "twophase.phase_timing"],                  # the Python API, its memory and routing
    ["twophase.server", "twophase.bench", "twophase.cli", "twophase.flags", "twophase.chat",
     "twophase.cache_contents", "twophase.testing", "twophase.__main__",
     "twophase"],                                                   # front ends
]


def layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` that LAYERS names."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every twophase import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            out += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
                    for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m == "twophase" or m.startswith("twophase.")]


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    me = module_name(path)
    mine = layer(me)
    bad = [f"line {line}: {m} (layer {layer(m)})" for line, m in runtime_imports(path)
           if layer(m) > mine]
    assert not bad, f"{me} (layer {mine}) imports a higher layer: " + "; ".join(bad)


def test_the_check_sees_a_violation_and_skips_annotations(tmp_path: Path) -> None:
    """The check itself can fail: a core module importing the server at run time is caught;
    the same import for annotations only is not."""
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from twophase.llm import LLM\n"
                   "def f():\n    from twophase.server import app\n")
    found = runtime_imports(src)
    assert found == [(5, "twophase.server.app")]
    assert layer("twophase.server.app") > layer("twophase.core.engine")
