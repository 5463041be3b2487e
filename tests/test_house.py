"""The shape of the library, measured from its source: a package per technique, imports that run one way.

A student reads parlab after the lesson, so its shape teaches too (CONTRIBUTING.md, "Layout"). These tests read
the source with `ast` (nothing is imported but what a test names), so they are instant and say which file breaks
which rule.
"""
import ast
import functools
import importlib
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "parlab"
TECHNIQUES = ("data", "zero", "tensor", "pipeline", "context", "expert")
#: the layers of CONTRIBUTING.md, bottom first: a module may import from its own layer and the ones below
LAYERS = {"i18n": 0, "trace": 0, "models": 0, "corpus": 0, "comm": 1, "launch": 1, "parallel": 2, "cluster": 3,
          "viz": 4, "course": 5, "labs": 6, "cli": 6}
#: pure planning: no torch.distributed, no parlab module that communicates, in anything they import
PURE = ["parlab.parallel.topology", "parlab.parallel.pipeline.schedules", "parlab.parallel.pipeline.simulation",
        "parlab.parallel.pipeline.plan", "parlab.parallel.context.ring_plan", "parlab.cluster.formulas",
        "parlab.cluster.costs", "parlab.cluster.hardware", "parlab.cluster.transformer", "parlab.cluster.published",
        "parlab.trace.wire", "parlab.trace.histogram"]


def _name(p: pathlib.Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
FACES = {name: p for name, p in FILES.items() if p.name == "__init__.py"}


def _imports(name: str) -> dict[str, set[str]]:
    """{parlab module: names imported from it} for every import statement in module `name` (function bodies
    included: a lazy import is still a dependency)."""
    p = FILES[name]
    pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: dict[str, set[str]] = {}
    for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.Import):
            targets = [(a.name, "*") for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - (n.level - 1)] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else [])) if n.level else (n.module or "")
            targets = [(f"{mod}.{a.name}" if f"{mod}.{a.name}" in FILES else mod, a.name) for a in n.names]
        else:
            continue
        for t, what in targets:
            while t and t not in FILES:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name and not name.startswith(t + "."):
                out.setdefault(t, set()).add(what)
    return out


@functools.cache
def graph() -> dict[str, dict[str, set[str]]]:
    """{module: its imports} for every module of parlab (read once, by the first test that needs it, not when the
    suite is collected on every pytest worker)."""
    return {name: _imports(name) for name in FILES}


def _home(face: str, what: str) -> str:
    """The module a face takes `what` from (the face itself if it defines it)."""
    for dep, names in graph()[face].items():
        if what in names and dep.startswith(face + "."):
            return dep
    return face


def _depends(name: str) -> set[str]:
    """Modules `name` really needs: through a face, only the modules of the names it takes."""
    out = set()
    for dep, names in graph()[name].items():
        out |= {_home(dep, w) for w in names} if dep in FACES and "*" not in names else {dep}
    return out


def _layer(name: str) -> int | None:
    top = name.split(".")[1] if name.count(".") else None
    return LAYERS.get(top)


def test_no_import_cycles():
    index, low, on, stack, cycles, k = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = k[0]
        k[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph().get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = []
            while True:
                w = stack.pop()
                on.discard(w)
                c.append(w)
                if w == v:
                    break
            if len(c) > 1:
                cycles.append(sorted(c))

    for v in graph():
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_no_technique_imports_another():
    bad = []
    for name, deps in graph().items():
        mine = name.split(".")[2] if name.startswith("parlab.parallel.") and name.count(".") >= 3 else None
        if mine not in TECHNIQUES:
            continue
        for dep in deps:
            other = dep.split(".")[2] if dep.startswith("parlab.parallel.") and dep.count(".") >= 2 else None
            if other in TECHNIQUES and other != mine:
                bad.append(f"{name} imports {dep}")
    assert bad == [], "only parlab.parallel.hybrid composes techniques:\n" + "\n".join(bad)


def test_imports_run_one_way():
    bad = [f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
           for name, deps in graph().items() for dep in deps
           if _layer(name) is not None and _layer(dep) is not None and _layer(dep) > _layer(name)]
    assert bad == [], "an import runs upward (CONTRIBUTING.md, Layout):\n" + "\n".join(bad)


def test_inside_a_package_siblings_come_from_their_module():
    bad = [f"{name} imports {sorted(names)} from its own face {dep}"
           for name, deps in graph().items() for dep, names in deps.items()
           if dep in FACES and name.startswith(dep + ".") and FACES[dep] != FILES[name]
           and any(_home(dep, w) != dep for w in names)]
    assert bad == [], "\n".join(bad)


def test_the_top_of_the_package_is_small():
    top = [p.name for p in PKG.iterdir()
           if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").exists()]
    assert len(top) <= 14, f"{len(top)} entries at the top of parlab/: {sorted(top)}"


def test_modules_and_classes_stay_readable():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in FILES.values()
            if (n := len(p.read_text().splitlines())) > 400]
    big = [f"{p.relative_to(ROOT)}: class {c.name}, {c.end_lineno - c.lineno + 1} lines"
           for p in FILES.values() for c in ast.walk(ast.parse(p.read_text()))
           if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > 200]
    assert long + big == [], "split these along their seams:\n" + "\n".join(long + big)


@pytest.mark.parametrize("face", sorted(FACES))
def test_every_face_maps_its_chapter(face):
    doc = ast.get_docstring(ast.parse(FACES[face].read_text()))
    assert doc and len(doc.splitlines()) >= 3, f"{face}/__init__.py needs a docstring mapping its chapter"
    files = sorted(p.stem for p in FACES[face].parent.glob("*.py") if p.stem not in ("__init__", "__main__"))
    subpackages = sorted(p.name for p in FACES[face].parent.iterdir() if (p / "__init__.py").exists())
    if face in ("parlab.labs", "parlab.viz", "parlab.course.grading", "parlab.course.gradebook"):
        return                                  # these faces are entry points and helpers, not chapters
    missing = [f for f in files + subpackages if f not in doc]
    assert missing == [], f"{face}'s docstring does not say what {missing} implement"


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_never_reach_torch_distributed(module):
    seen, todo, path = set(), [module], {module: [module]}
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        tree = ast.parse(FILES[m].read_text())
        for n in ast.walk(tree):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            assert not any(x == "torch.distributed" or x.startswith("torch.distributed.") for x in mods), \
                f"{module} reaches torch.distributed through {' -> '.join(path[m])}"
        for dep in _depends(m):
            assert not dep.startswith(("parlab.comm", "parlab.launch")), \
                f"{module} reaches {dep} through {' -> '.join(path[m])}"
            path.setdefault(dep, path[m] + [dep])
            todo.append(dep)


def test_the_formulas_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"          # any `import torch` now fails
            "import parlab.cluster.formulas as f, parlab.trace.wire as w, parlab.cluster.transformer as t\n"
            "print(f.ring_all_reduce_bytes(100, 4), w.ring_factor('all_reduce', 4), t.BYTES_16BIT)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["150.0", "1.5", "2"]


def test_an_exercise_kernel_imports_the_graders_without_nbformat():
    """`parlab.course`'s face loads notebooks.py (and nbformat, 0.85 s for its schema validator) on first use of
    one of its names, not when a kernel imports parlab.course.grading."""
    code = ("import sys; import parlab.course.grading, parlab.course as c\n"
            "print('nbformat' in sys.modules, 'read' in dir(c), c.read.__module__, 'nbformat' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "parlab.course.notebooks", "True"]
    import parlab.course
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        parlab.course.nope


# ---------------------------------------------------------------------- old module paths
def _moved():
    from parlab import _moved
    return _moved.MOVED


@pytest.mark.parametrize("old", sorted(_moved()))
def test_an_old_module_path_is_its_new_module(old):
    new = _moved()[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[new].__spec__.name == new        # the alias did not rename the real module


def test_old_names_still_work_the_way_old_notebooks_use_them():
    import parlab
    from parlab import schedules as sch                # noqa: the old flat layout, on purpose
    from parlab.grading import pipeline as grading     # noqa
    from parlab.tensor_parallel import ColumnParallelLinear  # noqa
    import parlab.grading.guard as old_guard            # noqa
    import parlab.course.grading.guard as guard
    assert sch.simulate(sch.one_f_one_b(2, 4)).makespan > 0
    assert old_guard is guard                            # one module: the grader's snapshots see the same object
    assert grading.check_1f1b_valid is importlib.import_module("parlab.course.grading.pipeline").check_1f1b_valid
    assert ColumnParallelLinear.__module__ == "parlab.parallel.tensor.layers"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        parlab.nope
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("parlab.nope")


def test_python_m_runs_an_old_module_path():
    out = subprocess.run([sys.executable, "-m", "parlab.calibrate", "--help"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0 and "calibrate" in out.stdout, out.stderr


OLD = re.compile(r"\bparlab\.(" + "|".join(re.escape(o.split(".", 1)[1]) for o in sorted(_moved(), key=len,
                                                                                           reverse=True)) + r")\b")
OLD_FROM = re.compile(r"from parlab import ([\w ,]+)")
OLD_FILE = re.compile(r"\bparlab/(" + "|".join(re.escape(o.split(".", 1)[1].replace(".", "/")) for o in _moved())
                      + r")(\.py|/)")


def test_the_repository_uses_the_new_paths():
    """Lessons, solutions, exercises, tests, benchmarks and READMEs name every module by its new path (the old
    ones stay for students' saved notebooks only: parlab/_moved.py, the fixture of tests/notebooks/old_layout)."""
    old_modules = {o.split(".", 1)[1] for o in _moved()}
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                           cwd=ROOT).stdout.split()
    bad = []
    for f in files:
        p = ROOT / f
        if p.suffix not in (".py", ".ipynb", ".md") or not p.exists() or f.startswith("tests/notebooks/old_layout/") \
                or f in ("parlab/_moved.py", "tests/test_house.py"):
            continue
        text = p.read_text()
        if p.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        for i, line in enumerate(text.splitlines(), 1):
            m = OLD.search(line)
            names = {x.strip().split(" ")[0] for m2 in OLD_FROM.finditer(line) for x in m2.group(1).split(",")}
            if (m and not line.lstrip().startswith("#")) or names & old_modules or OLD_FILE.search(line):
                bad.append(f"{f}:{i}: {line.strip()[:100]}")
    assert bad == [], "old module paths in the repository's own files:\n" + "\n".join(bad[:30])


def test_no_notebook_cell_imports_a_line_twice():
    """A student reads the import cell first (lesson 02 once imported two names twice)."""
    twice = []
    for path in sorted(ROOT.glob("lessons/*.ipynb")) + sorted(ROOT.glob("exercises/**/*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            lines = [ln for ln in "".join(cell["source"]).splitlines() if ln.startswith(("import ", "from "))]
            twice += [f"{path.relative_to(ROOT)}: {ln[:80]}" for ln in dict.fromkeys(lines) if lines.count(ln) > 1]
    assert twice == []


def test_every_data_file_of_the_package_is_installed():
    """A file of parlab/ that is not Python (figcheck's check.js) ships only if pyproject.toml's package-data names
    it: an editable install finds it anyway, a wheel would not."""
    import fnmatch
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = subprocess.run(["git", "ls-files", "parlab"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    missing = []
    for f in files:
        p = pathlib.PurePosixPath(f)
        if p.suffix == ".py" or fnmatch.fnmatch(p.name, "README*.md"):
            continue
        # a glob of a package above the file's folder names it by its path from there (locale/*/LC_MESSAGES/*.po)
        owners = [(".".join(p.parts[:k]), str(pathlib.PurePosixPath(*p.parts[k:]))) for k in range(1, len(p.parts))]
        if not any(fnmatch.fnmatch(rel, g) for package, rel in owners for g in data.get(package, [])):
            missing.append(f)
    assert missing == [], f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
