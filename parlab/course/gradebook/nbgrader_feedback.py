"""nbgrader's feedback pages without a copy of plotly.js each: `PlotlyFromCDN`, which the course's
``exercises/nbgrader_config.py`` adds to ``nbgrader generate_feedback``.

An exercise draws with plotly's ``notebook`` renderer, which puts the whole plotly.js bundle (4.8 MB for plotly.js
4.1) into the first output of the notebook, so that figures draw offline. nbgrader's feedback is that notebook
exported to HTML: every student's page carried the bundle (5.0 MB for exercise 05, about 100 MB for a class of 20)
though the checks a student reads draw no figure. `PlotlyFromCDN` replaces the bundle with a script tag that loads
the same plotly.js version from plotly's CDN (``https://cdn.plot.ly/plotly-<version>.min.js``): exercise 05's page
shrinks to 167 KB (most of it nbgrader's page style), and a figure in it still draws where the student's browser
can reach the CDN.
"""
from __future__ import annotations

import re

from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

__all__ = ["PlotlyFromCDN", "BUNDLE_MIN_CHARS"]

#: an HTML output at least this long that names a plotly.js version is the bundle (a figure's own HTML is a <div>
#: and a call of Plotly.newPlot with its data, far smaller for the course's figures)
BUNDLE_MIN_CHARS = 500_000
_VERSION = re.compile(r"plotly\.js v(\d+\.\d+\.\d+)")


class PlotlyFromCDN(Preprocessor):
    """Replace the plotly.js bundle in a notebook's HTML outputs by a script tag loading it from plotly's CDN."""

    # nbconvert runs a preprocessor only when it is enabled (nbgrader's own are, by default): so is this one
    enabled = Bool(True, help="load plotly.js from its CDN in feedback pages").tag(config=True)

    def preprocess_cell(self, cell, resources, index):
        for out in cell.get("outputs", []):
            html = out.get("data", {}).get("text/html")
            text = "".join(html) if isinstance(html, list) else html
            if not text or len(text) < BUNDLE_MIN_CHARS:
                continue
            version = _VERSION.search(text)
            if version:
                out["data"]["text/html"] = (
                    "<script type=\"text/javascript\">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
                    f"<script src=\"https://cdn.plot.ly/plotly-{version[1]}.min.js\" charset=\"utf-8\"></script>")
        return cell, resources
