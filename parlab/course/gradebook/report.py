"""The grading reports: a gradebook CSV (and JSON), one feedback file per student, a class summary page.

* ``gradebook.csv``: one row per student and exercise: status, passed, total, points, max_points, then one
  column per check of the batch (``EXERCISE:grade_id``) holding ``pass``, ``fail`` or nothing (not part of
  that exercise). Totals count the released exercise's graded cells, never what a submission still holds.
* ``gradebook.json``: the same with every check's message and full traceback (the junit-style record).
* ``feedback/<student>.md``: per exercise the status, what was restored, and each check's message.
* ``summary.html``: the pass rate of every check over the class, a plotly bar chart (plotly.js inlined, so
  it opens offline), so a lecturer sees which step the class struggles with.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from parlab.i18n import _

__all__ = ["write_all", "write_csv", "feedback_markdown", "summary_figure", "safe_name", "status_name"]

STATUSES = ("ok", "missing", "timeout", "crashed", "tampered")


def status_name(status: str) -> str:
    """A notebook's status as a reader sees it (the gradebook files keep the code: ok, missing, ...)."""
    return {"ok": _("ok"), "missing": _("missing"), "timeout": _("timeout"), "crashed": _("crashed"),
            "tampered": _("tampered")}.get(status, status)


def safe_name(name: str) -> str:
    """A file name for a student: path separators and control characters replaced, letters kept."""
    return re.sub(r'[\\/:*?"<>|\x00-\x1f]', "_", name).strip() or "unknown"


def _check_columns(results) -> list[str]:
    cols = []
    for r in results:
        for c in r.checks:
            col = f"{r.exercise}:{c['grade_id']}"
            if col not in cols:
                cols.append(col)
    return cols


def write_csv(results, path: Path) -> None:
    cols = _check_columns(results)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "exercise", "status", "passed", "total", "points", "max_points", *cols])
        for r in results:
            mine = {f"{r.exercise}:{c['grade_id']}": ("pass" if c["passed"] else "fail") for c in r.checks}
            w.writerow([r.student, r.exercise, r.status, r.passed, len(r.checks), f"{r.points:g}",
                        f"{r.max_points:g}", *[mine.get(c, "") for c in cols]])


def feedback_markdown(student: str, results) -> str:
    lines = ["# " + _("Feedback for {student}").format(student=student), ""]
    for r in results:
        lines += ["## " + _("{exercise}: {points:g} / {max_points:g} points ({status})").format(
            exercise=r.exercise, points=r.points, max_points=r.max_points, status=status_name(r.status)), ""]
        for n in r.notes:
            lines.append(f"* {n}")
        if r.notes:
            lines.append("")
        for c in r.checks:
            mark = _("PASS") if c["passed"] else _("FAIL")
            lines.append("### " + _("{mark}: {check}").format(mark=mark, check=c["label"]))
            if not c["passed"] and c["message"]:
                lines += ["", "```", c["message"].strip(), "```"]
            lines.append("")
    return "\n".join(lines)


def summary_figure(results):
    """Pass rate per check over the submissions that were handed in (plotly bar chart)."""
    import plotly.graph_objects as go
    rows: dict[str, list[int]] = {}
    labels, hover = {}, {}
    for r in results:
        if r.status == "missing":
            continue
        for c in r.checks:
            key = f"{r.exercise}:{c['grade_id']}"
            labels[key] = f"{r.exercise[:2]} {c['grade_id'].split('-')[0]}"     # short: the check's name
            hover[key] = f"{r.exercise}: {c['label']}"                            # the whole sentence on hover
            rows.setdefault(key, []).append(int(c["passed"]))
    keys = list(rows)
    rate = [100.0 * sum(rows[k]) / len(rows[k]) for k in keys]
    fig = go.Figure(go.Bar(x=rate, y=[labels[k] for k in keys], orientation="h",
                           text=[_("{rate} of {n}").format(rate=f"{v:.0f}%", n=len(rows[k])) for v, k in zip(rate, keys)],
                           hovertext=[hover[k] for k in keys], marker_color=["#d62728" if v < 50 else "#1f77b4" for v in rate]))
    fig.update_layout(title=_("Pass rate per check (submissions handed in)"), xaxis_title=_("% passed"),
                      xaxis_range=[0, 100], yaxis_autorange="reversed", height=200 + 28 * len(keys),
                      yaxis_automargin=True, margin=dict(l=20, r=20, t=60, b=40))
    return fig


def _status_table(results) -> str:
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        counts.setdefault(r.exercise, {}).setdefault(r.status, 0)
        counts[r.exercise][r.status] += 1
    head = "".join(f"<th>{status_name(s)}</th>" for s in STATUSES)
    body = "".join(f"<tr><td>{ex}</td>" + "".join(f"<td>{c.get(s, 0)}</td>" for s in STATUSES) + "</tr>"
                   for ex, c in sorted(counts.items()))
    return "<table border=1 cellpadding=4><tr><th>" + _("exercise") + f"</th>{head}</tr>{body}</table>"


def write_all(results, out: Path, problems=()) -> None:
    import plotly.io as pio
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "gradebook.csv")
    (out / "gradebook.json").write_text(json.dumps(
        [{"student": r.student, "exercise": r.exercise, "status": r.status, "points": r.points,
          "max_points": r.max_points, "notes": r.notes, "seconds": round(r.seconds, 2), "checks": r.checks}
         for r in results], indent=1, ensure_ascii=False), encoding="utf-8")
    fb = out / "feedback"
    fb.mkdir(exist_ok=True)
    for student in sorted({r.student for r in results}):
        text = feedback_markdown(student, [r for r in results if r.student == student])
        (fb / f"{safe_name(student)}.md").write_text(text, encoding="utf-8")
    fig = summary_figure(results)
    skipped = "".join(f"<li>{p}</li>" for p in problems)
    page = ("<html><head><meta charset='utf-8'><title>" + _("parlab grading summary") + "</title></head><body>"
            "<h1>" + _("Grading summary") + "</h1><p>"
            + _("{notebooks} notebooks, {students} students.").format(notebooks=len(results),
                                                                      students=len({r.student for r in results}))
            + f"</p>{_status_table(results)}"
            + ("<h2>" + _("Files skipped") + f"</h2><ul>{skipped}</ul>" if skipped else "")
            + pio.to_html(fig, include_plotlyjs=True, full_html=False) + "</body></html>")
    (out / "summary.html").write_text(page, encoding="utf-8")
