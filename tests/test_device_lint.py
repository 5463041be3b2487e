"""A lint (AST) over parlab/ for code that works on the CPU and breaks on a GPU.

Three patterns, each a bug class the NCCL review found (issue 18):
* a tensor factory (torch.zeros, torch.tensor, torch.frombuffer, ...) without ``device=``: the tensor lands on
  the CPU, and handed to NCCL (or mixed with CUDA tensors) it fails;
* ``.numpy()`` on a tensor that may live on a GPU (it raises there; ``.cpu().numpy()`` is fine);
* ``torch.load`` without ``map_location``: tensors come back on the device they were saved from (the saver's
  ``cuda:<index>``), which need not exist on the loading rank.
Every hit must be fixed or listed in ALLOWED with the reason it is benign. An entry that no longer matches
anything fails too, so the list stays honest.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "parlab"

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace", "eye", "rand", "randn",
             "randint", "randperm", "normal", "tensor", "as_tensor", "from_numpy", "frombuffer", "empty_strided",
             "tril_indices", "triu_indices"}

CPU_INPUTS = "grader inputs are built on the CPU from a seeded generator; graders run their ranks on gloo"
# folders under parlab/ whose code runs only on the CPU by design -> why
CPU_ONLY_DIRS = {"course/grading/": CPU_INPUTS + " (parlab.run's default backend): the checks never touch a GPU"}
# (file under parlab/, rule, source of the call) -> why it is benign
ALLOWED: dict[tuple[str, str, str], str] = {
    ("corpus.py", "factory", "torch.tensor(CharTokenizer().encode(make_text(n_chars, seed)), dtype=torch.long)"):
        "the corpus is built once on the CPU; the sampler moves each batch's indices to the tokens' device",
    ("corpus.py", "factory", "torch.randint(n_starts, (self.batch_size,), generator=g)"):
        "a CPU generator draws the starts (same stream on every device); moved with idx.to(tokens.device)",
    ("corpus.py", "factory", "torch.arange(self.seq_len)"):
        "added to the CPU starts, then the indices move with idx.to(self.tokens.device)",
    ("parallel/data/naive.py", "factory", "torch.tensor(x.shape)"):
        "copied into a slice of `meta` (on the input's device) by assignment, which copies across devices",
    ("models/moe.py", "factory", "torch.arange(rows)"):
        "MoE.group_order builds token indices on the CPU (positions brought there with .cpu()); forward moves the "
        "order to x.device before indexing",
    ("parallel/hybrid.py", "factory", "torch.arange(seq_len)"):
        "routing_groups returns index data for the one-process reference's MoE.positions, which group_order reads "
        "on the CPU",
    ("parallel/context/ring_plan.py", "factory", "torch.arange(j * size, (j + 1) * size)"):
        "shard_positions returns index data on the CPU; shard_sequence moves it to x.device before use",
    ("labs/context_parallel.py", "factory", "torch.zeros(1, lab.args.seq_len)"):
        "only checks that the sequence splits (cp.shard raises on a bad length); never computed with",
    ("cluster/calibrate/fit.py", "factory", "torch.tensor([[row[j] / row[ncols] for j in keep] for row in samples], dtype=torch.float64)"):
        "a least-squares fit of a few timing samples (host numbers, never communicated)",
    ("cluster/calibrate/fit.py", "factory", "torch.ones(len(samples), 1, dtype=torch.float64)"):
        "a least-squares fit of a few timing samples (host numbers, never communicated)",
    ("parallel/zero/optimizer_state.py", "factory", "torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)"):
        "the pickled state's bytes; moved to the rank's device by the .to(self._device) that follows",
}


def _on_cpu(node: ast.expr) -> bool:
    """`x.cpu()` / `x.detach().cpu()` / `x.to("cpu")`: the receiver of .numpy() is surely on the CPU."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr == "cpu":
        return True
    return node.func.attr == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args)


def lint(source: str) -> list[tuple[str, int, str]]:
    """(rule, line, source of the call) for every hit in `source`."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f, kw = node.func, {k.arg for k in node.keywords}
        rule = None
        if isinstance(f.value, ast.Name) and f.value.id == "torch":
            if f.attr in FACTORIES and "device" not in kw:
                rule = "factory"
            elif f.attr == "load" and "map_location" not in kw:
                rule = "load"
        elif f.attr == "numpy" and not _on_cpu(f.value):
            rule = "numpy"
        if rule:
            hits.append((rule, node.lineno, ast.get_source_segment(source, node)))
    return sorted(hits, key=lambda h: h[1])


def test_the_lint_finds_each_pattern():
    src = ("import torch\n"
           "a = torch.zeros(3)\n"                                 # factory without device
           "b = torch.zeros(3, device=x.device)\n"                # fine
           "c = torch.frombuffer(buf, dtype=torch.uint8)\n"       # always the CPU
           "d = t.numpy()\n"                                      # may be CUDA
           "e = t.detach().cpu().numpy()\n"                       # fine
           "f = torch.load(p)\n"                                  # saver's device
           "g = torch.load(p, map_location='cpu')\n"              # fine
           "h = torch.zeros_like(t)\n")                           # fine: follows t
    assert [(r, line) for r, line, _ in lint(src)] == [("factory", 2), ("factory", 4), ("numpy", 5), ("load", 7)]


def test_parlab_has_no_unexplained_cpu_only_code():
    seen, bad = set(), []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(d) for d in CPU_ONLY_DIRS):
            continue
        for rule, line, seg in lint(path.read_text()):
            key = (rel, rule, seg)
            if key in ALLOWED:
                seen.add(key)
            else:
                bad.append(f"parlab/{rel}:{line} {rule}: {seg}")
    assert not bad, ("tensors that stay on the CPU (or .numpy() / torch.load that break on a GPU); pass "
                     "device=..., use .cpu().numpy(), torch.load(..., map_location='cpu'), or add an ALLOWED entry "
                     "with the reason it is benign:\n" + "\n".join(bad))
    stale = sorted(k for k in set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())
