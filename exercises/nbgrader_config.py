# parlab's settings for a course graded by nbgrader 0.9 (exercises/README.md, "Grading with nbgrader"):
# copy this file into the course directory as nbgrader_config.py, or append it to the course's own.
c = get_config()  # noqa: F821  (nbgrader defines get_config when it loads this file)

from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor  # noqa: E402
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, GetGrades, IgnorePattern,  # noqa: E402
                                    LimitOutput, SaveAutoGrades)

# parlab.course.gradebook was named parlab.course.grader until issue 39: a course's older copy of this file, which
# imports the old path, keeps working unchanged (parlab/_moved.py maps the old path to these same modules)
from parlab.course.gradebook.nbgrader_execute import GuardedExecute  # noqa: E402
from parlab.course.gradebook.nbgrader_feedback import PlotlyFromCDN  # noqa: E402

# nbgrader's autograde steps, with its Execute replaced by parlab's GuardedExecute: a graded cell scores 0 when
# an answer cell rebound the grading code (as `parlab grade` reports "tampered"), and the demonstrations after
# the last graded cell are not run
c.Autograde.autograde_preprocessors = [GuardedExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
                                       SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
# nbgrader's default of 30 s per cell fails correct solutions whose checks start ranks; `parlab grade` allows
# 300 s a cell (--cell-timeout), and so does this. A deadlock inside a check is stopped by the check itself.
c.Execute.timeout = 300
# nbgrader's feedback steps, plus PlotlyFromCDN: each page loads plotly.js from plotly's CDN instead of carrying
# the 4.8 MB bundle the notebook renderer embeds (exercise 05's page: 5.0 MB before, 167 KB after)
c.GenerateFeedback.preprocessors = [GetGrades, CSSHTMLHeaderPreprocessor, PlotlyFromCDN]
