"""The state of an FSDP model as a whole: full parameters and sharded checkpoints.

Each rank of a `FullyShardedDataParallel` (`parlab.parallel.zero.fsdp`) holds 1/Nd of every unit's flat
parameter vector (padded to a multiple of Nd). This mixin gathers or saves that state:

* `full_parameters()`: {original name: full tensor} on every rank (one all-gather per flat);
* `save_sharded(path, optimizer)` / `load_sharded(path, optimizer)`: one file per rank plus a manifest written
  last (`parlab.parallel.zero.checkpoint`: atomic files, checksums verified on load), reloadable at any
  data-parallel size: the saved shards are joined, their old padding stripped, and this rank's new slice taken.
"""
from __future__ import annotations

import os

import torch

from parlab import comm
from parlab.parallel.zero import checkpoint

__all__ = ["FSDPState"]


class FSDPState:
    """Full parameters and sharded checkpoints of `FullyShardedDataParallel` (reads its units, flats, rank,
    world, group and shards)."""

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{original name: full fp32 tensor} on every rank (collective: one all-gather per flat)."""
        out = {}
        for u in self.units:
            for f in self.flats[u]:
                full = torch.empty(self.world * f.s, dtype=f.shard.dtype, device=f.shard.device)  # (Nd*s,)
                comm.all_gather(full, f.shard.detach(), group=self.group, label=f"{f.label} full params")
                out.update({n: v.clone() for n, v in zip(f.names, f.views(full))})
        return out

    def save_sharded(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Each rank writes its shards (and its optimizer state) to ``path/fsdp_<r>_of_<Nd>.<save>.pt``; rank 0 then
        writes ``path/manifest.json`` (collective; see `parlab.parallel.zero.checkpoint`). Every file appears atomically.
        With several nodes, `path` must be on a file system that every node shares."""
        payload = {"flats": {}, "param_groups": None}
        layout = {"units": {}}
        for u in self.units:
            for f in self.flats[u]:
                st = optimizer.state.get(f.shard, {}) if optimizer is not None else {}
                payload["flats"][f.label] = {"numel": f.numel, "shard": f.shard.detach().clone(),
                                             "optim": {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}}
                layout["units"][f.label] = {"numel": f.numel, "names": f.names,
                                            "shapes": [list(s) for s in f.shapes], "dtype": str(f.shard.dtype)}
        if optimizer is not None:
            payload["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        checkpoint.save(path, "fsdp", payload, layout, group=self.group, device=self.shards[0].device)

    @torch.no_grad()
    def load_sharded(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load shards saved at any DP size: verify every file against the manifest (a CheckpointError names
        a missing, truncated, corrupted or mixed file), rebuild each flat vector, keep this rank's slice.
        Files load onto the CPU, then the values are copied to each shard's device. With several nodes,
        `path` must be on a file system that every node shares."""
        manifest = checkpoint.read_manifest(path, "fsdp")
        old = manifest["world_size"]
        docs = [checkpoint.load_file(path, manifest, r) for r in range(old)]
        where = os.path.join(path, checkpoint.MANIFEST)
        for u in self.units:
            for f in self.flats[u]:
                saved = [d["flats"].get(f.label) for d in docs]
                lay = manifest["layout"]["units"].get(f.label)
                if any(s is None for s in saved) or lay is None or lay["names"] != f.names or \
                        lay["shapes"] != [list(s) for s in f.shapes] or saved[0]["numel"] != f.numel:
                    raise checkpoint.CheckpointError(
                        f"{where} does not match unit {f.unit!r} ({f.label}: {len(f.names)} parameters, "
                        f"{f.numel} elements); wrap the same model with the same units")
                f.shard.copy_(self._reslice(torch.cat([s["shard"] for s in saved]), f))
                if optimizer is not None and saved[0]["optim"]:
                    optimizer.state[f.shard] = {
                        k: self._reslice(torch.cat([s["optim"][k] for s in saved]), f).clone()
                        if torch.is_tensor(v) and v.shape == saved[0]["shard"].shape else v   # per-element state
                        for k, v in saved[0]["optim"].items()}
        if optimizer is not None and docs[0]["param_groups"] is not None:
            for g, hyper in zip(optimizer.param_groups, docs[0]["param_groups"]):
                g.update(hyper)

    def _reslice(self, old_flat: torch.Tensor, f) -> torch.Tensor:
        """Old padded flat -> this rank's new shard: strip the old padding, pad for the new Nd, slice."""
        flat = torch.zeros(self.world * f.s, dtype=old_flat.dtype, device=f.shard.device)  # (Nd*s,)
        flat[:f.numel] = old_flat[:f.numel]
        return flat[self.rank * f.s:(self.rank + 1) * f.s]
