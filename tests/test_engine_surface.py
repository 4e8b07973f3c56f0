"""Modules outside ``twophase/core`` use the engine through its public methods (``prepare``,
``add_request``, ``step_with_record``, ``stats``, ``step_records``, ``reset_stats``, ``limits``,
``prefill_logits``, ``schedule_batch``...), never through its parts: no read of
``.scheduler``, ``.kv``, ``.steps`` or ``.executor`` on an engine, so the parts can change
behind the methods.

The check is a plain reading of the source, not a type check: an engine is an expression
``X.engine``, a name ``engine`` or ``eng``, a name assigned one of those (``e = llm.engine``),
or the loop variable over a list of them (``for e in [m.engine for m in members]``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "twophase"

PARTS = {"scheduler", "kv", "steps", "executor"}
ENGINE_NAMES = {"engine", "eng"}

# modules still to be switched to the engine's methods (paths under ROOT's parent); empty it
# once each is
NOT_YET_SWITCHED = {"twophase/llm.py"}


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


def violations(root: Path = ROOT) -> list[str]:
    """``path:line: expression`` for every module under ``root`` outside ``core`` (and outside
    ``NOT_YET_SWITCHED``) that reaches into an engine."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if path.relative_to(root).parts[0] == "core" or rel in NOT_YET_SWITCHED:
            continue
        out += [f"{rel}:{line}: {expr}" for line, expr in reach_ins(path.read_text(), str(path))]
    return out


def test_no_module_outside_core_reads_the_engines_parts():
    found = violations()
    assert not found, ("modules outside twophase/core read the engine's scheduler, KV manager, "
                       "step log or executor; use an Engine method (stats(), step_records(), "
                       "step_with_record(), prepare(), limits, prefill_logits(), ...) or add one:\n"
                       + "\n".join(found))


def test_each_module_not_yet_switched_still_reaches_in():
    """An entry of ``NOT_YET_SWITCHED`` that no longer reaches in is stale: remove it."""
    for rel in sorted(NOT_YET_SWITCHED):
        path = ROOT.parent / rel
        assert path.is_file(), f"{rel} does not exist: remove it from NOT_YET_SWITCHED"
        assert reach_ins(path.read_text(), str(path)), \
            f"{rel} no longer reads the engine's parts: remove it from NOT_YET_SWITCHED"


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
    found = violations(root)
    assert [f.split(":")[1] for f in found] == ["2", "3", "5", "7", "9"], found
    assert all(f.startswith("twophase/server/planted.py:") for f in found), found
