"""Look at every figure of the course the way a student does: drawn by plotly.js in a real browser.

    python -m parlab.course.figcheck                        # every lesson: execute, draw, check, screenshot
    python -m parlab.course.figcheck lessons/05_*.ipynb --out figcheck --jobs 2

Each notebook is executed (unless it already carries outputs) in a fresh kernel (`parlab.course.execute`);
every plotly figure it shows, in a cell's output or inside an interactive widget's output in its initial
state, is drawn in headless Chromium (Debian's ``chromium`` package, driven by playwright) at the width of
a JupyterLab notebook, and `check.js` measures from the drawn page:

* no two text boxes overlap: the title, subplot titles and other annotations, axis titles, the legend,
  slider and buttons, and tick labels against all of these;
* no text is cut off at the figure's edge;
* every axis range lies within the data's (with half the data's span of margin; the data include shapes
  and annotations placed on that axis), so no marker stretches an axis to 10^70;
* no legend entry is listed twice, no two entries look alike (same colour and swatch shape), and the legend
  fits the figure's height (a legend that scrolls hides its last entries on a slide);
* no log axis labels a minor tick with a single digit (plotly writes 20 as "2" between 10 and 100);
* no text is smaller than 10 px (plotly shrinks bar labels to fit; ``<sup>`` is 70% of its font);
* an animation (``parlab.viz.comm_animation``) has at least as many frames as its calls' algorithms have
  steps, and its frames are checked too (first, last and the one with the longest heading);
* no text lies under plotly's toolbar (the modebar, shown at the top right while the mouse is over a figure;
  the screenshots do not show it);
* no bar label is crossed by a bar or shape drawn after it (an outline's edge through the number);
* every ipywidgets description fits its 80 px label box (longer ones are cut to "microbatc...");
* every character of a figure's text has a glyph in an installed font (`missing_glyphs`): without a CJK font
  a Chinese title is drawn as empty boxes, which no layout check sees.

A PNG of every figure is written to ``OUT/<notebook>/cell<NN>_<k>.png`` for a person to look through
(``screenshots=False`` skips them: 94 lesson figures, 6 of the check's 20 CPU seconds; the tests, which read the
measurements and not the pictures, do), the problems to ``OUT/report.txt``, and every figure's name, drawn height
and problems to ``OUT/figures.json``; the exit status is 1 when there are any problems.

The figures are drawn offline (plotly.js from the plotly package); nothing is fetched from a network.
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from parlab.course.figpage import (CHROMIUM_ARGS, WIDTH, Browser, Figure, check_pages, chromium_path,
                                   missing_glyphs)
from parlab.i18n.args import ArgumentParser

__all__ = ["Figure", "collect", "check_pages", "Browser", "main", "CHROMIUM_ARGS", "chromium_path", "missing_glyphs"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _widget_state(nb) -> dict:
    return nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def _widget_children(state: dict, model_id: str, seen=None) -> list[str]:
    """Every model reachable from `model_id` (children, outputs' widgets, style), depth first."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    out = [model_id]

    def refs(v):
        if isinstance(v, str) and v.startswith("IPY_MODEL_"):
            yield v[len("IPY_MODEL_"):]
        elif isinstance(v, list):
            for x in v:
                yield from refs(x)
        elif isinstance(v, dict):
            for x in v.values():
                yield from refs(x)

    for v in state[model_id]["state"].values():
        for ref in refs(v):
            out += _widget_children(state, ref, seen)
    return out


def collect(nb, notebook: str) -> tuple[list[Figure], list[dict]]:
    """The plotly figures an executed notebook shows (cell outputs, and widgets' outputs in their initial state)
    and the widget descriptions it shows ([{"notebook", "cell", "description", "width"}])."""
    figs, labels = [], []
    state = _widget_state(nb)
    for i, cell in enumerate(nb.cells):
        k = 0
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                figs.append(Figure(notebook, i, k, data[PLOTLY_MIME]))
                k += 1
            elif WIDGET_VIEW in data:
                for mid in _widget_children(state, data[WIDGET_VIEW]["model_id"]):
                    m = state[mid]["state"]
                    for o in m.get("outputs", []) if state[mid]["model_name"] == "OutputModel" else []:
                        if PLOTLY_MIME in o.get("data", {}):
                            figs.append(Figure(notebook, i, k, o["data"][PLOTLY_MIME], in_widget=True))
                            k += 1
                    if m.get("description") and state[mid]["model_name"] not in ("ButtonModel", "OutputModel"):
                        style = state.get(str(m.get("style", "")).replace("IPY_MODEL_", ""), {}).get("state", {})
                        width = style.get("description_width") or "80px"
                        labels.append({"notebook": notebook, "cell": i, "description": m["description"],
                                       "width": None if width == "initial" else width})
    return figs, [lb for lb in labels if lb["width"]]


# ---------------------------------------------------------------------- command line
def _executed(path: str, timeout: float, lang: str | None = None, server: str = ""):
    """(notebook with outputs, error or None): as it is when it has outputs, else executed in its own folder
    (its kernel forked by the kernel server at `server`, if given). A cell that fails leaves the outputs up to it
    (still checked) and the error's last line."""
    from parlab import course

    nb = course.read(path)
    if not _has_outputs(nb):
        try:
            course.execute(nb, Path(path).resolve().parent, timeout=timeout, lang=lang, server=server)
        except Exception as err:                      # CellExecutionError, CellTimeoutError, a dead kernel
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))          # the traceback's colour codes
            last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [type(err).__name__]
            return nb, f"the notebook stopped with an error: {last[0][:200]}"
    return nb, None


def _has_outputs(nb) -> bool:
    return any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


def run(paths: list[Path], out: Path, jobs: int = 1, width: int = WIDTH, timeout: float = 300.0,
        lang: str | None = None, screenshots: bool = True, browser: Browser | None = None,
        server: str = "") -> list[str]:
    """Execute (parlab speaking `lang`, default this process's language), collect, draw and check (a PNG of each
    figure if `screenshots`; in `browser` if given); returns every problem as 'notebook/cellNN_k: what'. Each
    executed notebook is left in `out` under its own name. `server`: the address of a running
    `parlab.course.kernel_server.KernelServer` to fork the kernels from (a caller checking several batches, in
    several languages); by default one is started for the call when it executes more than one notebook."""
    from parlab import course
    from parlab.course.kernel_server import KernelServer
    out.mkdir(parents=True, exist_ok=True)
    fresh = sum(not _has_outputs(course.read(p)) for p in paths)
    # kernels forked from one warm server (parlab.course.kernel_server): 3 s less CPU per lesson
    with KernelServer() if fresh > 1 and not server else contextlib.nullcontext() as started, \
            ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        address = started.address if started else server
        done = list(pool.map(_executed, map(str, paths), [timeout] * len(paths), [lang] * len(paths),
                             [address] * len(paths)))
    figs, labels, failed = [], [], []
    for path, (nb, error) in zip(paths, done):
        (out / Path(path).name).write_text(course.dumps(nb), encoding="utf-8")     # as executed, for a handout
        f, lb = collect(nb, Path(path).stem)
        figs += f
        labels += lb
        if error:
            failed.append(f"{Path(path).stem}: {error}")
    label_problems = check_pages(figs, labels, out, width=width, screenshots=screenshots, browser=browser)
    problems = failed + [f"{fig.name}: {p}" for fig in figs for p in fig.problems] + label_problems
    (out / "report.txt").write_text(
        f"{len(figs)} figures from {len(paths)} notebooks, {len(labels)} widget labels; "
        f"{len(problems)} problems\n" + "".join(p + "\n" for p in problems), encoding="utf-8")
    (out / "figures.json").write_text(json.dumps([{"name": f.name, "in_widget": f.in_widget, "height": f.height,
                                                   "problems": f.problems} for f in figs], indent=1))
    return problems


def main(argv: list[str] | None = None) -> int:
    from parlab import course

    p = ArgumentParser(prog="python -m parlab.course.figcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: every lesson)")
    p.add_argument("--out", type=Path, default=Path("figcheck"), help="folder for the PNGs and report.txt")
    p.add_argument("--jobs", type=int, default=1, help="notebooks executed at once")
    p.add_argument("--width", type=int, default=WIDTH, help="px width of the output area figures are drawn in")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a cell may run")
    p.add_argument("--lang", default=None, help="the language parlab speaks in the notebooks' kernels (en, zh); "
                                                "translated notebooks: parlab course i18n build")
    a = p.parse_args(argv)
    paths = a.notebooks or sorted((course.ROOT / "lessons").glob("*.ipynb"))
    missing = [q for q in paths if not q.exists()]
    if missing:
        print(f"no such notebook: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    problems = run(paths, a.out, jobs=a.jobs, width=a.width, timeout=a.timeout, lang=a.lang)
    print((a.out / "report.txt").read_text(encoding="utf-8"), end="")
    print(f"screenshots: {a.out}/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
