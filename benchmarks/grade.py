"""Time ``parlab grade`` on a class: N submissions of one exercise, graded side by side.

The submissions are made from the released exercise and its solution: a third answered, a third blank, a third
with one part deadlocking (every rank sends first), so the run includes the three kinds of work a real class
brings (all checks passing, failing fast, deadlock detection). Prints the wall time, notebooks per minute, the
per-notebook times and the load average before and after.

    python benchmarks/grade.py [--students 20] [--exercise 00_ring_allreduce] [--jobs 2]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parlab import course                       # noqa: E402
from parlab.course.gradebook import Limits, grade          # noqa: E402

DEADLOCK = """def ring_reduce_scatter(chunks):
    rank, n = comm.get_rank(), comm.get_world_size()
    for step in range(n - 1):
        comm.send(chunks[(rank - 1 - step) % n], dst=(rank + 1) % n)
        buf = torch.empty_like(chunks[0])
        comm.recv(buf, src=(rank - 1) % n)
        chunks[(rank - 2 - step) % n] += buf
"""


def make_class(folder: Path, stem: str, n: int) -> None:
    ex = course.read(ROOT / "exercises" / f"{stem}.ipynb")
    sol = course.read(ROOT / "exercises" / "solutions" / f"{stem}.ipynb")
    for k in range(n):
        nb = nbformat.from_dict(ex)
        kind = k % 3
        for cell, done in zip(nb.cells, sol.cells):
            if cell.metadata["nbgrader"]["solution"] and kind != 1:
                cell.source = done.source
            if kind == 2 and cell.metadata["nbgrader"]["grade_id"] == "answer-ring_reduce_scatter":
                cell.source = DEADLOCK
        (folder / f"student{k:02d}").mkdir()
        nbformat.write(nb, str(folder / f"student{k:02d}" / f"{stem}.ipynb"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--exercise", default="00_ring_allreduce")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        subs, out = Path(tmp) / "submissions", Path(tmp) / "grades"
        subs.mkdir()
        make_class(subs, a.exercise, a.students)
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        results = grade(subs, out, jobs=a.jobs, limits=Limits(), progress=lambda *_: None)
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()
        rows = list(csv.DictReader(open(out / "gradebook.csv", encoding="utf-8")))
    per = [r.seconds for r in results]
    print(f"{len(results)} notebooks of {a.exercise}, --jobs {a.jobs}: {wall:.1f} s wall, "
          f"{60 * len(results) / wall:.1f} notebooks/min; per notebook median {statistics.median(per):.1f} s, "
          f"max {max(per):.1f} s")
    print("points:", sorted(int(r["passed"]) for r in rows), " statuses:", sorted({r["status"] for r in rows}))
    print(f"load average before {load0[0]:.1f}, after {load1[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
