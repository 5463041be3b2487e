"""The library a cluster user installs (pyproject.toml's dependencies) runs without the course's packages: the
techniques, parlab.run, parlab plan and grid import none of JupyterLab, plotly, nbformat or pytest, and the course
commands say which extra to install instead of failing inside an import."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COURSE_ONLY = ["jupyterlab", "ipywidgets", "plotly", "nbval", "nbformat", "nbconvert", "nbclient", "playwright",
               "jupyter_server", "pytest", "xdist"]

# a meta path finder that refuses every course-only package, as an environment without them would
BLOCK = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {COURSE_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_core_dependencies_leave_the_course_and_the_tests_to_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in project["dependencies"]}
    assert core == {"torch", "numpy", "cloudpickle", "babel", "tqdm"}
    extras = project["optional-dependencies"]
    assert {"jupyterlab", "plotly>=5", "nbval"} <= set(extras["course"]) and "pytest" in extras["test"]
    assert "parlab[course]" in extras["test"]


def test_the_library_runs_ranks_and_plans_without_the_course_packages():
    out = _run("""
import parlab, torch
from parlab import comm
import parlab.parallel.data, parlab.parallel.zero, parlab.parallel.tensor, parlab.parallel.pipeline
import parlab.parallel.context, parlab.parallel.expert, parlab.parallel.hybrid, parlab.labs, parlab.cluster.planner

def work():
    x = torch.ones(2) * (comm.get_rank() + 1)
    comm.all_reduce(x)
    return x.tolist()

print(parlab.run(work, 2, echo=False).results)
from parlab.cli import main
assert main(["plan", "--model", "llama-7b", "--nodes", "1", "--top", "1"]) == 0
assert main(["grid", "--world", "8", "--tp", "2"]) == 0
""")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[[3.0, 3.0], [3.0, 3.0]]" in out.stdout


def test_the_course_commands_name_the_extra_to_install_when_its_packages_are_missing():
    for command in ("course open --no-browser", "grade submissions"):
        out = _run(f"from parlab.cli import main; raise SystemExit(main({command.split()!r}))")
        assert out.returncode == 2, out.stderr[-2000:]
        assert "pip install 'parlab[course]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_every_package_the_library_imports_is_a_core_dependency():
    # a static check of what the ranks, labs and cluster tools import (a lab's progress bar once needed tqdm, which
    # the core did not list: every lab failed in a fresh install); the course's own modules may use the extra
    import ast
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in project["dependencies"]}
    course_side = ("parlab/course/", "parlab/viz/", "parlab/i18n/notebooks.py", "parlab/i18n/review.py")
    found = {}
    for path in sorted((ROOT / "parlab").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(course_side):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "parlab":
                    found.setdefault(top, rel)
    assert set(found) <= core, {k: v for k, v in found.items() if k not in core}


def test_a_plotly_figure_in_a_notebook_does_not_pay_for_the_iri_grammars_and_iri_checks_still_answer():
    """`parlab._deferred_imports`: after ``import parlab``, plotly's renderers (nbformat, jsonschema) load without
    rfc3987-syntax building its 38 grammars (about 2 s of CPU in every kernel), and jsonschema's IRI check, the
    one user of those grammars, gives the same answers as without parlab (the real module loads on that call)."""
    probe = """
import sys
{first}
import plotly.io as pio
pio.renderers.default = "plotly_mimetype+notebook"
built = "rfc3987_syntax.syntax_helpers" in sys.modules
from jsonschema import FormatChecker
check = FormatChecker()
print(built, [check.conforms(v, "iri") for v in ("http://a/b c", "http://例子.com/路径", "no scheme")],
      "rfc3987_syntax.syntax_helpers" in sys.modules)
"""
    outs = [subprocess.run([sys.executable, "-c", probe.format(first=first)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300) for first in ("import parlab", "")]
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    with_parlab, without = (o.stdout.split(" ", 1) for o in outs)
    assert (with_parlab[0], without[0]) == ("False", "True")        # deferred with parlab, built at import without
    assert with_parlab[1] == without[1] and "[False, True, False] True" in with_parlab[1]
