"""parlab.course: the course as files. Lessons and exercises, how they are built, opened, checked and graded.

Read in this order:

* ``notebooks.py``  exercises generated from their solution notebooks (solution regions cut, nbgrader metadata
                     and checksums added), notebooks kept stripped, scorecards read (``parlab course build``).
* ``workspace.py``  a student's own copy of the course in ``my-course/``, opened in JupyterLab
                     (``parlab course open``); edited notebooks are never overwritten.
* ``handout.py``    offline HTML handouts of executed lessons: math typeset, widgets shown, no network.
* ``figcheck.py``   every lesson figure drawn by plotly.js in headless Chromium, checked and screenshotted
                     (``python -m parlab.course.figcheck``).
* ``grading/``      the checks an exercise's graded cells call, guarded so that parlab's own answer is
                     unavailable to the student and a deadlock is reported, not waited on.
* ``grader/``       ``parlab grade``: a class's submissions run in isolation, a gradebook and feedback.
"""
from parlab.course.notebooks import (BEGIN, END, PLACEHOLDER, ROOT, build, course_notebooks, dumps, execute,
                                     export_html, graded_cells, is_graded, make_exercise, nbgrader_checksum,
                                     nbgrader_metadata, read, scorecard, strip, strip_notebook, strip_solution,
                                     stripped_problems)

__all__ = ["BEGIN", "END", "PLACEHOLDER", "strip_solution", "make_exercise", "strip_notebook", "stripped_problems",
           "graded_cells", "read", "dumps", "build", "strip", "course_notebooks", "scorecard", "ROOT",
           "nbgrader_metadata", "nbgrader_checksum", "is_graded", "execute", "export_html"]
