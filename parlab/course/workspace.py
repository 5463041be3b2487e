"""A student's own copy of the course, so the tracked notebooks stay clean: ``parlab course open``.

Running a lesson in JupyterLab saves its outputs into the notebook (autosave). Opened straight from
``lessons/``, the student's checkout is dirty after one lesson, and ``git pull`` of next week's material
conflicts. So the course is opened from a working copy:

    parlab course open            # at the repository root: my-course/ + JupyterLab on my-course/START.ipynb

`working_copy` copies every lesson (``lessons/*.ipynb``) and every exercise (``exercises/*.ipynb``, not
the solutions) into ``my-course/`` (git-ignored) and writes a landing page, ``my-course/START.ipynb``,
that links each of them. Run again after ``git pull``: notebooks that are new in the course are copied in;
a notebook the course changed replaces the student's copy only if the student has not edited it
(outputs do not count as edits); otherwise the new version is written next to it as
``NAME.updated.ipynb`` and the student's own stays as it is. What was copied from where is recorded in
``my-course/.parlab-origin.json``.

The lessons find everything they need through the installed ``parlab`` package, so they run the same from
``my-course/lessons/`` as from ``lessons/``.

Each copy carries the notebook metadata this environment's kernel reports (`kernel_metadata`: the kernelspec's
display name, ipykernel's ``language_info`` with this Python's version). JupyterLab writes that metadata into a
notebook when its kernel starts; had the copy held anything else (the tracked notebooks hold only
``language_info.name``, being shared by every Python), every notebook would be marked modified the moment it
opened. For the same reason the edit check (`_fingerprint`) ignores those two entries: a student who only ran a
notebook has not edited it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from parlab.course.notebooks import ROOT, dumps, read, strip_notebook
from parlab.course.translated import write_course
from parlab.i18n import _, language, normalize, use_language

__all__ = ["WORKDIR", "working_copy", "landing_page", "open_course", "kernel_metadata"]

WORKDIR = "my-course"
ORIGIN = ".parlab-origin.json"


KERNEL_KEYS = ("kernelspec", "language_info")     # notebook metadata JupyterLab rewrites when a kernel starts
FINGERPRINT_KEY, FINGERPRINT_VERSION = "fingerprint", 2      # 2: kernel metadata ignored (1, unrecorded: kept)


def _fingerprint(path: Path, kernel_keys: bool = False) -> str:
    """Hash of the notebook's inputs: outputs, execution counts, widget state and (unless `kernel_keys`, the
    hash of origin files written before version 2) kernel metadata removed."""
    nb = strip_notebook(read(path))
    if not kernel_keys:
        for key in KERNEL_KEYS:
            nb.metadata.pop(key, None)
    return hashlib.sha256(dumps(nb).encode()).hexdigest()


def kernel_metadata(kernel: str = "python3") -> dict:
    """{"kernelspec": ..., "language_info": ...} as JupyterLab will write them once `kernel` of this environment
    starts: the kernelspec from jupyter_client, language_info from ipykernel (what its kernel_info reply sends).
    Empty if either cannot be read (the copies then keep the course's metadata)."""
    try:
        from ipykernel.ipkernel import IPythonKernel
        from jupyter_client.kernelspec import KernelSpecManager
        spec = KernelSpecManager().get_kernel_spec(kernel)
    except Exception:           # no ipykernel, no such kernel: JupyterLab then marks the notebook modified, no worse
        return {}
    return {"kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": kernel},
            "language_info": dict(IPythonKernel.language_info)}


def _copy(src: Path, target: Path, kernel: dict) -> None:
    nb = strip_notebook(read(src))
    nb.metadata.update(kernel)
    target.write_text(dumps(nb), encoding="utf-8")


def _settle_kernel(path: Path, kernel: dict) -> None:
    """Give an unchanged copy this environment's kernel metadata (what JupyterLab would write on opening it)."""
    nb = read(path)
    if kernel and any(nb.metadata.get(k) != v for k, v in kernel.items()):
        nb.metadata.update(kernel)
        path.write_text(dumps(nb), encoding="utf-8")


def _title(path: Path) -> str:
    """The notebook's first heading, without the '#'s ("Lesson 01: Collectives and process groups")."""
    for cell in read(path).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return path.stem


def _sources(root: Path) -> list[Path]:
    return sorted((root / "lessons").glob("*.ipynb")) + sorted((root / "exercises").glob("*.ipynb"))


def landing_page(root: Path, lang: str = "en") -> str:
    """START.ipynb's markdown in `lang`: every lesson and exercise of `root` (the course in that language),
    linked inside the working copy, and the glossary."""
    lessons = sorted((root / "lessons").glob("*.ipynb"))
    exercises = sorted((root / "exercises").glob("*.ipynb"))
    with use_language(lang):
        lines = ["# " + _("parlab: distributed training, run live"), "",
                 _("Your own copy of the course: run and edit these notebooks freely, the repository's `lessons/` "
                   "and `exercises/` stay untouched. Work through the lessons in order; each ends by pointing to "
                   "its exercise."),
                 "", "| # | " + _("lesson") + " |", "|---|---|"]
        lines += [f"| {p.stem[:2]} | [{_title(p)}](lessons/{p.name}) |" for p in lessons]
        lines += ["", "| # | " + _("exercise") + " |", "|---|---|"]
        lines += [f"| {p.stem[:2]} | [{_title(p)}](exercises/{p.name}) |" for p in exercises]
        lines += ["", _("The terms of the course in English and Chinese: [the glossary](GLOSSARY.md)."),
                  "", _("**Next week's material:** in a terminal at the repository root, `git pull`, then "
                        "`.venv/bin/parlab course open` again (`parlab course open` once the venv is activated: "
                        "`source .venv/bin/activate`). New notebooks are copied in; a notebook you edited is never "
                        "overwritten (if the course changed it too, the new version appears next to yours as "
                        "`NAME.updated.ipynb`)."),
                  "", _("The course in Chinese: `parlab course open --lang zh`; in English: "
                        "`parlab course open --lang en`."),
                  "", _("Lesson figures need nothing but this browser; each lesson runs top to bottom in about a "
                        "minute.")]
    return "\n".join(lines)


def working_copy(root: str | Path = ROOT, dest: str | Path | None = None,
                 lang: str = "en") -> dict[str, list[str]]:
    """Create or refresh the student's copy (default ``root/my-course``) in `lang` ("en", "zh", ...); returns
    what happened to each notebook: {"added": [...], "updated": [...], "kept": [...], "conflicts": [...]}
    (paths relative to dest). Switching language follows the same rule as a new week's material: a notebook
    the student has not edited becomes the other language's, an edited one stays and gets the other language's
    beside it as ``NAME.updated.ipynb``."""
    root = Path(root)
    lang = normalize(lang) or "en"
    dest = Path(dest) if dest is not None else root / WORKDIR
    if not (root / "lessons").is_dir():
        raise FileNotFoundError(f"{root} has no lessons/ folder: run `parlab course open` at the repository root "
                                f"or pass --root PATH_TO_REPOSITORY")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parlab-course-") as tmp:
        source = root if lang == "en" else write_course(root, lang, Path(tmp))
        report = _refresh(source, dest, lang)
    glossary = root / "translations" / "GLOSSARY.md"
    if glossary.is_file():
        shutil.copyfile(glossary, dest / "GLOSSARY.md")
    return report


def _refresh(root: Path, dest: Path, lang: str) -> dict[str, list[str]]:
    """`working_copy`'s copy rule, from the course in `root` (the repository, or its translation)."""
    origin_file = dest / ORIGIN
    origin = json.loads(origin_file.read_text()) if origin_file.exists() else {}
    # copies recorded before the fingerprint ignored kernel metadata are compared the way they were recorded
    legacy = bool(origin) and origin.get(FINGERPRINT_KEY) != FINGERPRINT_VERSION
    recorded = (lambda p: _fingerprint(p, kernel_keys=True)) if legacy else _fingerprint
    origin[FINGERPRINT_KEY] = FINGERPRINT_VERSION
    origin["lang"] = lang
    report: dict[str, list[str]] = {"added": [], "updated": [], "kept": [], "conflicts": []}
    kernel = kernel_metadata()
    for src in _sources(root):
        rel = f"{src.parent.name}/{src.name}"
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        new = _fingerprint(src)
        if not target.exists():
            _copy(src, target, kernel)
            report["added"].append(rel)
        elif origin.get(rel) in (new, recorded(src)):
            report["kept"].append(rel)
            _settle_kernel(target, kernel)
        elif recorded(target) == origin.get(rel):            # the student only ran it: take the new version
            _copy(src, target, kernel)
            report["updated"].append(rel)
        else:                                                   # the student edited it: keep theirs
            _copy(src, target.with_name(target.stem + ".updated.ipynb"), kernel)
            report["conflicts"].append(rel)
            continue                                            # still compare against the old origin next time
        origin[rel] = new
    start = dest / "START.ipynb"
    import nbformat
    page = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(landing_page(root, lang), id="start")])
    page.metadata.update(kernel or {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    if not (start.exists() and start.read_text(encoding="utf-8") == dumps(page)):
        start.write_text(dumps(page), encoding="utf-8")         # rewritten only when it changed (an open tab stays clean)
    origin_file.write_text(json.dumps(origin, indent=1, sort_keys=True), encoding="utf-8")
    return report


def open_course(root: str | Path = ROOT, browser: bool = True, lab_args: list[str] | None = None,
                lang: str | None = None) -> int:
    """Refresh the working copy in `lang` (default: ``PARLAB_LANG``, else the locale, else English) and start
    JupyterLab at the repository root on my-course/START.ipynb. The server runs with ``PARLAB_LANG`` set, so its
    kernels (and their ranks) print and draw in the course's language; in Chinese, JupyterLab's own menus are
    Chinese too where its language pack is installed (`lab_settings`)."""
    root = Path(root)
    lang = normalize(lang) if lang else language()
    report = working_copy(root, lang=lang)
    with use_language(lang):
        said = {"added": _("added"), "updated": _("updated"), "conflicts": _("conflicts")}
        for what, names in report.items():
            if names and what != "kept":
                print(f"{said[what]}: {', '.join(names)}")
        for rel in report["conflicts"]:
            print("  " + _("{rel}: you edited it and the course changed it; the course's version is next to it as "
                           "{new}").format(rel=rel, new=rel.removesuffix(".ipynb") + ".updated.ipynb"))
        if shutil.which("jupyter") is None and not (Path(sys.executable).parent / "jupyter").exists():
            print(_("JupyterLab is not installed in this environment: pip install jupyterlab"), file=sys.stderr)
            return 2
        # JupyterLab serves the folder of the file it is given (my-course/). default_url: the URL it prints (and
        # `/`) opens START too, not the Launcher (with --no-browser, the printed URL is all a student has)
        cmd = [sys.executable, "-m", "jupyterlab", f"{WORKDIR}/START.ipynb",
               "--LabApp.default_url=/lab/tree/START.ipynb"] + ([] if browser else ["--no-browser"])
        print(_("course copy: {path}; starting: {cmd}").format(path=root / WORKDIR, cmd=" ".join(cmd[1:])))
        extra = [a for a in (lab_args or []) if a != "--"]
        if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
            extra.append("--allow-root")          # JupyterLab refuses root without it (Docker, WSL); say so
            print(_("running as root (a container?): JupyterLab starts only with --allow-root, added; run as an "
                    "ordinary user where you can"))
    return _run_lab(cmd + extra, root, lab_env(root, lang))


def lab_env(root: Path, lang: str) -> dict[str, str]:
    """The environment of the course's JupyterLab: ``PARLAB_LANG``, the interface settings of `lab_settings`, and
    a workspace folder of the working copy (``JUPYTERLAB_WORKSPACES_DIR``), so that the tabs the student had open
    in the course come back and no workspace of another JupyterLab reopens its notebooks and kernels here."""
    workspaces = Path(root) / WORKDIR / ".jupyterlab-workspaces"
    workspaces.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PARLAB_LANG": lang, **lab_settings(Path(root) / WORKDIR, lang),
            "JUPYTERLAB_WORKSPACES_DIR": str(workspaces.resolve())}


LANGUAGE_PACKS = {"zh_CN": "jupyterlab_language_pack_zh_CN"}    # the [zh] extra installs it
#: the code font of a course language whose characters are two columns wide: in Noto Sans Mono CJK a Chinese
#: character is exactly two Latin columns (65 px for 5 of them and for 10 letters at 13 px, measured in Chromium),
#: so the tables the lessons pad by display width (`parlab.i18n.columns`) line up; in a plain monospace font 5
#: Chinese characters took 65 px against 78 for 10 letters. Where the font is missing, the browser falls back.
CODE_FONTS = {"zh_CN": "'Noto Sans Mono CJK SC', 'Noto Sans Mono', monospace"}


def lab_settings(workdir: Path, lang: str) -> dict[str, str]:
    """Environment for a JupyterLab for a course in `lang`: for a language other than English, a settings folder
    of this working copy (``.jupyterlab-settings``) given to that server alone through ``JUPYTERLAB_SETTINGS_DIR``,
    which selects the JupyterLab language pack's locale where the pack is installed and the code font of
    `CODE_FONTS`; {} for English (the student's own JupyterLab settings are left alone)."""
    import importlib.util
    pack = LANGUAGE_PACKS.get(lang)
    has_pack = bool(pack) and importlib.util.find_spec(pack) is not None
    font = CODE_FONTS.get(lang)
    if not has_pack and not font:
        return {}
    folder = Path(workdir) / ".jupyterlab-settings"
    settings = {"apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}
    # (no "Would you like to get notified about official Jupyter news?" box over the lesson's figures)
    if has_pack:
        settings["translation-extension/plugin"] = {"locale": lang}
    if font:
        settings["apputils-extension/themes"] = {"overrides": {"code-font-family": font}}
    for name, values in settings.items():
        path = folder / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), encoding="utf-8")
    return {"JUPYTERLAB_SETTINGS_DIR": str(folder.resolve())}


def _run_lab(cmd: list[str], cwd: Path, env: dict | None = None) -> int:
    """Run JupyterLab until it exits, so that it always shuts down its own kernels. Ctrl+C reaches JupyterLab
    itself (same terminal, same process group): it asks whether to stop, and a second Ctrl+C stops it, kernels
    included, so this process only waits (`subprocess.call` would SIGKILL it on the first Ctrl+C and leave its
    kernels running). A SIGTERM sent to this process (a `kill`, a job scheduler) is passed on to JupyterLab.
    Its notebooks' kernels are forked by a kernel server (`warm_kernels`)."""
    with warm_kernels(dict(os.environ) if env is None else env) as env:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
        try:
            while True:
                try:
                    return proc.wait()
                except KeyboardInterrupt:
                    continue
        finally:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def warm_kernels(env: dict):
    """`env` for a Jupyter server whose ``python3`` kernels are forked by a `parlab.course.kernel_server` started
    here (a kernel spec of that name on ``JUPYTER_PATH``, in a temporary folder): a lesson's kernel is ready in
    about 0.1 s instead of 2-3 s of CPU importing torch, and its first `parlab.run` does not import torch._dynamo
    again. A kernel the server cannot fork (another interpreter, other thread variables) starts as usual, and so
    do all of them where the server does not start. The server and its kernels stop when the block ends."""
    from parlab.course.kernel import write_kernel_spec
    from parlab.course.kernel_server import KernelServer
    with KernelServer(env=env) as server, tempfile.TemporaryDirectory(prefix="parlab-kernels-") as folder:
        if not server.ready:
            yield env
            return
        write_kernel_spec(folder, server.address)
        yield {**env, "JUPYTER_PATH": os.pathsep.join(filter(None, [folder, env.get("JUPYTER_PATH")]))}
