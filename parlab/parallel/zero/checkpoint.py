"""Sharded checkpoints that fail loudly: atomic files, a manifest written last, checksums verified on load.

A sharded checkpoint is a folder with one file per rank and one ``manifest.json``:

    ckpt/
        fsdp_0_of_2.3f9a61c2.pt   rank 0's shard of save 3f9a61c2: {"format", "kind", "rank", "world_size", "payload"}
        fsdp_1_of_2.3f9a61c2.pt   rank 1's shard
        manifest.json             {"format", "kind", "world_size", "save", "layout", "files": [per rank: file,
                                   bytes, sha256, {tensor path: shape, dtype}]}

Saving (collective, `save`): write the new checkpoint beside the old one, then switch in one atomic step.

    rank 0       draw the save's name (8 hex digits) and broadcast it
    every rank   torch.save its payload to a temporary file in the folder, fsync, os.replace ->
                 <kind>_<r>_of_<N>.<save>.pt (a new name: the previous checkpoint's files are not touched)
                 all-gather (file, bytes, sha256, tensor shapes and dtypes) of every rank
    rank 0       write manifest.json the same way (temporary file + os.replace): the switch. Then delete the
                 shard files the new manifest does not name (the previous save's, or an unfinished one's)
    every rank   barrier: nobody returns before the checkpoint is complete

A reader sees either the previous checkpoint or the new one, never a mix: os.replace is atomic on POSIX file
systems, and a save killed at any point before the switch leaves the old manifest naming the old files, still
there and unchanged (tests/test_checkpoint.py kills one at the switch; torch.distributed.checkpoint and every
trusted store work the same way). A save killed after the switch leaves only stale files behind, which the next
save deletes. On load (`read_manifest`, `load_file`; pure functions, no torch.distributed) every file is checked
against the manifest before anything is copied into a model: present, of the recorded size (else truncated),
of the recorded SHA-256 (else corrupted or changed since), of the recorded rank and world size (else a mix of
checkpoints), holding the recorded tensor names, shapes and dtypes. Any failure raises `CheckpointError`
naming the file and what is wrong, so a damaged checkpoint can never load as NaNs or stale values.

Files are read with ``map_location="cpu"``; callers copy the values to their parameters' devices, so a
checkpoint saved on cuda:3 loads on a machine with one GPU. Every rank writes into and reads from `path`
itself: with several nodes, `path` must be on a file system all nodes share (NFS, Lustre, ...), as for
torch.distributed.checkpoint's FileSystemWriter.

References
    [1] PyTorch, torch.distributed.checkpoint (per-rank files plus a ``.metadata`` file written last by the
        coordinator after all ranks finished).
    [2] POSIX rename(2) / Python os.replace: atomic replacement of a file within one file system.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import re
import secrets
import tempfile
from typing import Any

import torch

__all__ = ["CheckpointError", "MANIFEST", "FORMAT", "SHARD", "shard_name", "atomic_write", "describe", "save",
           "read_manifest", "load_file"]

FORMAT = "parlab-sharded-checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded safely (missing, truncated, corrupted, mixed or mismatched)."""


SHARD = re.compile(r"_(\d+)_of_(\d+)(?:\.([0-9a-f]+))?\.pt$")     # rank, world size, save


def shard_name(kind: str, rank: int, world_size: int, save: str | None = None) -> str:
    """File name of rank `rank`'s shard of save `save`: ``<kind>_<rank>_of_<world_size>.<save>.pt`` (no two saves
    share a name; manifests written before saves had names say ``<kind>_<rank>_of_<world_size>.pt``)."""
    return f"{kind}_{rank}_of_{world_size}{'.' + save if save else ''}.pt"


def atomic_write(path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part:
    a temporary file in the same folder, flushed and fsynced, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:                                     # make the rename itself durable (not possible on every platform)
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def describe(obj: Any, prefix: str = "") -> dict[str, dict]:
    """{'a/b/c': {'shape': [...], 'dtype': 'float32'}} for every tensor in nested dicts / lists of `obj`."""
    out: dict[str, dict] = {}
    if torch.is_tensor(obj):
        out[prefix or "."] = {"shape": list(obj.shape), "dtype": str(obj.dtype).replace("torch.", "")}
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(describe(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(describe(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


# ---------------------------------------------------------------------- save (collective)
def save(path: str, kind: str, payload: dict, layout: dict, *, group=None, device=None) -> None:
    """Collective over `group`: each rank writes `payload` as its shard; rank 0 then writes the manifest.

    kind     file prefix and checkpoint type, e.g. "fsdp" or "zero"
    layout   JSON-able description of how the shards fit together (checked by the loader's caller)
    device   where the small metadata tensor for the all-gather lives (the rank's device: NCCL needs CUDA)
    """
    from parlab import comm                                   # only saving talks to other ranks
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    os.makedirs(path, exist_ok=True)
    token = torch.tensor(list(secrets.token_hex(4).encode()), dtype=torch.uint8, device=device)   # (8,) ascii
    comm.broadcast(token, src=comm.group_ranks(group)[0], group=group, label=f"{kind} checkpoint name")
    save_id = bytes(token.cpu().tolist()).decode()
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "kind": kind, "rank": rank, "world_size": world, "payload": payload}, buf)
    data = buf.getvalue()
    name = shard_name(kind, rank, world, save_id)
    atomic_write(os.path.join(path, name), data)
    entry = {"file": name, "rank": rank, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
             "tensors": describe(payload)}
    blob = torch.tensor(list(json.dumps(entry).encode()), dtype=torch.uint8, device=device)  # (bytes,)
    parts = comm.all_gather_uneven(blob, group=group, label=f"{kind} checkpoint manifest")
    if rank == 0:
        files = [json.loads(bytes(p.cpu().tolist()).decode()) for p in parts]
        manifest = {"format": FORMAT, "kind": kind, "world_size": world, "save": save_id, "layout": layout,
                    "files": files}
        atomic_write(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1, default=str).encode())  # switch
        keep = {f["file"] for f in files}
        for old in glob.glob(os.path.join(path, f"{kind}_*_of_*.pt")):
            if os.path.basename(old) not in keep and SHARD.search(old):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(old)
    comm.barrier(group=group, label=f"{kind} checkpoint saved")


# ---------------------------------------------------------------------- load (pure)
def read_manifest(path: str, kind: str) -> dict:
    """The folder's manifest, checked for shape and kind; CheckpointError says what is wrong."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist")
    if not os.path.exists(mpath):
        found = sorted(glob.glob(os.path.join(path, f"{kind}_*_of_*.pt")))
        worlds = sorted({int(m.group(2)) for f in found if (m := SHARD.search(f))})
        if len(worlds) > 1:
            raise CheckpointError(f"{mpath} is missing and {path!r} holds shards of a mix of world sizes {worlds}: "
                                  f"without the manifest no one knows which is the checkpoint; save again")
        hint = (f"it holds {len(found)} {kind} shard file(s) but no manifest: the save did not finish, "
                f"or the checkpoint was made by an older parlab; save again" if found else
                f"it holds no {kind} checkpoint (no {kind}_<rank>_of_<n>.pt files either)")
        raise CheckpointError(f"{mpath} is missing: {hint}")
    try:
        with open(mpath, "rb") as fh:
            manifest = json.loads(fh.read().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath} is corrupted (not valid JSON: {e}); the checkpoint cannot be verified, "
                              f"save again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not a {FORMAT} manifest")
    if manifest.get("kind") != kind:
        raise CheckpointError(f"{mpath} describes a {manifest.get('kind')!r} checkpoint, not a {kind!r} one; "
                              f"load it with the class that saved it")
    world, files, save = manifest.get("world_size"), manifest.get("files"), manifest.get("save")
    if not isinstance(world, int) or world < 1 or not isinstance(files, list) or len(files) != world:
        raise CheckpointError(f"{mpath} is inconsistent: world_size {world!r} but "
                              f"{len(files) if isinstance(files, list) else 'no'} file entries")
    for r, e in enumerate(files):
        if not isinstance(e, dict) or e.get("rank") != r or e.get("file") != shard_name(kind, r, world, save):
            raise CheckpointError(f"{mpath}: entry {r} is {e.get('file') if isinstance(e, dict) else e!r}, "
                                  f"expected {shard_name(kind, r, world, save)} (a mix of saves in one manifest)")
    return manifest


def load_file(path: str, manifest: dict, rank: int) -> dict:
    """Rank `rank`'s payload, on the CPU, after checking the file against `manifest` (see module docstring)."""
    entry = manifest["files"][rank]
    kind, world = manifest["kind"], manifest["world_size"]
    fpath = os.path.join(path, entry["file"])
    if not os.path.exists(fpath):
        raise CheckpointError(f"{fpath} is missing (the manifest lists it as rank {rank} of {world}); "
                              f"copy the whole checkpoint folder, or save again")
    with open(fpath, "rb") as fh:
        data = fh.read()
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        doc = _try_load(data)                                  # say "a mix" when the header proves it
        if isinstance(doc, dict) and (doc.get("world_size"), doc.get("rank")) != (world, rank):
            raise CheckpointError(f"{fpath} holds rank {doc.get('rank')} of a world-size-{doc.get('world_size')} "
                                  f"checkpoint, but the manifest expects rank {rank} of {world}: a mix of "
                                  f"checkpoints in one folder; copy the folder of one save, with its manifest")
        if len(data) < entry["bytes"] and not isinstance(doc, dict):
            raise CheckpointError(f"{fpath} is truncated: {len(data)} bytes, the manifest says {entry['bytes']}")
        what = (f"{len(data)} bytes, the manifest says {entry['bytes']}" if len(data) != entry["bytes"] else
                f"sha256 {digest[:12]}... but the manifest says {entry['sha256'][:12]}... (flipped bytes?)")
        raise CheckpointError(f"{fpath} is corrupted: {what}; it changed after the save")
    doc = _try_load(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{fpath} cannot be read as a {FORMAT} shard ({doc if isinstance(doc, str) else ''})")
    if (doc["kind"], doc["world_size"], doc["rank"]) != (kind, world, rank):
        raise CheckpointError(f"{fpath} holds {doc['kind']} rank {doc['rank']} of {doc['world_size']}, but the "
                              f"manifest expects {kind} rank {rank} of {world}: a mix of checkpoints")
    got = describe(doc["payload"])
    if got != entry["tensors"]:
        bad = sorted(set(got) ^ set(entry["tensors"])) or [k for k in got if got[k] != entry["tensors"][k]]
        raise CheckpointError(f"{fpath}: tensors differ from the manifest's names, shapes or dtypes at {bad[:3]}")
    return doc["payload"]


def _try_load(data: bytes) -> Any:
    """torch.load onto the CPU (tensors only, no code); the error text instead of raising."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:                                     # noqa: BLE001 - any unreadable file is reported
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
