"""The package's layers: a module may import its own layer and the ones below, never above; and no
two modules import each other, even through others or inside a function.

Lowest first. Every module is in a named layer (a package's name covers its modules; the root
package ``twophase`` is named alone and covers nothing else). Imports under ``if TYPE_CHECKING:``
are annotations only and are not counted; every other import is, at module level or inside a
function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "twophase"

LAYERS = [
    ["twophase.errors", "twophase.paths", "twophase.device", "twophase.data",
     "twophase.large_pages", "twophase.measure.machine",
     "twophase.measure.thread_governor"],                           # machine facts, errors, memory
    ["twophase.arch", "twophase.formats", "twophase.kv_formats", "twophase.contract",
     "twophase.backends.hookspecs"],                                # the plugin contract
    ["twophase.cache"],                                             # cache specs and the pool layout
    ["twophase.structured"],                                        # grammars the sampler applies
    ["twophase.core"],                                              # scheduling, KV, sampling
    ["twophase.models", "twophase.graph", "twophase.lora"],         # the model; graph signature; adapters
    ["twophase.config"],                                            # the TOML schema (above the model)
    ["twophase.exporters"],                                         # build artefacts offline
    ["twophase.backends"],                                          # runtimes (and the registry)
    ["twophase.llm", "twophase.builder", "twophase.measure", "twophase.plan"],   # the Python API, its load, memory
    ["twophase.server", "twophase.cluster", "twophase.bench", "twophase.simulate", "twophase.cli",
     "twophase.testing", "twophase.__main__", "twophase"],         # front ends; the package itself
]

# imports a layer must never make, whatever the order above becomes
FORBIDDEN = {"twophase.models": ["twophase.config"]}     # the loaders take a ModelSource value


def _covers(name: str, module: str, root: str = ROOT.name) -> bool:
    return module == name or (name != root and module.startswith(name + "."))


def layer(module: str) -> int:
    """The layer of the longest name in LAYERS that covers ``module``."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if _covers(name, module) and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _annotation_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    return skip


def runtime_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``root``'s package outside ``if TYPE_CHECKING:``
    blocks, at module level or in a function (``from a import b`` names ``a.b`` where that is a
    module). Relative imports are resolved against ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _annotation_only(tree)
    pkg = root.name
    me = module_name(path, root) if path.is_relative_to(root) else pkg
    here = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            elif node.module:
                base = node.module
            else:
                continue
            out += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base)
                    for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m == pkg or m.startswith(pkg + ".")]


def _is_module(name: str, root: Path = ROOT) -> bool:
    rel = Path(*name.split("."))
    return (root.parent / rel).with_suffix(".py").exists() or (root.parent / rel / "__init__.py").exists()


def violations(me: str, imports: list[tuple[int, str]]) -> list[str]:
    """What of ``imports`` (made by module ``me``) the layers or FORBIDDEN refuse."""
    mine = layer(me)
    bad = [f"line {line}: {m} (layer {layer(m)}, above {mine})" for line, m in imports if layer(m) > mine]
    for src, targets in FORBIDDEN.items():
        if _covers(src, me):
            bad += [f"line {line}: {m} ({src} never imports {t})" for line, m in imports
                    for t in targets if _covers(t, m)]
    return bad


SOURCES = sorted(ROOT.rglob("*.py"))


def unlisted(root: Path) -> list[str]:
    """The modules of ``root``'s package that no layer names."""
    out = []
    for path in sorted(root.rglob("*.py")):
        try:
            layer(module_name(path, root))
        except AssertionError:
            out.append(module_name(path, root))
    return out


def test_every_module_is_in_a_named_layer() -> None:
    missing = unlisted(ROOT)
    assert not missing, f"in no layer (add them to LAYERS): {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    me = module_name(path)
    bad = violations(me, runtime_imports(path))
    assert not bad, f"{me} (layer {layer(me)}) imports what it may not: " + "; ".join(bad)


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
    assert violations("twophase.core.engine", found) == ["line 5: twophase.server.app (layer 10, above 4)"]


def test_the_model_never_reads_the_config(tmp_path: Path) -> None:
    """``twophase.models`` importing ``twophase.config``, even inside a function, is refused."""
    assert layer("twophase.config") > layer("twophase.models.loader")
    src = tmp_path / "loader.py"
    src.write_text("def resolve(cfg):\n    from twophase.config import ModelConfig\n")
    bad = violations("twophase.models.loader", runtime_imports(src))
    assert bad and all("twophase.config" in b for b in bad)


def test_an_unlisted_module_is_caught(tmp_path: Path) -> None:
    """No catch-all: a new top-level module or package is in no layer until it is named; the root
    package's name covers the root package alone."""
    assert layer("twophase") == len(LAYERS) - 1
    assert layer("twophase.core.scheduler") == layer("twophase.core")
    for name in ("twophase.newthing", "twophase.newpackage.mod", "twophasex"):
        with pytest.raises(AssertionError, match="is in no layer"):
            layer(name)
    pkg = tmp_path / "twophase"
    for name in ("__init__.py", "__main__.py", "llm.py", "core/engine.py", "newthing.py", "newpackage/__init__.py",
                 "newpackage/mod.py"):
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text("")
    assert unlisted(pkg) == ["twophase.newpackage", "twophase.newpackage.mod", "twophase.newthing"]


# -- cycles ----------------------------------------------------------------------------------
def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the modules of ``root``'s package, counting
    every import but annotations (``from a import name`` counts as importing ``a``, or ``a.name``
    where that is a module; a module's parent packages are not counted)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for me, path in modules.items():
        edges = graph.setdefault(me, {})
        for line, target in runtime_imports(path, root):
            while target and target not in modules:          # a name in a module: that module
                target = target.rpartition(".")[0]
            if target and target != me:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each group of modules that import one another (strongly connected, two or more), as one
    cycle through it: ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, g) for g in sorted(groups)]


def _a_cycle(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start, inside = group[0], set(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in inside and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {group}")


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycles() -> None:
    """No module imports one that imports it back (directly or through others), not even inside
    a function: cut a cycle by moving what both need below both, or by passing it in."""
    graph = import_graph(ROOT)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_cycle_check_sees_a_planted_cycle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them inside a function, are caught (and so is
    a longer cycle); a cycle closed only by annotations is not."""
    pkg = tmp_path / "twophase"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from twophase import b\n    return b\n",
        "b.py": "from twophase.a import f\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from twophase.d import D\n",
        "d.py": "from twophase.c import *\nclass D: ...\n",
        "sub/__init__.py": "",
        "sub/x.py": "from .y import g\n",
        "sub/y.py": "import twophase.sub.z\ndef g(): ...\n",
        "sub/z.py": "def h():\n    from twophase.sub.x import g\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["twophase.a"] == {"twophase.b": 2} and graph["twophase.b"] == {"twophase.a": 1}
    assert graph["twophase.c"] == {}
    assert cycles(graph) == [["twophase.a", "twophase.b", "twophase.a"],
                             ["twophase.sub.x", "twophase.sub.y", "twophase.sub.z", "twophase.sub.x"]]
    assert _describe(graph, cycles(graph)[0]) == \
        "twophase.a (line 2) -> twophase.b (line 1) -> twophase.a"


# -- the engine's parts stay behind its methods --------------------------------------------
# Modules outside ``twophase/core`` use the engine through its public methods (``prepare``,
# ``add_request``, ``step_with_record``, ``stats``, ``step_records``, ``reset_stats``, ``limits``,
# ``prefill_logits``, ``schedule_batch``...), never through its parts: no read of
# ``.scheduler``, ``.kv``, ``.steps`` or ``.executor`` on an engine, so the parts can change
# behind the methods.
#
# The check is a plain reading of the source, not a type check: an engine is an expression
# ``X.engine``, a name ``engine`` or ``eng``, a name assigned one of those (``e = llm.engine``),
# or the loop variable over a list of them (``for e in [m.engine for m in members]``).

PARTS = {"scheduler", "kv", "steps", "executor"}
ENGINE_NAMES = {"engine", "eng"}

def _is_engine(node: ast.AST, engines: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "engine") or \
        (isinstance(node, ast.Name) and node.id in engines)


def _is_engine_list(node: ast.AST, engines: set[str], lists: set[str]) -> bool:
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return _is_engine(node.elt, engines)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return any(_is_engine(e, engines) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in lists


def _bindings(tree: ast.AST) -> list[tuple[ast.AST, ast.AST, bool]]:
    """``(target, value, iterated)`` of every plain binding: assignments (tuples paired
    element by element), and the targets of ``for`` loops and comprehensions."""
    out: list[tuple[ast.AST, ast.AST, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            pairs = [(node.target, node.value)]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            out.append((node.target, node.iter, True))
            continue
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                out += [(t, v, False) for t, v in zip(target.elts, value.elts)]
            else:
                out.append((target, value, False))
    return out


def engine_names(tree: ast.AST) -> set[str]:
    """The names that hold an engine anywhere in the module (one scope: a pragmatic reading)."""
    engines, lists = set(ENGINE_NAMES), set()
    bindings = [(t.id, v, it) for t, v, it in _bindings(tree) if isinstance(t, ast.Name)]
    while True:
        before = len(engines) + len(lists)
        for name, value, iterated in bindings:
            if iterated and _is_engine_list(value, engines, lists):
                engines.add(name)
            elif not iterated and _is_engine(value, engines):
                engines.add(name)
            elif not iterated and _is_engine_list(value, engines, lists):
                lists.add(name)
        if len(engines) + len(lists) == before:
            return engines


def reach_ins(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """``(line, expression)`` of every read of an engine's parts in ``source``."""
    tree = ast.parse(source, filename)
    engines = engine_names(tree)
    found = {(n.lineno, ast.unparse(n)) for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr in PARTS and _is_engine(n.value, engines)}
    return sorted(found)


def engine_violations(root: Path = ROOT) -> list[str]:
    """``path:line: expression`` for every module under ``root`` outside ``core`` that reaches
    into an engine."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if path.relative_to(root).parts[0] == "core":
            continue
        out += [f"{rel}:{line}: {expr}" for line, expr in reach_ins(path.read_text(), str(path))]
    return out


def test_no_module_outside_core_reads_the_engines_parts():
    found = engine_violations()
    assert not found, ("modules outside twophase/core read the engine's scheduler, KV manager, "
                       "step log or executor; use an Engine method (stats(), step_records(), "
                       "step_with_record(), prepare(), limits, prefill_logits(), ...) or add one:\n"
                       + "\n".join(found))


PLANTED = '''\
def serve(llm, members, engine):
    engine.kv.num_free_blocks                      # 2: a parameter named engine
    llm.engine.scheduler.running                   # 3: X.engine
    eng = llm.engine
    eng.steps.records                              # 5: an alias
    e = members[0].llm.engine
    e.executor.prefill_backend                     # 7: an alias of any name
    engines = [m.llm.engine for m in members]
    return sum(len(x.scheduler.waiting) for x in engines)   # 9: over a list of engines


def fine(cfg, backend, llm):
    cfg.scheduler.max_num_seqs                     # a config section, not an engine
    backend.kv                                     # a backend's own pool
    llm.engine.stats().used_blocks                 # the engine's method
'''


def test_the_check_finds_a_planted_reach_in(tmp_path):
    root = tmp_path / "twophase"
    (root / "core").mkdir(parents=True)
    (root / "server").mkdir()
    (root / "server" / "planted.py").write_text(PLANTED)
    (root / "core" / "inside.py").write_text(PLANTED)        # core may read its own parts
    found = engine_violations(root)
    assert [f.split(":")[1] for f in found] == ["2", "3", "5", "7", "9"], found
    assert all(f.startswith("twophase/server/planted.py:") for f in found), found


# -- a backend's claim of features is a list of names -----------------------------------------
def test_no_backend_module_reads_the_list_of_all_features():
    """A claim is a literal set: no module of ``twophase.backends`` reads ``twophase.arch.FEATURES``
    or a set built from it elsewhere (a name ending in ``FEATURES`` imported from outside)."""
    root = ROOT / "backends"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root.parent.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr == "FEATURES":
                found.append(f"{where}: .FEATURES")
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("twophase.backends"):
                found += [f"{where}: {node.module}.{a.name}" for a in node.names if a.name.endswith("FEATURES")]
    assert not found, "backend modules that derive a claim from a list of all features: " + ", ".join(found)
