"""The README's Python examples run as written (each as a script of its own, as a reader would paste it)."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2                                  # "Ten lines of parlab" and "A virtual cluster"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"example{i}" for i in range(len(BLOCKS))])
def test_a_readme_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()                                # every example prints what it shows
    assert "Warning" not in out.stderr, out.stderr[-3000:]   # no warnings in normal use
