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

import bisect
import contextlib
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from parlab.i18n.args import ArgumentParser

__all__ = ["Figure", "collect", "check_pages", "main", "CHROMIUM_ARGS", "chromium_path", "missing_glyphs"]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDTH = 920              # px: a notebook's output area in JupyterLab on a 1280-px screen with the file browser shut


@dataclass
class Figure:
    """One figure as a student sees it: notebook, cell index, k-th figure of that cell, where it sits."""
    notebook: str
    cell: int
    k: int
    spec: dict                                 # plotly's JSON: {"data": [...], "layout": {...}, "frames"?}
    in_widget: bool = False
    problems: list[str] = field(default_factory=list)
    height: float = 0.0                        # px, as drawn in the browser (0: not drawn)

    @property
    def name(self) -> str:
        return f"{self.notebook}/cell{self.cell:02d}_{self.k}"


@functools.lru_cache(maxsize=1)
def _font_coverage() -> tuple[tuple[int, int], ...]:
    """The code points some installed font draws, as sorted merged (first, last) ranges, from fontconfig
    (``fc-list``), which Chromium on Linux asks for a fallback font; () when fontconfig is absent."""
    try:
        listing = subprocess.run(["fc-list", "--format", "%{charset}\\n"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    ranges = []
    for part in listing.split():
        a, _, b = part.partition("-")
        try:
            ranges.append((int(a, 16), int(b or a, 16)))
        except ValueError:
            continue
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def missing_glyphs(text: str) -> list[str]:
    """The characters of `text` that no installed font draws (empty boxes on the page), each once, in order;
    [] where fontconfig cannot say (then nothing is claimed)."""
    cover = _font_coverage()
    if not cover:
        return []
    starts = [a for a, _b in cover]
    out = []
    for ch in dict.fromkeys(text):
        cp = ord(ch)
        if cp < 0x80 or ch.isspace():
            continue
        i = bisect.bisect_right(starts, cp) - 1
        if i < 0 or cp > cover[i][1]:
            out.append(ch)
    return out


def chromium_path() -> str | None:
    """Debian's chromium (or chromium-browser), if installed."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)


# ---------------------------------------------------------------------- collecting figures
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


def _animation_problems(spec: dict) -> list[str]:
    """An animation of parlab.viz.comm_animation must have a frame per step of each call's algorithm."""
    meta = (spec.get("layout", {}).get("meta") or {})
    anim = meta.get("parlab_animation") if isinstance(meta, dict) else None
    if not anim or anim.get("per_call"):
        return []
    from parlab.viz.animation import Step, algorithm_steps
    need = sum(len(algorithm_steps(Step(op, "collective", "", tuple(range(n)), 1, root=0)))
               for op, n in anim["calls"])
    have = len(spec.get("frames", []))
    if have < need and not anim.get("cut"):
        return [f"animation has {have} frames, its algorithm {need} steps"]
    return []


# ---------------------------------------------------------------------- drawing and checking
_PAGE = """<!doctype html><html><head><meta charset="utf-8">
<style>body {{ margin: 0; background: white; font-family: sans-serif; }} #fig {{ width: {width}px; }}</style>
<script src="plotly.min.js"></script><script src="check.js"></script></head>
<body><div id="fig"></div></body></html>"""

_DRAW = """async (spec) => {
  const gd = document.getElementById('fig');
  Plotly.purge(gd);
  const layout = Object.assign({}, spec.layout || {});
  await Plotly.newPlot(gd, spec.data || [], layout, {responsive: false});    // the toolbar as on hover: checked
  if (spec.frames) await Plotly.addFrames(gd, spec.frames);
  return gd.getBoundingClientRect().height;
}"""

_FRAME = """async (name) => {
  const gd = document.getElementById('fig');
  await Plotly.animate(gd, [name], {mode: 'immediate', frame: {duration: 0, redraw: true},
                                    transition: {duration: 0}});
  return true;
}"""


def _frames_to_check(spec: dict) -> list[str]:
    frames = spec.get("frames") or []
    if not frames:
        return []
    names = [str(f.get("name", i)) for i, f in enumerate(frames)]
    longest = max(range(len(frames)), key=lambda i: len(str(frames[i].get("layout", {}).get("title", ""))))
    return list(dict.fromkeys([names[0], names[longest], names[-1]]))


def check_pages(figs: list[Figure], labels: list[dict], out: Path, width: int = WIDTH,
                chromium: str | None = None, screenshots: bool = True) -> list[str]:
    """Draw every figure in headless Chromium, fill each figure's `problems` and drawn `height`, write a PNG per
    figure under `out` (if `screenshots`); returns the problems of the widget labels."""
    from playwright.sync_api import sync_playwright

    import plotly

    chromium = chromium or chromium_path()
    if chromium is None:
        raise RuntimeError("parlab.course.figcheck draws figures in Debian's chromium: apt-get install -y chromium")
    work = Path(tempfile.mkdtemp(prefix="parlab-check-"))
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", work / "plotly.min.js")
    shutil.copy(Path(__file__).with_name("check.js"), work / "check.js")
    (work / "page.html").write_text(_PAGE.format(width=width), encoding="utf-8")
    label_problems: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width + 40, "height": 900})
            page.route("http*://**", lambda route: route.abort())          # offline: nothing from a network
            page.goto((work / "page.html").as_uri())
            for fig in figs:
                fig.problems += _animation_problems(fig.spec)
                fig.height = page.evaluate(_DRAW, fig.spec)
                found = page.evaluate("() => parlabCheck(document.getElementById('fig'))")
                missing = missing_glyphs(page.evaluate("() => document.getElementById('fig').textContent"))
                if missing:
                    found.append(f"no installed font draws {''.join(missing[:20])!r} (empty boxes on the page): "
                                 f"install a CJK font, e.g. Debian's fonts-noto-cjk")
                if screenshots:
                    png = out / (fig.name + ".png")
                    png.parent.mkdir(parents=True, exist_ok=True)
                    page.locator("#fig").screenshot(path=str(png))
                for name in _frames_to_check(fig.spec)[1:]:
                    page.evaluate(_FRAME, name)
                    found += [f"frame {name}: {p}" for p in
                              page.evaluate("() => parlabCheck(document.getElementById('fig'))")]
                fig.problems += list(dict.fromkeys(found))
            if labels:
                cut = set(page.evaluate("(l) => parlabCheckLabels(l)", labels))
                label_problems = [f"{lb['notebook']}/cell{lb['cell']:02d}: widget label cut off: "
                                  f"{lb['description']!r} does not fit {lb['width']}" for lb in labels
                                  if lb["description"] in cut]
            browser.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return list(dict.fromkeys(label_problems))


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
        lang: str | None = None, screenshots: bool = True) -> list[str]:
    """Execute (parlab speaking `lang`, default this process's language), collect, draw and check (a PNG of each
    figure if `screenshots`); returns every problem as 'notebook/cellNN_k: what'. Each executed notebook is left
    in `out` under its own name."""
    from parlab import course
    from parlab.course.kernel_server import KernelServer
    out.mkdir(parents=True, exist_ok=True)
    fresh = sum(not _has_outputs(course.read(p)) for p in paths)
    # kernels forked from one warm server (parlab.course.kernel_server): 3 s less CPU per lesson
    with KernelServer() if fresh > 1 else contextlib.nullcontext() as server, \
            ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        address = server.address if server else ""
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
    label_problems = check_pages(figs, labels, out, width=width, screenshots=screenshots)
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
