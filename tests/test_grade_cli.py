"""`parlab grade` says what is wrong with its input: a missing folder, a file that names no exercise."""
import nbformat
import pytest

from parlab import cli


def test_missing_folder_is_refused(tmp_path, capsys):
    assert cli.main(["grade", str(tmp_path / "nope"), "--out", str(tmp_path / "g")]) == 2
    assert "is not a folder of submissions" in capsys.readouterr().err


def test_a_file_that_names_no_exercise_is_skipped_and_reported(tmp_path, capsys):
    (tmp_path / "subs").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), str(tmp_path / "subs" / "my_homework.ipynb"))
    assert cli.main(["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "skipped: my_homework.ipynb: no released exercise matches this file name; rename it" in out
    assert "my_homework.ipynb" in (tmp_path / "g" / "summary.html").read_text(encoding="utf-8")
    assert (tmp_path / "g" / "gradebook.csv").read_text(encoding="utf-8").startswith("student,exercise,status")


def test_a_language_the_course_does_not_have_is_refused_naming_the_ones_it_has(tmp_path, capsys):
    (tmp_path / "subs").mkdir()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "g"), "--lang", "fr"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--lang" in err and "'fr'" in err and "en" in err and "zh_CN" in err
    assert not (tmp_path / "g").exists()                  # refused before anything ran
