"""torch.distributed process groups for a :class:`~parlab.parallel.topology.ParallelGrid`.

``parlab.parallel.topology`` says, in pure Python, which ranks belong together; this
module asks torch.distributed to create the matching communicators.

One rule of ``torch.distributed.new_group`` shapes the code: creating a group
is a *collective* over the whole world. **Every rank must call ``new_group``
for every group, in the same order, even for groups it is not a member of**
(a non-member gets back a placeholder it must not use). If rank 0 creates the
tp groups before the dp groups and rank 5 does the reverse, the two ranks
disagree on which communicator is which and the job hangs or mixes up data.

So each rank iterates the same deterministic list, ``grid.groups(dims)`` for
each requested ``dims`` in the order given, creates every group, and keeps
only the handle of the one that contains it. This is what Megatron-LM's
``initialize_model_parallel`` does (``megatron/core/parallel_state.py``).

>>> pg = build_groups(ParallelGrid(8, tp=2, pp=2))   # inside each rank  # doctest: +SKIP
>>> dist.all_reduce(x, group=pg.tp)                  # doctest: +SKIP
>>> dist.send(y, dst=pg.next_rank("pp"))             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from parlab.parallel.topology import DIMS as DIMS_DENSE
from parlab.parallel.topology import EXPERT_DIMS, ParallelGrid, parse_dims

DEFAULT_DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp", "tp-pp", "dp-cp")

#: Short names accepted wherever a dims string is: "mp" is the model-parallel group.
ALIASES: dict[str, str] = {"mp": "tp-pp"}

_Key = frozenset[str]


#: the expert layers' own dimensions (their groups come from ``grid.expert``; pp is shared)
_EXPERT_ONLY = frozenset(EXPERT_DIMS) - {"pp"}


def _key(dims: str | Iterable[str]) -> _Key:
    """'dp-cp', 'cp-dp', 'dp_cp' and ('cp', 'dp') all name the same group; 'ep', 'edp', 'etp-ep' name groups of
    the expert layers' grid."""
    if isinstance(dims, str):
        dims = ALIASES.get(dims, dims).replace("_", "-")
    names = tuple(dims.split("-")) if isinstance(dims, str) else tuple(dims)
    return frozenset(parse_dims(names, EXPERT_DIMS if _EXPERT_ONLY & set(names) else DIMS_DENSE))


def _source(grid: ParallelGrid, key: _Key):
    """The grid a group lives on: the expert grid for ep, edp, etp (and their combinations), else the dense one."""
    return grid.expert if key & _EXPERT_ONLY else grid


class ProcessGroups:
    """This rank's view of the grid: its coordinates and its communicators.

    Build it with :func:`build_groups`. ``pg.get("tp")`` and ``pg.tp`` return
    the ``ProcessGroup`` for this rank's tp group; combinations use ``_`` in
    attribute names (``pg.dp_cp``), and ``pg.mp`` is the model-parallel
    ("tp-pp") group.
    """

    def __init__(self, grid: ParallelGrid, rank: int, handles: dict[_Key, dist.ProcessGroup], names: list[str]):
        self.grid = grid
        self.rank = rank
        self.coords = grid.coords(rank)
        self.names = names  # the dims that were built, as requested
        self._handles = handles

    def get(self, dims: str | Iterable[str]) -> dist.ProcessGroup:
        """The ProcessGroup of this rank along ``dims`` (e.g. "tp", "dp-cp", "mp")."""
        key = _key(dims)
        if key not in self._handles:
            raise KeyError(f"no {dims!r} group was built; pass it in dims=... to build_groups (built: {self.names})")
        return self._handles[key]

    def __getattr__(self, name: str) -> dist.ProcessGroup:
        if name.startswith("_"):  # keep copy/pickle protocols away from get()
            raise AttributeError(name)
        try:
            return self.get(name)
        except (KeyError, ValueError) as e:
            raise AttributeError(f"{type(self).__name__} has no group {name!r}: {e}") from None

    # Membership is pure arithmetic on the grid, so it works for any dims,
    # whether or not a ProcessGroup was built for them.
    def ranks(self, dims: str | Iterable[str]) -> list[int]:
        """Global ranks of this rank's group along ``dims``, ascending."""
        key = _key(dims)
        return _source(self.grid, key).group_of(self.rank, tuple(key))

    def size(self, dims: str | Iterable[str]) -> int:
        return len(self.ranks(dims))

    def local_rank(self, dims: str | Iterable[str]) -> int:
        """This rank's index within its group (its coordinate, for a single dim)."""
        return self.ranks(dims).index(self.rank)

    def next_rank(self, dims: str | Iterable[str] = "pp") -> int:
        """Global rank of the next member of the group, wrapping around (a ring)."""
        group = self.ranks(dims)
        return group[(group.index(self.rank) + 1) % len(group)]

    def prev_rank(self, dims: str | Iterable[str] = "pp") -> int:
        """Global rank of the previous member of the group, wrapping around."""
        group = self.ranks(dims)
        return group[(group.index(self.rank) - 1) % len(group)]

    def is_first(self, dims: str | Iterable[str] = "pp") -> bool:
        """True on the first member (e.g. the first pipeline stage)."""
        return self.local_rank(dims) == 0

    def is_last(self, dims: str | Iterable[str] = "pp") -> bool:
        """True on the last member (e.g. the last pipeline stage)."""
        return self.local_rank(dims) == self.size(dims) - 1

    def __repr__(self) -> str:
        coords = " ".join(f"{d}={c}" for d, c in self.coords.items())
        return f"ProcessGroups(rank={self.rank}: {coords}; groups={self.names})"


def build_groups(
    grid: ParallelGrid,
    dims: Iterable[str] | None = None,
    rank: int | None = None,
    backend: str | None = None,
) -> ProcessGroups:
    """Create the process groups for ``dims`` on every rank; return this rank's.

    ``dims`` (default `DEFAULT_DIMS`, and "ep", "edp" when the grid has ep > 1) may name the expert layers'
    groups too ("ep", "edp", "etp", "etp-ep": `ParallelGrid.expert`).
    Must be called by *all* ranks with the same ``grid`` and ``dims`` after
    ``dist.init_process_group``. ``backend`` is passed to ``new_group``
    (None: the default group's backend).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    world, me = dist.get_world_size(), dist.get_rank()
    if grid.world_size != world:
        raise ValueError(
            f"grid.world_size={grid.world_size} but torch.distributed has {world} ranks; "
            f"build the grid with ParallelGrid({world}, ...)"
        )
    rank = me if rank is None else rank
    if rank != me:
        raise ValueError(f"rank={rank} but dist.get_rank() is {me}; a rank can only build its own groups")
    if dims is None:
        dims = DEFAULT_DIMS + (("ep", "edp") if grid.ep > 1 else ())
    if isinstance(dims, str):
        dims = (dims,)

    handles: dict[_Key, dist.ProcessGroup] = {}
    names: list[str] = []
    for name in dims:
        key = _key(name)
        if key in handles:  # "tp-pp" and "mp" twice: create once, on every rank alike
            continue
        names.append(name)
        for members in _source(grid, key).groups(tuple(key)):
            if len(members) == world and backend is None:
                pg = dist.group.WORLD  # the same on every rank, so no collective needed
            else:
                pg = dist.new_group(ranks=members, backend=backend)
            if rank in members:
                handles[key] = pg
    return ProcessGroups(grid, rank, handles, names)
