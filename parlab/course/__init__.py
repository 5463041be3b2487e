"""parlab.course: the course as files. Lessons and exercises, how they are built, opened, checked and graded.

Read in this order:

* ``notebooks.py``  exercises generated from their solution notebooks (solution regions cut, nbgrader metadata
                     and checksums added; each solution is itself an nbgrader source notebook), notebooks kept
                     stripped, scorecards read (``parlab course build``).
* ``kernel.py``     notebooks run in a fresh kernel (waits in slices, a start that dies retried), lessons
                     exported as HTML.
* ``kernel_server.py`` a warm server that forks those kernels with torch and parlab already imported (0.1 s of
                     CPU to start instead of 2-3.5 s): the grader, nbgrader's autograde and the figure check.
* ``workspace.py``  a student's own copy of the course in ``my-course/``, opened in JupyterLab
                     (``parlab course open``); edited notebooks are never overwritten.
* ``translated.py`` the course in another language: lessons and exercises built from the English and their
                     PO files (``parlab course open --lang zh``, ``parlab course i18n build``).
* ``handout.py``    offline HTML handouts of executed lessons: math typeset, widgets shown, no network.
* ``figcheck.py``   every lesson figure drawn by plotly.js in headless Chromium, checked and screenshotted
                     (``python -m parlab.course.figcheck``).
* ``figpage.py``    its page: one Chromium page holding plotly.js that draws each figure and measures it
                     (``Browser``, kept open for many checks), and the font check for missing glyphs.
* ``grading/``      the checks an exercise's graded cells call, guarded so that parlab's own answer is
                     unavailable to the student and a deadlock is reported, not waited on.
* ``gradebook/``    ``parlab grade``: a class's submissions run in isolation, a gradebook and feedback.
"""
from __future__ import annotations

import importlib

__all__ = ["BEGIN", "END", "PLACEHOLDER", "strip_solution", "make_exercise", "make_source", "strip_notebook", "stripped_problems",
           "graded_cells", "read", "dumps", "build", "strip", "course_notebooks", "scorecard", "ROOT",
           "nbgrader_metadata", "nbgrader_checksum", "is_graded", "execute", "export_html"]


def __getattr__(name: str):
    """PEP 562: the names above load ``notebooks.py`` or ``kernel.py`` (and nbformat, whose schema validator costs most of a second
    to import) on first use, so an exercise's kernel that imports only ``parlab.course.grading`` skips it."""
    if name not in __all__:
        raise AttributeError(f"module 'parlab.course' has no attribute {name!r}")
    home = "parlab.course.kernel" if name in ("execute", "export_html") else "parlab.course.notebooks"
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
