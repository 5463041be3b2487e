"""The nbval scorecard finds a notebook whose folder name holds a dot (dave.smith), which pytest's junit
classname ('submissions.dave.smith.00_ring_allreduce.ipynb') makes ambiguous."""
import shutil
from pathlib import Path

from parlab import course

ROOT = Path(__file__).resolve().parents[1]


def test_scorecard_finds_a_student_folder_with_a_dot(tmp_path):
    (tmp_path / "submissions" / "dave.smith").mkdir(parents=True)
    shutil.copy(ROOT / "exercises" / "00_ring_allreduce.ipynb", tmp_path / "submissions" / "dave.smith")
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="submissions.dave.smith.00_ring_allreduce.ipynb" name="Cell 2"/>'
                   '</testsuite></testsuites>')
    rows = course.scorecard(xml, root=tmp_path)
    assert [(r["file"], r["cell"], r["passed"]) for r in rows] == [
        ("submissions/dave.smith/00_ring_allreduce.ipynb", 2, True)]
    assert rows[0]["check"].startswith("Graded:")


def test_a_report_with_no_graded_check_is_refused(tmp_path, capsys):
    from parlab import cli
    xml = tmp_path / "empty.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="0"></testsuite></testsuites>')
    assert cli.main(["course", "scorecard", str(xml)]) == 2
    err = capsys.readouterr().err
    assert "holds no graded check" in err and "--nbval-lax" in err
