"""Sharded checkpoints (parlab.parallel.zero.checkpoint, FSDP and ZeRO save/load): exact resharding across world sizes,
and one case per fault: each damaged checkpoint raises CheckpointError naming the file and what is wrong."""
import glob
import os
import re
import shutil

import pytest
import torch

import parlab
from parlab import comm
from parlab.parallel.zero import checkpoint
from parlab.parallel.zero import CheckpointError
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel as FSDP
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 8
ADAMW = dict(lr=1e-2, weight_decay=0.1)
# float64: a resumed run differs from the uninterrupted single-process one only in the order of additions
# (the mean of per-rank means, an averaging reduce-scatter), ~1e-16 relative per step; AdamW may amplify
# that a little over 3 steps, so 1e-10 leaves room for that and nothing else (a lost m or v would be ~1e-3).
TOL = dict(rtol=0, atol=1e-10)


def sampler():
    return BatchSampler(load_corpus(4000), batch_size=BATCH, seq_len=CFG.seq_len, seed=1)


def make():
    return GPT(CFG, seed=0, dtype=torch.float64)


def reference(steps):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for t in range(steps):
        x, y = sampler().global_batch(t)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _build(kind):
    model = make()
    if kind == "fsdp":
        model = FSDP(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, **ADAMW)


def _params(kind, model):
    return model.full_parameters() if kind == "fsdp" else {n: p.detach().clone() for n, p in model.named_parameters()}


def _save(kind, saves: dict):
    """Train; after step t (1-based) save to saves[t]. Returns the parameters at each save."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model, opt = _build(kind)
    out = {}
    for t in range(max(saves)):
        x, y = sampler().shard(t, rank, world)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        if t + 1 in saves:
            (model.save_sharded(saves[t + 1], opt) if kind == "fsdp" else opt.save_sharded(saves[t + 1]))
            out[t + 1] = _params(kind, model)
    return out


def _resume(kind, path, start, steps):
    """Load `path` at this world size, train `steps` more from step `start`; the loaded and final parameters."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model, opt = _build(kind)
    model.load_sharded(path, opt) if kind == "fsdp" else opt.load_sharded(path)
    loaded = _params(kind, model)
    for t in range(start, start + steps):
        x, y = sampler().shard(t, rank, world)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return {"loaded": loaded, "params": _params(kind, model)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """FSDP checkpoints at world 2 after 2 steps (a) and 3 steps (b), and at world 4 after 2 steps (w4)."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {k: str(root / k) for k in ("a", "b", "w4")}
    params = parlab.run(_save, 2, "fsdp", {2: dirs["a"], 3: dirs["b"]})[0]
    parlab.run(_save, 4, "fsdp", {2: dirs["w4"]})
    return dirs, params


def verify(path, kind="fsdp"):
    """What a loader does before touching a model: the manifest, then every file against it."""
    manifest = checkpoint.read_manifest(path, kind)
    return [checkpoint.load_file(path, manifest, r) for r in range(manifest["world_size"])]


def shard(d, rank, world=2, kind="fsdp"):
    """The path of rank `rank`'s shard in folder `d` (its name carries the save's id: fsdp_1_of_2.3f9a61c2.pt)."""
    found = glob.glob(f"{d}/{kind}_{rank}_of_{world}.*.pt")
    assert len(found) == 1, found
    return found[0]


def _flip(path, at=0.5):
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        i = int(len(data) * at)
        data[i] ^= 0x01
        fh.seek(0)
        fh.write(data)


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _garbage(path):
    # fixed bytes, neither a zip nor a pickle: random ones sometimes began with a pickle header, and torch then
    # warned about the protocol before refusing (the same test took a different path from run to run)
    n = os.path.getsize(path) + 100
    with open(path, "wb") as fh:
        fh.write((b"\x00not a checkpoint\n" * n)[:n])


# one line per fault: (name, damage(folder, dirs), text the error must contain besides the file name, file)
FAULTS = [
    ("missing file", lambda d, _: os.remove(shard(d, 1, 2, "fsdp")), "is missing", "fsdp_1_of_2."),
    ("truncated file", lambda d, _: _truncate(shard(d, 1, 2, "fsdp")), "is truncated", "fsdp_1_of_2."),
    ("flipped byte", lambda d, _: _flip(shard(d, 0, 2, "fsdp")), "sha256", "fsdp_0_of_2."),
    ("flipped last byte", lambda d, _: _flip(shard(d, 1, 2, "fsdp"), at=0.9999), "sha256", "fsdp_1_of_2."),
    ("garbage file", lambda d, _: _garbage(shard(d, 0, 2, "fsdp")), "corrupted", "fsdp_0_of_2."),
    ("file of another world size", lambda d, dirs: shutil.copy(shard(dirs['w4'], 1, 4), shard(d, 1, 2, "fsdp")),
     "world-size-4", "fsdp_1_of_2."),
    ("no manifest, two world sizes", lambda d, dirs: [os.remove(f"{d}/manifest.json")] + [
        shutil.copy(shard(dirs['w4'], r, 4), d) for r in range(4)], "mix of world sizes [2, 4]",
     "manifest.json"),
    ("no manifest (unfinished save)", lambda d, _: os.remove(f"{d}/manifest.json"), "did not finish",
     "manifest.json"),
    ("corrupted manifest", lambda d, _: _truncate(f"{d}/manifest.json"), "not valid JSON", "manifest.json"),
    ("manifest with another shape", lambda d, _: _edit_manifest(d), "shapes", "fsdp_0_of_2."),
]


def _edit_manifest(d):
    text = open(f"{d}/manifest.json").read().replace('"shape": [', '"shape": [1, ', 1)
    with open(f"{d}/manifest.json", "w") as fh:
        fh.write(text)


@pytest.mark.parametrize("name,damage,what,file", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_gives_clear_error(saved, tmp_path, name, damage, what, file):
    dirs, _ = saved
    d = str(tmp_path / "ckpt")
    shutil.copytree(dirs["a"], d)
    verify(d)                                                  # the copy is fine before the damage
    damage(d, dirs)
    with pytest.raises(CheckpointError) as e:
        verify(d)
    assert file in str(e.value) and what in str(e.value), str(e.value)


def test_wrong_kind_and_missing_folder(saved, tmp_path):
    dirs, _ = saved
    with pytest.raises(CheckpointError, match="'fsdp' checkpoint, not a 'zero'"):
        verify(dirs["a"], kind="zero")
    with pytest.raises(CheckpointError, match="does not exist"):
        verify(str(tmp_path / "nowhere"))


def test_fsdp_load_refuses_damaged_checkpoint_before_touching_the_model(saved, tmp_path):
    """Through the real loader on 2 ranks: the first fault stops every rank with the file's name."""
    dirs, _ = saved
    d = str(tmp_path / "ckpt")
    shutil.copytree(dirs["a"], d)
    _flip(shard(d, 1, 2, "fsdp"))
    with pytest.raises(parlab.RankError) as e:
        parlab.run(_resume, 2, "fsdp", d, 2, 0)
    assert e.value.exc_type == "CheckpointError" and re.search(r"fsdp_1_of_2\.\w+\.pt is corrupted", e.value.message)


def test_two_world_sizes_in_one_folder_load_the_newest(saved, tmp_path):
    """Saves at world 2 (2 steps) then world 4 (3 steps) into one folder: the manifest picks the newest,
    exactly; the world-2 shards are deleted once the new manifest is in place."""
    dirs, params = saved
    d = str(tmp_path / "ckpt")
    shutil.copytree(dirs["a"], d)
    newest = parlab.run(_save, 4, "fsdp", {3: d})[0][3]
    assert {re.sub(r"\.\w+\.pt$", "", f) for f in os.listdir(d) if f.endswith(".pt")} == {
        f"fsdp_{r}_of_4" for r in range(4)}
    loaded = parlab.run(_resume, 3, "fsdp", d, 3, 0)[0]["loaded"]
    for n, p in newest.items():
        assert torch.equal(loaded[n], p)                      # bit-identical, resharded 4 -> 3
    assert any(not torch.equal(newest[n], params[2][n]) for n in newest)   # and not the stale world-2 values


@pytest.mark.parametrize("new_world", [4, 1])
def test_zero_sharded_checkpoint_reshards_exactly(tmp_path, new_world):
    """ZeRO-2 saves at world 2 after 2 steps; loading at another world size gives the same parameters
    bit for bit, and one more step matches uninterrupted single-process training (state came along)."""
    d = str(tmp_path / "zero")
    saved = parlab.run(_save, 2, "zero", {2: d})[0][2]
    assert sorted(re.sub(r"\.[0-9a-f]{8}\.pt$", "", f) for f in os.listdir(d)) == ["manifest.json", "zero_0_of_2",
                                                                                "zero_1_of_2"]
    res = parlab.run(_resume, new_world, "zero", d, 2, 1)
    ref = reference(3)
    for out in res:
        for n, p in saved.items():
            assert torch.equal(out["loaded"][n], p)
        for n, p in ref.items():
            torch.testing.assert_close(out["params"][n], p, **TOL)
    _truncate(shard(d, 1, 2, "zero"))                           # and a damaged file stops the load
    with pytest.raises(parlab.RankError) as e:
        parlab.run(_resume, 2, "zero", d, 2, 0)
    assert e.value.exc_type == "CheckpointError" and re.search(r"zero_1_of_2\.\w+\.pt is truncated", e.value.message)


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    checkpoint.atomic_write(str(target), b"old")

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_write(str(target), b"new contents")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]   # no temporary file left


# ---------------------------------------------------------------------- a save killed mid-way loses nothing
def _save_killed_at_the_switch(kind, path: str):
    """Save after step 2 into `path`, then train a step and save there again, with rank 0 killed (os._exit, as
    by SIGKILL) just before its manifest would replace the old one: every rank's new shard is on disk by then."""
    import parlab.parallel.zero.checkpoint as ck
    _save(kind, {2: path})
    write = ck.atomic_write

    def die_at_the_manifest(target, data):
        if target.endswith(ck.MANIFEST) and comm.get_rank() == 0:
            os._exit(9)
        write(target, data)
    ck.atomic_write = die_at_the_manifest
    rank, world = comm.get_rank(), comm.get_world_size()
    model, opt = _build(kind)
    model.load_sharded(path, opt) if kind == "fsdp" else opt.load_sharded(path)
    x, y = sampler().shard(2, rank, world)
    model(x, y)[1].backward()
    opt.step()
    model.save_sharded(path, opt) if kind == "fsdp" else opt.save_sharded(path)


@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_a_save_killed_at_the_switch_leaves_the_previous_checkpoint_loadable(tmp_path, kind):
    """The data-loss case of a killed save: the folder still loads the previous checkpoint, exactly (its files
    were never touched), and the next save there deletes the orphaned shards."""
    d = str(tmp_path / "ckpt")
    with pytest.raises((parlab.RankKilled, parlab.RankError)):
        parlab.run(_save_killed_at_the_switch, 2, kind, d)
    assert len(glob.glob(f"{d}/{kind}_*_of_2.*.pt")) == 4                      # two saves' shards, one manifest
    expected = parlab.run(_save, 2, kind, {2: str(tmp_path / "again")})[0][2]   # the step-2 parameters
    loaded = parlab.run(_resume, 2, kind, d, 2, 0)[0]["loaded"]
    for n, p in expected.items():
        assert torch.equal(loaded[n], p), n
    parlab.run(_save, 2, kind, {1: d})
    assert len(glob.glob(f"{d}/{kind}_*_of_2.*.pt")) == 2                      # the orphans are gone
