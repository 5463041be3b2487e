"""A student's first minutes in JupyterLab, in headless Chromium (Debian's chromium, driven by playwright).

``parlab course open --no-browser`` is run on a small course checkout as a student runs it, and the URL it prints
(all a student on a remote machine or in a container has) is opened:

* START.ipynb is the page that opens, not JupyterLab's Launcher, and its links open the exercise and the lesson
  (in new tabs of the same page, as a student clicks them);
* no notebook is marked modified by opening it (the tab's dot): not START, not a lesson, not an exercise, once
  each has its kernel running (JupyterLab writes the kernel's metadata into a notebook when the kernel starts;
  the copies carry it already, `parlab.course.workspace.kernel_metadata`), and those kernels were forked by the
  kernel server `parlab course open` started (`parlab.course.workspace.warm_kernels`);
* lesson 07's layout explorer, run in the page: every control is drawn, the controls and the memory figure fit one
  1440x900 screen, and moving them redraws the figure for the new layout: tp 8 -> 4; no recomputation (past the
  80 GB line, whose labels stay off the bars); the H100 in fp8 (faster than in bf16); fp8 on the A100, which says
  in the output that the A100 has no fp8 instead of raising. The checkout's lesson 07 holds only its import cell
  and the explorer's two cells (`_explorer_only`): the whole lesson runs once in the suite, in
  tests/test_viz_browser.py;
* nothing is written into the tracked notebooks.

Screenshots are left in the test's temporary folder (``start.png``, ``lesson.png``, ``exercise.png``,
``explorer.png``, ``explorer-tp4.png``, ``explorer-no-rc.png``, ``explorer-fp8.png``).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from net import free_port
from parlab.course.figcheck import CHROMIUM_ARGS, chromium_path

ROOT = Path(__file__).resolve().parents[1]
LESSON, EXERCISE = "lessons/07_hybrid_4d.ipynb", "exercises/05_pipeline_schedules.ipynb"
EXPLORER_CONTROLS = ("model", "GPU", "GPUs", "number format", "tp", "pp", "cp", "ZeRO", "global batch", "micro-batch",
                     "schedule", "chunks v", "recompute", "SP", "attention")

pytestmark = pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium: apt-get install chromium")



@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`parlab course open --no-browser` on a checkout of one lesson and one exercise: (printed URL, checkout)."""
    tmp = tmp_path_factory.mktemp("student")
    root = tmp / "repo"
    for rel in (LESSON, EXERCISE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    nbformat.write(_explorer_only(nbformat.read(root / LESSON, as_version=4)), str(root / LESSON))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))       # none of this user's JupyterLab state
    port = free_port()
    cmd = [sys.executable, "-m", "parlab.cli", "course", "open", "--root", str(root), "--no-browser", "--",
           f"--port={port}", "--ServerApp.port_retries=0"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, seen = None, []
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen.append(line)
        m = re.search(r"(http://(?:localhost|127\.0\.0\.1):\d+/\S*token=\S+)", line)
        url = m.group(1) if m else None
    warm = []
    try:
        assert url, "".join(seen)[-3000:]
        yield url, root, tmp
        warm = _forked_kernels(proc.pid)
        # the notebooks' kernels were forked by the kernel server of `parlab course open` (START, lesson, exercise)
        assert len(warm[1:]) >= 3, warm
    finally:
        warm = warm or _forked_kernels(proc.pid)
        proc.terminate()                     # `parlab course open` passes it on: JupyterLab stops its kernels
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        left = _left_running(tmp / "runtime", port) + [pid for pid in warm if Path(f"/proc/{pid}").exists()]
        for pid in left:                     # JupyterLab first (it would restart a killed kernel), then kernels
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"still running after `parlab course open` was stopped (JupyterLab, kernels): {left}"


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _forked_kernels(course_open: int) -> list[int]:
    """[the kernel server started by the `parlab course open` process `course_open`, the kernels it forked]."""
    servers = [p for p in _children(course_open) if b"parlab.course.kernel_server" in _cmdline(p)]
    return servers[:1] + _children(servers[0]) if servers else []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _left_running(runtime: Path, port: int) -> list[int]:
    """Processes (Linux /proc) that are this lab's JupyterLab server (its --port) or one of its kernels (a
    connection file in `runtime`), the server first."""
    server, kernels = [], []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(cmdline.parent.name)
        if b"jupyterlab" in b" ".join(args) and f"--port={port}".encode() in args:
            server.append(pid)
        elif any(str(runtime).encode() in a and b"kernel-" in a for a in args):
            kernels.append(pid)
    return server + kernels


def _explorer_only(nb):
    """Lesson 07 cut to its first code cell (the imports) and the explorer's cells, which must exist."""
    imports = next(c for c in nb.cells if c.cell_type == "code")
    cells = [c for c in nb.cells if c.get("id") in ("explore-md", "explore-code")]
    assert len(cells) == 2, "lesson 07 lost its explorer cells (ids explore-md, explore-code)"
    nb.cells = [nb.cells[0], imports, *cells]
    return nb


def _tabs(page) -> dict[str, str]:
    """{title: class list} of the main area's document tabs."""
    return {t: c for t, c in page.eval_on_selector_all(
        "#jp-main-dock-panel .lm-TabBar-tab",
        "els => els.map(e => [e.innerText.trim(), e.className])") if t}


def _kernel_idle(page, seconds: float = 90) -> None:
    """Wait until the current notebook's kernel has started and is idle (the status bar says so)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if re.search(r"\|\s*Idle", page.inner_text("#jp-main-statusbar")):
            time.sleep(1)                  # JupyterLab writes the kernel's metadata right after kernel_info
            return
        time.sleep(0.3)
    raise AssertionError(f"the kernel was not idle within {seconds} s: {page.inner_text('#jp-main-statusbar')!r}")


def test_start_opens_first_no_notebook_is_modified_on_open_and_the_explorer_redraws(lab):
    from playwright.sync_api import sync_playwright

    url, root, tmp = lab
    tracked = {rel: (root / rel).read_bytes() for rel in (LESSON, EXERCISE)}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url)                                          # the URL parlab course open printed
            page.wait_for_selector(".jp-NotebookPanel", state="attached", timeout=90_000)
            _kernel_idle(page)
            page.screenshot(path=str(tmp / "start.png"))
            tabs = _tabs(page)
            assert list(tabs) == ["START.ipynb"], tabs                # START, not the Launcher
            assert "jp-mod-current" in tabs["START.ipynb"] and "jp-mod-dirty" not in tabs["START.ipynb"], tabs
            # as a student goes on: START's own links open the exercise, then the lesson (which stays current), in
            # new tabs of the same page
            for rel, link, shot in ((EXERCISE, "Exercise 05", "exercise.png"), (LESSON, "Lesson 07", "lesson.png")):
                page.click("#jp-main-dock-panel .lm-TabBar-tab:has-text('START.ipynb')")
                page.click(f"#jp-main-dock-panel .jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedMarkdown "
                           f"a:has-text('{link}')")
                name = Path(rel).name
                page.wait_for_function(f"() => [...document.querySelectorAll('#jp-main-dock-panel "
                                       f".lm-TabBar-tab.jp-mod-current')].some(e => e.innerText.trim() === "
                                       f"'{name}') && document.querySelector('#jp-main-statusbar').innerText"
                                       f".includes('{name}')", timeout=90_000)
                _kernel_idle(page)
                page.screenshot(path=str(tmp / shot))
                dirty = [t for t, c in _tabs(page).items() if "jp-mod-dirty" in c]
                assert dirty == [], f"marked modified on open: {dirty}"
            _explorer_redraws(page, tmp)
        finally:
            browser.close()
    assert {rel: (root / rel).read_bytes() for rel in tracked} == tracked


def _explorer_redraws(page, tmp) -> None:
    """Run lesson 07, the current tab, in the page (Run > Run All Cells), then move the explorer's controls."""
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    title = "#jp-main-dock-panel .jp-NotebookPanel:not(.lm-mod-hidden) .parlab-explorer .js-plotly-plot .gtitle"

    def explorer_title():
        texts = [t for t in page.eval_on_selector_all(title, "els => els.map(e => e.textContent)")
                 if " per GPU (" in t]
        return texts[0] if texts else None
    deadline = time.monotonic() + 120
    while explorer_title() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    before = explorer_title()
    explorer = page.locator(".parlab-explorer").first
    if before:
        explorer.screenshot(path=str(tmp / "explorer.png"))
    else:
        page.screenshot(path=str(tmp / "explorer.png"))
    assert before and before.startswith("tp8 pp8 "), before
    labels = page.eval_on_selector_all(".parlab-explorer .widget-label, .parlab-explorer .widget-label-basic",
                                       "els => els.map(e => e.textContent.trim())")
    assert [c for c in EXPLORER_CONTROLS if c not in labels] == [], labels          # every control drawn
    explorer.evaluate("e => e.scrollIntoView({block: 'start'})")
    memory = explorer.locator(".js-plotly-plot").first.bounding_box()
    assert memory["y"] >= 0 and memory["y"] + memory["height"] <= 900, memory       # controls + figure: one screen

    def choose(label, option):
        """Pick `option` in the dropdown labelled `label`; the explorer's title once it changed (None: gone)."""
        shown = explorer_title()
        named = page.locator("label", has_text=re.compile(f"^{re.escape(label)}$"))
        explorer.locator(".widget-dropdown", has=named).locator("select").select_option(option)
        end = time.monotonic() + 60
        while explorer_title() == shown and time.monotonic() < end:
            time.sleep(0.3)
        time.sleep(0.5)                                                   # plotly finishes drawing
        return explorer_title()

    after = choose("tp", "4")
    assert after and after.startswith("tp4 pp8 "), (before, after)
    explorer.screenshot(path=str(tmp / "explorer-tp4.png"))
    full = choose("recompute", "none")                                    # every activation kept: past 80 GB
    assert full and "(does not fit)" in full and not re.search(r" sel[: ]", full), full
    explorer.screenshot(path=str(tmp / "explorer-no-rc.png"))
    boxes = explorer.evaluate("""e => {
        const box = x => { const r = x.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
        const plot = e.querySelector('.js-plotly-plot');
        return {bars: [...plot.querySelectorAll('.barlayer .point path')].map(box),
                labels: [...plot.querySelectorAll('.annotation')].filter(
                    a => ['80 GB GPU', 'usable'].includes(a.textContent.trim())).map(box)}; }""")
    assert len(boxes["labels"]) == 2 and boxes["bars"], boxes
    over = [(lb, b) for lb in boxes["labels"] for b in boxes["bars"]
            if lb[0] < b[2] and b[0] < lb[2] and lb[1] < b[3] and b[1] < lb[3]]
    assert over == [], f"the capacity lines' labels overlap a bar: {over}"
    bf16 = choose("GPU", "h100-80gb")
    fp8 = choose("number format", "fp8")
    step = [float(re.search(r"([\d.]+) s per step", t).group(1)) for t in (bf16, fp8)]
    assert " fp8:" in fp8 and " fp8" not in bf16 and step[1] < step[0], (bf16, fp8)
    explorer.screenshot(path=str(tmp / "explorer-fp8.png"))
    assert choose("GPU", "a100-80gb") is None                             # no figure for fp8 on the A100 ...
    text = explorer.inner_text()
    assert "DGX A100 cannot compute in fp8" in text and "Traceback" not in text, text[-500:]   # ... but a message
