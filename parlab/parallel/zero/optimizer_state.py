"""The state of a ZeRO-1/2 optimizer as a whole: full state dicts and sharded checkpoints.

Each rank of a `ShardedOptimizer` (`parlab.parallel.zero.optimizer`) holds the optimizer state of the parameters
it owns, in flat owner-major chunks (`parlab.parallel.zero.flat`). This mixin turns that into what a training
script saves and loads:

* `state_dict()` / `load_state_dict()`: the full state, as the wrapped optimizer on one process would return it
  (collective: every rank's part is gathered); loadable at any data-parallel size, or from a plain optimizer.
* `save_sharded(path)` / `load_sharded(path)`: one file per rank plus a manifest written last
  (`parlab.parallel.zero.checkpoint`: atomic files, checksums verified on load), reloadable at another size.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch

from parlab import comm
from parlab.parallel.zero import checkpoint
from parlab.parallel.zero.flat import join_chunks, merge_state, split_chunks, split_state

__all__ = ["ShardedOptimizerState"]


class ShardedOptimizerState:
    """State dicts and sharded checkpoints of `ShardedOptimizer` (reads its params, owner, owned, optim, _runs)."""

    def state_dict(self) -> dict:
        """The full optimizer state, as ``optimizer_cls`` on one process would return it (collective).
        Per-element state lands on its parameter's device; scalars (e.g. AdamW's step) as torch keeps them."""
        buf = io.BytesIO()
        torch.save(self._local_state(), buf)
        blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(self._device)  # (bytes,)
        state: dict[int, Any] = {}
        for part in comm.all_gather_uneven(blob, group=self.group, label="zero state_dict"):
            got = torch.load(io.BytesIO(part.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
            state.update({gi: self._place(gi, s) for gi, s in got.items()})
        return {"state": dict(sorted(state.items())), "param_groups": self._full_groups()}

    def _place(self, gi: int, st: dict) -> dict:
        """One parameter's state with its per-element tensors on that parameter's device."""
        dev = self.params[gi].device
        return {k: v.to(dev) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}

    def _full_groups(self) -> list[dict]:
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**_hyper(g), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return groups

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from `state_dict()` at any DP size, or from a plain optimizer)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's; "
                             "build the optimizer from the same parameters (and groups) that were saved")
        self._load_owned(state_dict["state"], [_hyper(g) for g in groups])

    def _local_state(self) -> dict[int, dict]:
        """The state of the parameters this rank owns, per parameter, keyed by global index."""
        if not self.flat_step:
            inner = [p for g in self.optim.param_groups for p in g["params"]]
            return {self._index[id(p)]: {
                k: v.clone() if torch.is_tensor(v) else v for k, v in self.optim.state[p].items()}
                for p in inner if self.optim.state.get(p)}
        out = {}
        for *_, members, t, bounds, chunks in self._runs:
            state = join_chunks([self.optim.state.get(c) for c in chunks], bounds)
            if state:
                out.update(split_state(state, members, t.numel()))
        return dict(sorted(out.items()))

    def _load_owned(self, state: dict, hypers: list[dict]) -> None:
        """Take the hyper-parameters of every group and the state of the parameters this rank owns."""
        for mine, saved in zip(self.param_groups, hypers):
            mine.update(saved)
        inner = [p for g in self.optim.param_groups for p in g["params"]]
        if self.flat_step:
            by_chunk = {}
            for *_, members, t, bounds, chunks in self._runs:
                run_state = merge_state(state, members, t.numel())
                by_chunk.update(zip(map(id, chunks), split_chunks(run_state, bounds, t.numel())))
            local_state = {j: by_chunk[id(p)] for j, p in enumerate(inner) if by_chunk[id(p)]}
        else:
            local_state = {j: state[self._index[id(p)]] for j, p in enumerate(inner) if self._index[id(p)] in state}
        local_groups, j = [], 0
        for g, inner_g in zip(self.param_groups, self.optim.param_groups):
            local_groups.append({**_hyper(g), "params": list(range(j, j + len(inner_g["params"])))})
            j += len(inner_g["params"])
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state

    def _layout_doc(self) -> dict:
        """What a sharded checkpoint records about the parameters: owner (-1: frozen), shape, dtype, groups."""
        return {"owner": [self.owner.get(i, -1) for i in range(len(self.params))],
                "shapes": [list(p.shape) for p in self.params], "dtypes": [str(p.dtype) for p in self.params],
                "groups": [len(g["params"]) for g in self.param_groups]}

    @torch.no_grad()
    def save_sharded(self, path: str) -> None:
        """Each rank writes the parameters it owns and their optimizer state to ``path/zero_<r>_of_<Nd>.<save>.pt``;
        rank 0 then writes ``path/manifest.json`` (collective; see `parlab.parallel.zero.checkpoint`). Frozen parameters
        are not saved (they never change). With several nodes, `path` must be on a shared file system."""
        payload = {"params": {gi: self.params[gi].detach().clone() for gi in self.owned},
                   "state": self._local_state(),
                   "param_groups": [_hyper(g) for g in self.param_groups]}
        checkpoint.save(path, "zero", payload, self._layout_doc(), group=self.group, device=self._device)

    @torch.no_grad()
    def load_sharded(self, path: str) -> None:
        """Load a checkpoint of `save_sharded` made at any DP size (collective): verify the files this rank
        needs against the manifest (CheckpointError on a missing, truncated, corrupted or mixed file), take
        the owned parameters and their state, then all-gather the parameters. With several nodes, `path`
        must be on a shared file system."""
        manifest = checkpoint.read_manifest(path, "zero")
        saved, mine = manifest["layout"], self._layout_doc()
        for key in ("shapes", "dtypes", "groups"):
            if saved.get(key) != mine[key]:
                raise checkpoint.CheckpointError(
                    f"{os.path.join(path, checkpoint.MANIFEST)}: the saved parameter {key} differ from this "
                    f"optimizer's; build it from the same model and parameter groups that were saved")
        need = sorted({saved["owner"][gi] for gi in self.owned} | {0})
        state, params, hypers = {}, {}, None
        for r in need:
            doc = checkpoint.load_file(path, manifest, r)
            state.update(doc["state"])
            params.update(doc["params"])
            hypers = hypers or doc["param_groups"]
        for gi in self.owned:
            self.params[gi].copy_(params[gi])                   # CPU -> the parameter's device
        self._load_owned(state, hypers)
        self._gather_parameters()


def _hyper(group: dict) -> dict:
    """A parameter group's hyper-parameters (everything but the parameters)."""
    return {k: v for k, v in group.items() if k != "params"}
