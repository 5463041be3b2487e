"""The page side of `parlab.course.figcheck`: figures drawn by plotly.js in headless Chromium and measured there.

A `Figure` (a plotly JSON spec and where a notebook shows it) is drawn at the width of a JupyterLab output area
in one page that holds plotly.js and `check.js`; `check.js` measures the drawn figure (overlapping or cut text,
axis ranges, legends, minor log labels, tiny text, the toolbar band, bar labels under shapes: the rules listed in
`parlab.course.figcheck`) and its animation frames, and `missing_glyphs` asks fontconfig whether an installed font
draws every character (a Chinese title without a CJK font is a row of empty boxes no layout rule sees).

`Browser` keeps that page open for many `check_pages` calls: loading plotly.js costs a page about 2 CPU seconds,
drawing and checking a figure about 0.1 s. Chromium is Debian's ``chromium`` package, driven by playwright, and
nothing is fetched from a network.
"""
from __future__ import annotations

import bisect
import functools
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Figure", "Browser", "check_pages", "missing_glyphs", "chromium_path", "CHROMIUM_ARGS", "WIDTH"]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
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


# ---------------------------------------------------------------------- animations
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

# The figure arrives as one JSON string, parsed in the page: handed over as an object, playwright walks and
# validates it value by value in Python (a 460-KB animation: ~0.3 s), twice the CPU of the drawing itself
_DRAW = """async (text) => {
  const spec = JSON.parse(text);
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


class Browser:
    """One headless Chromium page with plotly.js and check.js loaded, kept for many `check_pages` calls.

    Loading plotly.js (4.8 MB of JavaScript) costs a page about 2 CPU seconds, and starting playwright and
    Chromium another second; drawing and checking a figure about 0.1 s. Playwright's sync API runs in a thread of
    its own here: while it is open it marks an event loop as running in the thread that uses it, which would stop
    asyncio code (nbclient executing a notebook) in the caller's thread.

        with Browser() as browser:
            for figs in batches:
                check_pages(figs, [], out, browser=browser)
            title = browser.with_page(lambda page: (page.goto(url), page.title())[1])   # another page, same Chromium
    """

    def __init__(self, width: int = WIDTH, chromium: str | None = None):
        self.width = width
        self._chromium = chromium or chromium_path()
        if self._chromium is None:
            raise RuntimeError("parlab.course.figcheck draws figures in Debian's chromium: "
                               "apt-get install -y chromium")
        self._thread = self._pw = self._page = self._work = None

    def __enter__(self) -> "Browser":
        from concurrent.futures import ThreadPoolExecutor
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="parlab-figcheck")
        try:
            self._thread.submit(self._open).result()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.submit(self._close).result()
            self._thread.shutdown()
            self._thread = None

    def check(self, figs: list[Figure], labels: list[dict], out: Path, screenshots: bool = True) -> list[str]:
        """Fill each figure's `problems` and drawn `height`; returns the problems of the widget labels."""
        if self._thread is None:
            raise RuntimeError("use the Browser in a with-statement: `with Browser() as browser: ...`")
        return self._thread.submit(self._check, figs, labels, out, screenshots).result()

    def with_page(self, fn, width: int = 1200, height: int = 900):
        """fn(page) on a fresh page (a playwright `Page`, `width` x `height`) of this Chromium, in the thread
        playwright runs in; the page is closed after, and fn's result returned (a handout read offline, say)."""
        if self._thread is None:
            raise RuntimeError("use the Browser in a with-statement: `with Browser() as browser: ...`")
        return self._thread.submit(self._with_page, fn, width, height).result()

    def _with_page(self, fn, width: int, height: int):
        page = self._page.context.browser.new_page(viewport={"width": width, "height": height})
        try:
            return fn(page)
        finally:
            page.close()

    def _open(self) -> None:
        from playwright.sync_api import sync_playwright

        import plotly

        self._work = Path(tempfile.mkdtemp(prefix="parlab-check-"))
        shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", self._work / "plotly.min.js")
        shutil.copy(Path(__file__).with_name("check.js"), self._work / "check.js")
        (self._work / "page.html").write_text(_PAGE.format(width=self.width), encoding="utf-8")
        self._pw = sync_playwright().start()
        browser = self._pw.chromium.launch(executable_path=self._chromium, args=CHROMIUM_ARGS)
        self._page = browser.new_page(viewport={"width": self.width + 40, "height": 900})
        self._page.route("http*://**", lambda route: route.abort())          # offline: nothing from a network
        self._page.goto((self._work / "page.html").as_uri())

    def _close(self) -> None:
        try:
            if self._pw is not None:
                self._pw.stop()                                 # closes the browser it launched
        finally:
            if self._work is not None:
                shutil.rmtree(self._work, ignore_errors=True)
            self._pw = self._page = self._work = None

    def _check(self, figs: list[Figure], labels: list[dict], out: Path, screenshots: bool) -> list[str]:
        page = self._page
        for fig in figs:
            fig.problems += _animation_problems(fig.spec)
            fig.height = page.evaluate(_DRAW, json.dumps(fig.spec))
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
        if not labels:
            return []
        cut = set(page.evaluate("(l) => parlabCheckLabels(l)", labels))
        return list(dict.fromkeys(f"{lb['notebook']}/cell{lb['cell']:02d}: widget label cut off: "
                                  f"{lb['description']!r} does not fit {lb['width']}" for lb in labels
                                  if lb["description"] in cut))


def check_pages(figs: list[Figure], labels: list[dict], out: Path, width: int = WIDTH,
                chromium: str | None = None, screenshots: bool = True, browser: Browser | None = None) -> list[str]:
    """Draw every figure in headless Chromium, fill each figure's `problems` and drawn `height`, write a PNG per
    figure under `out` (if `screenshots`); returns the problems of the widget labels. In `browser` (an open
    `Browser`, whose width is used) if given, else in a Chromium started for this call."""
    if browser is not None:
        return browser.check(figs, labels, out, screenshots)
    with Browser(width, chromium) as own:
        return own.check(figs, labels, out, screenshots)

