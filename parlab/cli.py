"""The ``parlab`` command.

    parlab course build [--check]        regenerate exercises/*.ipynb from exercises/solutions/*.ipynb
    parlab course strip [--check]        strip outputs and execution counts from the course notebooks
    parlab course scorecard results.xml  per-check pass/fail table from pytest --nbval-lax --junitxml
    parlab course html [NB ...] --out DIR  execute notebooks (default: the lessons) and export HTML pages
    parlab course open [--no-browser]    copy the course to my-course/ and open JupyterLab on its START page
    parlab grid --world 16 --tp 2 --pp 4 --gpus-per-node 8   print the rank groups of a layout
    parlab grade SUBMISSIONS [--out DIR] [--jobs N]   grade a folder of exercise submissions (parlab.course.gradebook)

Each subcommand is one ``add_<name>(subparsers)`` function that registers its
parser and sets ``func`` (a function of the parsed arguments returning the exit
status); a new command (``plan``, ``lab``) is one more such function added to
``COMMANDS``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from parlab.i18n.args import ArgumentParser
from parlab.i18n import _


def _language(code: str) -> str:
    """argparse type for --lang: "zh", "zh-CN", "zh_CN" -> "zh_CN", "en" -> "en"; else an error naming both."""
    from parlab.i18n import normalize
    try:
        return normalize(code) or "en"
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------------- parlab course ...
def _unreadable(paths) -> str | None:
    """One line naming the first notebook that cannot be read, or None when all can."""
    from parlab import course
    for p in paths:
        try:
            course.read(p)
        except Exception as e:  # nbformat raises several kinds (NotJSONError, ValidationError, UnicodeError...)
            return _("{path}: not a readable notebook ({error})").format(
                path=p, error=f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")
    return None


def _course_build(args) -> int:
    from parlab import course
    folder = Path(args.root) / "exercises" / "solutions"
    if not folder.is_dir():
        print("parlab course build: " + _("no such folder: {folder} (is --root the repository root?)").format(
            folder=folder), file=sys.stderr)
        return 2
    bad = _unreadable(sorted(folder.glob("*.ipynb")))
    if bad:
        print(f"parlab course build: {bad}", file=sys.stderr)
        return 2
    stale = course.build(args.root, check=args.check)
    for p in stale:
        print(f"{_('stale') if args.check else _('wrote')}: {p}")
    if args.check and stale:
        print(_("generated exercises are out of date: run `parlab course build` and commit the result"),
              file=sys.stderr)
        return 1
    if not stale:
        print(_("exercises are up to date"))
    return 0


def _course_strip(args) -> int:
    from parlab import course
    if not any((Path(args.root) / f).is_dir() for f in ("lessons", "exercises")):
        print("parlab course strip: " + _("no such folder: {folder} (is --root the repository root?)").format(
            folder=f"{Path(args.root) / 'lessons'} / {Path(args.root) / 'exercises'}"), file=sys.stderr)
        return 2
    bad = _unreadable(course.course_notebooks(args.root))
    if bad:
        print(f"parlab course strip: {bad}", file=sys.stderr)
        return 2
    dirty = course.strip(args.root, check=args.check)
    for p in dirty:
        print(f"{_('not stripped') if args.check else _('stripped')}: {p}")
    if args.check and dirty:
        print(_("notebooks carry outputs: run `parlab course strip` before committing"), file=sys.stderr)
        return 1
    if not dirty:
        print(_("all course notebooks are stripped"))
    return 0


def _course_scorecard(args) -> int:
    import xml.etree.ElementTree as ET
    from parlab import course
    if not Path(args.junit_xml).is_file():
        print("parlab course scorecard: " + _("no such file: {path}").format(path=args.junit_xml), file=sys.stderr)
        return 2
    try:
        rows = course.scorecard(args.junit_xml, root=args.root)
    except ET.ParseError as e:
        print("parlab course scorecard: " + _("{path} is not JUnit XML ({error})").format(path=args.junit_xml, error=e),
              file=sys.stderr)
        return 2
    if not rows:
        print("parlab course scorecard: " + _("{path} holds no graded check; make it with pytest --nbval-lax "
                                              "--junitxml {path} on exercise notebooks (their graded cells call "
                                              "grading.check_*)").format(path=args.junit_xml), file=sys.stderr)
        return 2
    import textwrap
    for r in rows:
        first = r["message"].splitlines()[0] if r["message"] else ""             # the reason, whole, wrapped
        print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['file']}  cell {r['cell']:>2}  {r['check']}"
              + ("\n" + textwrap.fill(first, 110, initial_indent=" " * 6, subsequent_indent=" " * 6) if first else ""))
    passed = sum(r["passed"] for r in rows)
    print(_("{passed}/{total} checks passed").format(passed=passed, total=len(rows)))
    return 0 if passed == len(rows) else 1


def _course_html(args) -> int:
    import tempfile

    from parlab import course
    from parlab.course.translated import translated_lesson
    paths = args.notebooks or sorted((course.ROOT / "lessons").glob("*.ipynb"))
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        print(_("parlab course html: no such notebook: {paths}").format(paths=", ".join(map(str, missing))),
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="parlab-html-") as tmp:
        if args.lang != "en":           # a lesson of the course in that language, run where the lesson sits
            folder = Path(tmp) / "lessons"
            folder.mkdir()
            for p in paths:
                (folder / Path(p).name).write_text(course.dumps(translated_lesson(Path(p), args.lang)),
                                                   encoding="utf-8")
            paths = [folder / Path(p).name for p in paths]
        for page in course.export_html(paths, args.out, timeout=args.timeout, lang=args.lang):
            print(_("wrote {page}").format(page=page))
    return 0


def _course_open(args) -> int:
    from parlab.course.workspace import open_course
    try:
        return open_course(args.root, browser=not args.no_browser, lab_args=args.lab_args, lang=args.lang)
    except FileNotFoundError as err:
        print(f"parlab course open: {err}", file=sys.stderr)
        return 2


def _course_i18n(args) -> int:
    """parlab course i18n update|check|build: keep the translations of the course's notebooks."""
    from parlab.i18n import notebooks as po
    from parlab.i18n import runtime_messages
    from parlab.i18n.review import counts, review
    lang = args.lang if args.lang != "en" else "zh_CN"
    if args.action == "update":
        from parlab.i18n.catalogue import update_catalogue
        for nb in po.course_sources(args.root):
            po.update(nb, lang, args.root)
        update_catalogue(lang)
        print(_("updated {n} translation files in {path}").format(
            n=len(po.course_sources(args.root)), path=Path(args.root) / "translations" / lang))
    if args.action == "build":
        from parlab.course.translated import write_course
        out = write_course(args.root, lang, args.out)
        print(_("wrote the course in {lang} to {path}").format(lang=lang, path=out))
        return 0
    from parlab.i18n.catalogue import missing_messages
    found = review(Path(args.root), lang)
    messages = missing_messages(lang)
    for problems in [*found.values(), messages]:
        if problems:
            print("\n".join(problems))
    c = counts(Path(args.root), lang)
    print(_("{translated}/{cells} prose cells, {strings_translated}/{strings} display strings and "
            "{labels_translated}/{labels} check names translated, {stale} stale").format(**c))
    print(_("{n} of {total} messages of parlab itself translated").format(
        n=len(runtime_messages()) - len(messages), total=len(runtime_messages())))
    return 1 if (found or messages) and args.action == "check" else 0


def add_course(sub) -> None:
    p = sub.add_parser("course", help=_("build exercises, strip notebooks, read grading results"))
    csub = p.add_subparsers(dest="course_command", required=True)
    b = csub.add_parser("build", help=_("regenerate exercises/*.ipynb from exercises/solutions/*.ipynb"))
    b.add_argument("--check", action="store_true", help=_("write nothing; exit 1 and list the stale exercises"))
    b.set_defaults(func=_course_build)
    s = csub.add_parser("strip", help=_("remove outputs and execution counts from lessons/ and exercises/"))
    s.add_argument("--check", action="store_true", help=_("write nothing; exit 1 and list the notebooks with outputs"))
    s.set_defaults(func=_course_strip)
    h = csub.add_parser("html", help=_("execute notebooks (default: every lesson) and export them as HTML pages"))
    h.add_argument("notebooks", nargs="*", type=Path)
    h.add_argument("--out", type=Path, default=Path("html"), help=_("folder for the pages (default: ./html)"))
    h.add_argument("--timeout", type=float, default=300.0, help=_("seconds one cell may run (default: 300)"))
    h.add_argument("--lang", type=_language, default=None,
                   help=_("the handouts' language: en or zh (default: PARLAB_LANG, else the locale, else en)"))
    h.set_defaults(func=_course_html)
    o = csub.add_parser("open", help=_("copy the lessons and exercises to my-course/ (your own, git-ignored copy; "
                                       "re-run after git pull) and open JupyterLab on my-course/START.ipynb"))
    o.add_argument("--no-browser", action="store_true", help=_("start JupyterLab without opening a browser"))
    o.add_argument("--lang", type=_language, default=None,
                   help=_("the course's language: en or zh (default: PARLAB_LANG, else the locale, else en)"))
    o.add_argument("lab_args", nargs=argparse.REMAINDER,
                   help=_("further options for JupyterLab after --, e.g. -- --port 8890"))
    o.set_defaults(func=_course_open)
    t = csub.add_parser("i18n", help=_("update, check or build the course's translations (translations/LANG/)"))
    t.add_argument("action", choices=["update", "check", "build"],
                   help=_("update: merge the notebooks' English into the PO files (changed cells marked stale); "
                          "check: list every missing or stale translation (exit 1 if any); build: write the "
                          "translated course to --out"))
    t.add_argument("--lang", type=_language, default="zh_CN", help=_("the translation's language (default: zh)"))
    t.add_argument("--out", type=Path, default=Path("course-zh"), help=_("folder for build (default: ./course-zh)"))
    t.set_defaults(func=_course_i18n)
    c = csub.add_parser("scorecard", help=_("per-check results from a pytest --junitxml file"))
    c.add_argument("junit_xml", type=Path)
    c.set_defaults(func=_course_scorecard)
    for q in (b, s, o, t):
        q.add_argument("--root", type=Path, default=None, help=_("repository root (default: this checkout)"))
    c.add_argument("--root", type=Path, default=Path("."), help=_("folder the tests were run from (default: .)"))


# ---------------------------------------------------------------------- parlab grid
MAX_GRID_RANKS = 65536   # `parlab grid` prints every group: 65536 ranks is ~450 KB of text in ~2 s


def _grid(args) -> int:
    from parlab.parallel.topology import ParallelGrid
    for k in ("world", "tp", "pp", "cp", "dp", "gpus_per_node", "ep", "etp"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            print(_("parlab grid: --{option} must be a positive integer, got {value}").format(
                option=k.replace("_", "-"), value=getattr(args, k)), file=sys.stderr)
            return 2
    if args.world > MAX_GRID_RANKS:
        print(_("parlab grid: at most {most} ranks (every group is printed), got --world {world}").format(
            most=MAX_GRID_RANKS, world=args.world), file=sys.stderr)
        return 2
    try:
        grid = ParallelGrid(args.world, tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, order=args.order,
                            gpus_per_node=args.gpus_per_node, ep=args.ep, etp=args.etp)
    except ValueError as e:
        print(f"parlab grid: {e}", file=sys.stderr)
        return 2
    print(grid.describe())
    if args.ep > 1 or args.etp is not None:     # the expert layers' grid on the same ranks
        print()
        print(_("expert layers (mixture of experts), on the same ranks:"))
        print(grid.expert.describe())
    return 0


def add_grid(sub) -> None:
    p = sub.add_parser("grid", help=_("print the tp/cp/dp/pp groups of a rank layout"))
    p.add_argument("--world", type=int, required=True, help=_("number of ranks (GPUs)"))
    for dim in ("tp", "pp", "cp"):
        p.add_argument(f"--{dim}", type=int, default=1, help=_("{dim} size (default 1)").format(dim=dim))
    p.add_argument("--dp", type=int, default=None, help=_("dp size (default: world / (tp*pp*cp))"))
    p.add_argument("--order", default="tp-cp-dp-pp", help=_("dims from fastest- to slowest-varying"))
    p.add_argument("--gpus-per-node", type=int, default=None, help=_("GPUs per node (default: all on one node)"))
    p.add_argument("--ep", type=int, default=1, help=_("expert-parallel size of the MoE layers (default 1); prints "
                                                         "their etp/ep/edp groups too"))
    p.add_argument("--etp", type=int, default=None, help=_("the experts' tensor-parallel size (default: --tp)"))
    p.set_defaults(func=_grid)


def add_plan(sub) -> None:
    p = sub.add_parser("plan", add_help=False, help=_("rank parallel layouts for a model on a cluster "
                                                      "(parlab plan --help for its options)"))
    p.add_argument("options", nargs="*", help=_("see parlab plan --help"))


def add_grade(sub) -> None:
    p = sub.add_parser("grade", help=_("grade a folder of exercise submissions: gradebook, feedback, summary"))
    try:
        from parlab.course.gradebook import add_arguments, run_from_args
    except ImportError:         # the library alone, without the course extra: _main says what to install
        return
    add_arguments(p)
    p.set_defaults(func=run_from_args)


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", add_help=False, help=_("measure this machine's collectives and matmuls into a "
                                                           "hardware description (parlab calibrate --help)"))
    p.add_argument("options", nargs="*", help=_("see parlab calibrate --help"))


# ---------------------------------------------------------------------- entry point
COMMANDS = [add_course, add_grid, add_plan, add_grade, add_calibrate]


def make_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="parlab", description=_("parlab: learn parallel training by running it"))
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:     # `parlab plan | head`: the reader left; stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error when Python flushes stdout
        return 141              # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe


def _course_packages_missing() -> list[str]:
    """The packages of the `course` extra that `parlab course` and `parlab grade` import and this environment
    lacks (a cluster install has the library alone: pyproject.toml); those commands import them anyway."""
    import importlib
    missing = []
    for name in ("nbformat", "nbclient", "plotly"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("PARLAB_LANG"):           # a language the course does not have: say so, not English silently
        from parlab.i18n import normalize
        try:
            normalize(os.environ["PARLAB_LANG"])
        except ValueError as e:
            print(f"parlab: PARLAB_LANG={os.environ['PARLAB_LANG']!r}: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["plan"]:  # the planner owns its options (see parlab.cluster.plan_cli.main)
        from parlab.cluster.plan_cli import main as plan_main
        return plan_main(argv[1:])
    if argv[:1] == ["calibrate"]:  # the calibration owns its options (see parlab.cluster.calibrate.main)
        from parlab.cluster.calibrate import main as calibrate_main
        return calibrate_main(argv[1:])
    missing = _course_packages_missing() if argv[:1] in (["course"], ["grade"]) else []
    if missing:
        print(_("parlab {command} needs the course's packages, and {missing} are not installed: pip install "
                "'parlab[course]' (in a clone: pip install -e '.[course]')").format(command=argv[0],
                                                                                     missing=", ".join(missing)),
              file=sys.stderr)
        return 2
    args = make_parser().parse_args(argv)
    if getattr(args, "lang", "unset") is None:
        from parlab.i18n import language
        args.lang = language()
    if getattr(args, "root", "unset") is None:
        from parlab.course import ROOT
        args.root = ROOT
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
