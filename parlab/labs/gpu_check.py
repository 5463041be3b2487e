"""The first run on GPUs, in one command: every lab under torchrun on the N GPUs of one node (NCCL), then the
suite's GPU tests, and a results table to paste into parlab/labs/README.md ("Status on GPUs").

    python -m parlab.labs.gpu_check                    # all GPUs of this node, default sizes
    python -m parlab.labs.gpu_check --gpus 4 --size medium --steps 50 --out gpu_first_run.md
    python -m parlab.labs.gpu_check --dry-run          # print the commands, run nothing (works without a GPU)

Each lab runs as ``python -m torch.distributed.run --standalone --nproc_per_node=N -m parlab.labs.NAME
--backend nccl ...`` (its own process tree, so a lab that hangs or crashes is stopped after --timeout and
reported, and the next one still runs); its whole output goes to ``LOGDIR/NN_NAME.log`` and its trace next to
it. The table gives, per run, the exit status, the loss, tokens/s and the largest per-rank memory from the
lab's ``summary:`` line (on GPUs ``torch.cuda.max_memory_allocated``, construction included) and the wall
time. Then ``pytest`` runs the GPU tests (tests/gpu/test_gpu.py: NCCL collectives, CUDA-event timing, meta
construction on the device; tests/test_labs.py: the labs' own checks, which pick NCCL when there are GPUs
and start up to 4 ranks, so they need 4 GPUs), each file on its own, and the table gives their summary lines.

Without CUDA it stops at once, saying so (``no CUDA device: ...``); `--dry-run` still prints the plan.
The sizes: ``small`` (seconds per lab) and ``medium`` (a GPT-2-small-like width); the layouts need N in
{1, 2, 4, 8} (heads, vocabulary and layers are chosen divisible by it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from parlab.i18n.args import ArgumentParser
from parlab.i18n import _

__all__ = ["parser", "plan", "LabRun", "check_cuda", "parse_summary", "table", "main"]

SIZES = {   # model and batch per preset; layers are raised to 2 N for the interleaved pipeline
    "small": dict(layers=4, hidden=256, heads=8, seq_len=256, vocab=64, batch_per_gpu=4),
    "medium": dict(layers=12, hidden=768, heads=16, seq_len=1024, vocab=128, batch_per_gpu=8),
}
GPU_COUNTS = (1, 2, 4, 8)
TESTS = ("tests/gpu/test_gpu.py", "tests/test_labs.py")


@dataclass
class LabRun:
    """One lab command of the plan: the lab, its own options and the shared ones."""
    lab: str
    options: list[str]
    shared: list[str] = field(default_factory=list)

    def argv(self, gpus: int, python: str = sys.executable) -> list[str]:
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                "-m", f"parlab.labs.{self.lab}", "--backend", "nccl", *self.shared, *self.options]

    @property
    def title(self) -> str:
        return " ".join([self.lab, *self.options])


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m parlab.labs.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help=_("GPUs (ranks) per lab; default: all of this node's"))
    p.add_argument("--size", choices=sorted(SIZES), default="small", help=_("model and batch preset"))
    p.add_argument("--steps", type=int, default=20, help=_("training steps per lab"))
    p.add_argument("--only", nargs="+", default=None, metavar="LAB", help=_("run only these labs"))
    p.add_argument("--no-tests", action="store_true", help=_("skip the pytest part"))
    p.add_argument("--timeout", type=float, default=600.0, help=_("seconds per lab before it is stopped"))
    p.add_argument("--out", default="gpu_first_run.md", help=_("the results table (markdown)"))
    p.add_argument("--logdir", default="gpu_first_run_logs", help=_("one log and one trace per lab run"))
    p.add_argument("--dry-run", action="store_true", help=_("print the commands and stop (no GPU needed)"))
    return p


def plan(gpus: int, size: str = "small", steps: int = 20, only: list[str] | None = None) -> list[LabRun]:
    """The lab runs for `gpus` GPUs: every lab at least once, the schedules and options that touch different
    NCCL paths (sequence parallelism, interleaved and zero-bubble pipelines, ring and Ulysses attention,
    ZeRO 1/2/3, bf16 mixed precision), and a hybrid layout that uses every dimension the GPU count allows."""
    from parlab.labs import LABS
    if gpus not in GPU_COUNTS:
        raise ValueError(_("--gpus must be one of {counts} (the layouts split heads, vocabulary and layers "
                           "by it), got {gpus}").format(counts=GPU_COUNTS, gpus=gpus))
    if steps < 2:
        raise ValueError(_("--steps must be at least 2 (tokens/s is timed from the second step), got {steps}").format(
            steps=steps))
    unknown = sorted(set(only or ()) - set(LABS))
    if unknown:
        raise ValueError(_("--only: unknown labs {unknown}; the labs are {labs}").format(unknown=unknown,
                                                                                       labs=list(LABS)))
    s = SIZES[size]
    n = gpus
    layers = max(s["layers"], 2 * n)
    shared = ["--layers", str(layers), "--hidden", str(s["hidden"]), "--heads", str(s["heads"]),
              "--seq-len", str(s["seq_len"]), "--vocab", str(s["vocab"]), "--batch", str(s["batch_per_gpu"] * n),
              "--steps", str(steps), "--quiet"]
    m = str(2 * n)                                              # micro-batches: batch_per_gpu * n divides by 2n
    hybrid = {1: [], 2: ["--tp", "2"], 4: ["--tp", "2", "--pp", "2"],
              8: ["--tp", "2", "--pp", "2", "--zero", "1"]}[n]  # 8: dp 2 with ZeRO-1
    runs = [
        LabRun("data_parallel", []),
        LabRun("data_parallel", ["--dtype", "bfloat16"]),
        LabRun("zero", ["--stage", "1"]), LabRun("zero", ["--stage", "2"]), LabRun("zero", ["--stage", "3"]),
        LabRun("tensor_parallel", []), LabRun("tensor_parallel", ["--sp"]),
        LabRun("pipeline", ["--schedule", "1f1b", "--microbatches", m]),
        LabRun("pipeline", ["--schedule", "interleaved", "--chunks", "2", "--microbatches", m]),
        LabRun("pipeline", ["--schedule", "zb-h1", "--microbatches", m, "--dtype", "bfloat16"]),
        LabRun("context_parallel", ["--attention", "ring"]),
        LabRun("context_parallel", ["--attention", "ulysses"]),
        LabRun("expert_parallel", ["--experts", str(2 * n), "--capacity-factor", "1.25", "--dtype", "bfloat16"]),
        LabRun("hybrid", hybrid),
    ]
    if n >= 4:
        runs.append(LabRun("hybrid", ["--tp", "2", "--cp", "2", "--sp"] if n == 4 else
                           ["--tp", "2", "--pp", "2", "--cp", "2", "--sp"]))
        runs.append(LabRun("hybrid", ["--pp", "2", "--ep", "2", "--experts", str(n), "--zero", "1",
                                      "--microbatches", "4"]))   # 5D: experts over the dp ranks, ZeRO-1
    for r in runs:
        r.shared = shared
    return [r for r in runs if only is None or r.lab in only]


def check_cuda(gpus: int | None) -> int:
    """The number of GPUs to use; SystemExit with the reason when CUDA is missing or has too few devices."""
    import torch
    if not torch.cuda.is_available():
        built = torch.version.cuda or _("none (a CPU-only build)")
        raise SystemExit(_("no CUDA device: torch.cuda.is_available() is False (torch {torch}, CUDA {cuda}). Run "
                           "this on a node with GPUs and a CUDA build of torch; on a CPU the labs run with gloo (see "
                           "parlab/labs/README.md), and --dry-run prints the plan.").format(
            torch=torch.__version__, cuda=built))
    count = torch.cuda.device_count()
    gpus = count if gpus is None else gpus
    if gpus > count:
        raise SystemExit(_("--gpus {gpus} but this node has {count} CUDA device(s); pass --gpus {count} or "
                           "fewer").format(gpus=gpus, count=count))
    return gpus


_SUMMARY = re.compile(r"^summary: lab=(?P<lab>\w+) world=(?P<world>\d+) backend=(?P<backend>\w+) steps=\d+ "
                      r"loss=(?P<loss>\S+) tokens/s=(?P<tps>\d+) max_mem/rank=(?P<mem>[\d.]+) MB", re.M)


def parse_summary(output: str) -> dict | None:
    """The fields of a lab's ``summary:`` line (None when the lab printed none: it failed before the end)."""
    found = _SUMMARY.search(output)
    return None if found is None else found.groupdict()


def table(rows: list[dict], header: list[str]) -> str:
    """A markdown table of `rows` (dicts) with the columns `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows]
    return "\n".join(lines)


def _environment() -> str:
    import torch
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:                                           # a build without NCCL
        nccl = "none"
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {torch.cuda.device_count()} x "
            f"{', '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
            f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _run(argv: list[str], log: str, timeout: float) -> tuple[int | str, str, float]:
    """Run `argv` in its own process group (torchrun and its workers), output to `log`; past `timeout` the
    whole group is killed, so no worker is left holding a GPU."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _err = proc.communicate()
        code = f"timeout {timeout:g} s"
    with open(log, "w") as f:
        f.write(shlex.join(argv) + "\n\n" + out)
    return code, out, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        p.error(_("--gpus must be a positive number of GPUs, got {gpus}").format(gpus=args.gpus))
    if not args.timeout > 0:
        p.error(_("--timeout must be a positive number of seconds, got {timeout}").format(timeout=args.timeout))
    try:
        runs = plan(args.gpus or 1, args.size, args.steps, args.only) if args.dry_run else None
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        for r in runs:
            print(shlex.join(r.argv(args.gpus or 1, "python")))
        if not args.no_tests:
            for t in TESTS:
                print(shlex.join(["python", "-m", "pytest", "-q", t]))
        return 0
    gpus = check_cuda(args.gpus)
    try:
        runs = plan(gpus, args.size, args.steps, args.only)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(args.logdir, exist_ok=True)
    rows = []
    for i, r in enumerate(runs):
        stem = os.path.join(args.logdir, f"{i:02d}_{r.lab}")
        code, out, wall = _run(r.argv(gpus) + ["--trace", stem + ".json"], stem + ".log", args.timeout)
        s = parse_summary(out) or {}
        rows.append({"lab (options)": f"`{r.title}`", "exit": code, "backend": s.get("backend", "-"),
                     "loss": s.get("loss", "-"), "tokens/s": s.get("tps", "-"),
                     "max mem/rank (MB)": s.get("mem", "-"), "wall (s)": f"{wall:.1f}", "log": stem + ".log"})
        print(_("[{i}/{n}] {title}: exit {code}, {wall:.1f} s").format(i=i + 1, n=len(runs), title=r.title,
                                                                        code=code, wall=wall), flush=True)
    test_rows = []
    if not args.no_tests:
        for t in TESTS:
            log = os.path.join(args.logdir, "pytest_" + os.path.basename(t).replace(".py", ".log"))
            code, out, wall = _run([sys.executable, "-m", "pytest", "-q", t], log, 4 * args.timeout)
            last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
            test_rows.append({"tests": t, "exit": code, "summary": last[0].strip("= "), "wall (s)": f"{wall:.1f}"})
            print(_("pytest {tests}: exit {code}, {summary}").format(tests=t, code=code, summary=last[0]), flush=True)
    size = SIZES[args.size]
    doc = [f"### First run on GPUs ({_environment()})", "",
           f"`python -m parlab.labs.gpu_check --gpus {gpus} --size {args.size} --steps {args.steps}`: "
           f"{gpus} ranks (NCCL), model {size}, layers raised to >= 2 x GPUs; logs and traces in "
           f"`{args.logdir}/`.", "",
           table(rows, ["lab (options)", "exit", "backend", "loss", "tokens/s", "max mem/rank (MB)", "wall (s)"])]
    if test_rows:
        doc += ["", table(test_rows, ["tests", "exit", "summary", "wall (s)"])]
    with open(args.out, "w") as f:
        f.write("\n".join(doc) + "\n")
    print(_("results table: {path}").format(path=args.out))
    failed = [r for r in rows if r["exit"] != 0] + [r for r in test_rows if r["exit"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
