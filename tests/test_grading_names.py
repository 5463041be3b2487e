"""Every parlab internal the graders name by a string resolves: the 'module:attribute' targets of `graded(...)`,
`references(...)` and the grading modules' *_REFS tuples, and the modules and names `guard.protect` snapshots.

The graders name what they make unavailable to a student, or guard against rebinding, as strings so that importing
the grading code does not import every technique; a rename in the library would otherwise break a check only when a
student runs it (issue 39). This test reads the strings from the grading modules' source (ast) and resolves each
the way the grader does (`parlab.course.grading.unavailable._resolve`)."""
import ast
import importlib
import re
from pathlib import Path

import pytest

from parlab.course.grading import guard
from parlab.course.grading.unavailable import _resolve

GRADING = Path(importlib.import_module("parlab.course.grading").__file__).parent
TARGET = re.compile(r"^parlab(\.\w+)+:\w+(\.\w+)*$")


def _strings(path: Path) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _targets() -> list[str]:
    return sorted({s for p in GRADING.glob("*.py") for s in _strings(p) if TARGET.match(s)})


def _protected_modules() -> list[str]:
    """The module names passed to guard.protect in parlab/course/grading/__init__.py's loop and calls."""
    tree = ast.parse((GRADING / "__init__.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            names |= {e.value for e in node.iter.elts if isinstance(e, ast.Constant) and str(e.value).startswith("parlab")}
    return sorted(names)


def test_the_graders_name_their_targets_as_strings():
    assert len(_targets()) >= 40, _targets()          # a change to how targets are written would empty the list
    assert len(_protected_modules()) >= 15


@pytest.mark.parametrize("target", _targets())
def test_every_named_target_resolves(target):
    owner, attr, value = _resolve(target)
    assert value is getattr(owner, attr) and callable(value) or isinstance(value, (type, dict, tuple, float, int))


def test_every_protected_module_imports_and_every_snapshot_holds_a_value():
    for name in _protected_modules():
        importlib.import_module(name)
    assert guard.tampered() == []                      # the snapshot of each protected name is what is there now
    # guard.protect(module, names) looks each name up with getattr(..., None): a renamed torch or parlab function
    # would be snapshotted as None and guarded no more
    assert [f"{mod}.{name}" for (mod, name), obj in guard._SNAPSHOT.items() if obj is None] == []
