"""Parallel topology: which global ranks work together along each dimension.

A large-model training job runs on ``world_size`` processes (one per GPU)
and splits the work along four orthogonal dimensions:

* **tp** (tensor parallel): each weight matrix is sharded across tp ranks;
  they exchange activations in every layer, so they must sit close together.
* **cp** (context parallel): the sequence is sharded across cp ranks.
* **dp** (data parallel): each replica sees different samples; replicas
  all-reduce their gradients once per step.
* **pp** (pipeline parallel): the layers are split into pp stages; neighbouring
  stages only send activations point-to-point.

The ranks form a 4-D grid of shape ``tp x cp x dp x pp``. Every rank has a
coordinate along each dimension, and a *group* along a dimension is the set of
ranks whose other coordinates are all equal. Which physical rank gets which
coordinate is decided by the ``order`` string, listed from the fastest-varying
dimension (neighbouring rank ids) to the slowest. With the default
``"tp-cp-dp-pp"``::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

i.e. tp groups are made of consecutive ranks, which usually share a node and
its fast NVLink, while pp groups are strided far apart and cross the slower
inter-node network, where their small point-to-point messages do little harm.
That placement rule is the argument of Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC 2021, arXiv:2104.04473), section 3.

This module is a small pure-Python re-derivation of Megatron-LM's
``RankGenerator`` and ``generate_masked_orthogonal_rank_groups``
(``megatron/core/parallel_state.py``), expert parallelism included: the
mixture-of-experts layers get a second grid on the same ranks (`ExpertGrid`,
below). It does not import torch: ``parlab.parallel.groups`` turns the lists
computed here into ``torch.distributed`` process groups.

Worked example (the one in Megatron's ``initialize_model_parallel``
docstring): 16 GPUs on 2 nodes of 8, tp=2, pp=4, hence dp=2.

>>> g = ParallelGrid(16, tp=2, pp=4, gpus_per_node=8)
>>> g
ParallelGrid(world=16: tp=2 cp=1 dp=2 pp=4, order=tp-cp-dp-pp)
>>> g.groups("tp")
[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
>>> g.groups("dp")
[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
>>> g.groups("pp")
[[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
>>> g.groups("tp-pp")   # the model-parallel groups: one full model copy each
[[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
>>> g.coords(13)
{'tp': 1, 'cp': 0, 'dp': 0, 'pp': 3}
>>> [g.crosses_nodes(x) for x in g.groups("pp")]
[True, True, True, True]

TP and DP groups stay inside a node; every PP group spans both nodes.

The fifth dimension, expert parallelism (ep), "folds" into the same ranks
(Megatron-Core's MoE parallel folding, ``RankGenerator`` built twice): the
dense layers keep ``tp x cp x dp x pp``, the expert layers use
``etp x ep x edp x pp`` with the same pp, where etp is the experts' own tensor
parallelism (default tp) and the expert-data-parallel size is
``edp = world / (etp * ep * pp)``. Megatron's default order ``tp-cp-ep-dp-pp``
with cp = 1 in the expert grid gives the expert order ``etp-ep-edp-pp``:

>>> e = ParallelGrid(16, tp=2, pp=2, cp=2, ep=4, gpus_per_node=8).expert
>>> e
ExpertGrid(world=16: etp=2 ep=4 edp=1 pp=2, order=etp-ep-edp-pp)
>>> e.groups("ep")
[[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]

An EP group may take ranks the dense grid uses for cp or dp: the expert layers
see only tokens, whatever dimension split them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from parlab.i18n import _

#: The dimension names, in the canonical order used for coords() and repr().
DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")

#: Megatron's default layout of the dense layers (its ``tp-cp-ep-dp-pp`` with ep = 1).
DEFAULT_ORDER = "tp-cp-dp-pp"

#: The expert layers' dimensions (`ExpertGrid`): expert TP, EP, expert DP, and the shared PP.
EXPERT_DIMS: tuple[str, ...] = ("etp", "ep", "edp", "pp")


def _check_size(name: str, value: object) -> int:
    # bool is a subclass of int, but tp=True is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def parse_dims(dims: str | Iterable[str], known: tuple[str, ...] = DIMS) -> tuple[str, ...]:
    """Parse ``"tp"``, ``"tp-pp"`` or ``("tp", "pp")`` into a tuple of dim names (from `known`).

    The names keep the caller's order; unknown or repeated names raise.
    """
    if isinstance(dims, str):
        names = tuple(dims.split("-")) if dims else ()
    else:
        names = tuple(dims)
    if not names or any(not isinstance(n, str) for n in names):
        raise ValueError(f"dims must be names from {known} joined by '-', e.g. '{known[0]}' or '{known[0]}-pp'; "
                         f"got {dims!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        expert = known == DIMS and set(unknown) & set(EXPERT_DIMS)
        hint = "; the expert layers' groups are grid.expert.groups(...)" if expert else ""
        raise ValueError(
            f"unknown dimension name(s) {unknown} in {dims!r}; valid names are {', '.join(known)}, "
            f"joined by '-' for a combination such as '{known[0]}-pp'{hint}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"dimension repeated in {dims!r}; name each dimension at most once")
    return names


def _orthogonal_groups(world: int, strides: dict[str, int], sizes: dict[str, int],
                       dims: tuple[str, ...]) -> list[list[int]]:
    """The groups along `dims` of a mixed-radix grid (Megatron's ``generate_masked_orthogonal_rank_groups``):
    each rank keyed by its "base", the rank with its coordinates along `dims` set to zero (its group's first
    member). Groups ascending, sorted by first rank."""
    masked = [(strides[d], sizes[d]) for d in dims]
    by_base: dict[int, list[int]] = {}
    for r in range(world):  # ascending, so groups come out sorted
        base = r - sum(r // stride % size * stride for stride, size in masked)
        by_base.setdefault(base, []).append(r)
    return list(by_base.values())


@dataclass(frozen=True, repr=False)
class ParallelGrid:
    """A ``tp x cp x dp x pp`` grid of ``world_size`` ranks (see the module docstring).

    ``dp`` defaults to ``world_size // (tp * pp * cp)``. ``gpus_per_node``
    (default: the whole world on one node) places rank r on node
    ``r // gpus_per_node``, as launchers such as torchrun do. ``ep`` and
    ``etp`` (default tp) lay out the expert layers on the same ranks: `expert`.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None
    order: str = DEFAULT_ORDER
    gpus_per_node: int | None = None
    ep: int = 1
    etp: int | None = None
    # Derived: stride of each dim, i.e. how far apart in rank id two ranks are
    # whose coordinate along that dim differs by one.
    _strides: dict[str, int] = field(init=False, compare=False, hash=False, default_factory=dict)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        world = _check_size("world_size", self.world_size)
        for name in ("tp", "pp", "cp"):
            _check_size(name, getattr(self, name))
        model = self.tp * self.pp * self.cp
        if world % model:
            raise ValueError(_("world_size {world} is not divisible by tp*pp*cp = {model}; "
                               "choose sizes whose product divides the number of GPUs").format(world=world, model=model))
        if self.dp is None:
            set_("dp", world // model)
        else:
            _check_size("dp", self.dp)
            if self.dp * model != world:
                raise ValueError(
                    f"dp={self.dp} but world_size {world} / (tp*pp*cp = {model}) = {world // model}; "
                    "tp*cp*dp*pp must equal world_size (or leave dp=None to compute it)"
                )
        # The order must be a permutation of the four dimension names.
        if not isinstance(self.order, str):
            raise ValueError(f"order must be a string such as {DEFAULT_ORDER!r}, got {self.order!r}")
        names = self.order.split("-")
        unknown = [n for n in names if n not in DIMS]
        if unknown:
            raise ValueError(f"unknown dimension name(s) {unknown} in order {self.order!r}; valid names are {DIMS}")
        if sorted(names) != sorted(DIMS):
            raise ValueError(
                f"order {self.order!r} must name each of tp, cp, dp, pp exactly once, "
                f"fastest-varying first, e.g. {DEFAULT_ORDER!r}"
            )
        if self.gpus_per_node is None:
            set_("gpus_per_node", world)
        else:
            gpn = _check_size("gpus_per_node", self.gpus_per_node)
            if world % gpn:
                raise ValueError(_("world_size {world} is not divisible by gpus_per_node={gpn}: "
                                   "the ranks would not fill whole nodes; use a multiple of gpus_per_node").format(
                                       world=world, gpn=gpn))
        stride = 1
        for name in names:  # fastest first: each stride is the product of the sizes before it
            self._strides[name] = stride
            stride *= self.sizes[name]
        _check_size("ep", self.ep)
        set_("etp", self.tp if self.etp is None else _check_size("etp", self.etp))
        expert = self.etp * self.ep * self.pp
        if world % expert:
            raise ValueError(
                f"world_size {world} is not divisible by etp*ep*pp = {expert} (the expert layers' grid: expert "
                f"tensor parallel {self.etp}, expert parallel {self.ep}, pipeline {self.pp}); choose ep and etp "
                "whose product with pp divides the number of GPUs"
            )

    @property
    def expert(self) -> "ExpertGrid":
        """The expert layers' grid on the same ranks (module docstring): etp x ep x edp x pp."""
        order = "-".join({"tp": "etp", "dp": "ep-edp"}.get(d, d) for d in self.order_dims if d != "cp")
        return ExpertGrid(self.world_size, self.etp, self.ep, self.pp, order, self.gpus_per_node)

    # ----------------------------------------------------------------- sizes
    @property
    def sizes(self) -> dict[str, int]:
        """``{"tp": .., "cp": .., "dp": .., "pp": ..}``."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}  # type: ignore[dict-item]

    @property
    def order_dims(self) -> tuple[str, ...]:
        """The dims of ``order``, fastest-varying first."""
        return tuple(self.order.split("-"))

    @property
    def strides(self) -> dict[str, int]:
        """Rank-id distance between neighbours along each dim."""
        return dict(self._strides)

    # ------------------------------------------------------ rank <-> coords
    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} out of range: valid ranks are 0..{self.world_size - 1}")
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each dim (mixed-radix digits of the rank)."""
        self._check_rank(rank)
        sizes, strides = self.sizes, self._strides
        return {d: rank // strides[d] % sizes[d] for d in DIMS}

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Inverse of :meth:`coords`: the global rank at the given coordinates."""
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        for d, c in coords.items():
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < self.sizes[d]:
                raise ValueError(f"{d}={c!r} out of range: {d} coordinates are 0..{self.sizes[d] - 1}")
        return sum(c * self._strides[d] for d, c in coords.items())

    # --------------------------------------------------------------- groups
    def groups(self, dims: str | Iterable[str]) -> list[list[int]]:
        """All groups along ``dims`` (e.g. ``"dp"`` or ``"tp-pp"``).

        A group holds the ranks whose coordinates along ``dims`` vary while all
        other coordinates are fixed, so the groups partition ``range(world_size)``.
        Each group is ascending and the list is sorted by first rank, which is
        also the order Megatron generates them in: every rank can iterate it
        identically, as ``torch.distributed.new_group`` requires.
        """
        return _orthogonal_groups(self.world_size, self._strides, self.sizes, parse_dims(dims))

    def group_of(self, rank: int, dims: str | Iterable[str]) -> list[int]:
        """The group along ``dims`` that contains ``rank`` (ascending)."""
        masked = parse_dims(dims)
        c = self.coords(rank)
        base = rank - sum(c[d] * self._strides[d] for d in masked)  # zero the masked coords
        members = [base]
        for d in masked:  # a Cartesian product, one dim at a time
            members = [m + i * self._strides[d] for i in range(self.sizes[d]) for m in members]
        return sorted(members)

    # ---------------------------------------------------------------- nodes
    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node  # type: ignore[operator]

    def node_of(self, rank: int) -> int:
        """The node hosting ``rank`` (ranks fill nodes in order)."""
        return self._check_rank(rank) // self.gpus_per_node  # type: ignore[operator]

    def crosses_nodes(self, group: Iterable[int]) -> bool:
        """True if ``group`` spans more than one node (its traffic leaves NVLink)."""
        return len({self.node_of(r) for r in group}) > 1

    def crossing_groups(self, dims: str | Iterable[str]) -> list[list[int]]:
        """The groups along ``dims`` that span more than one node."""
        return [g for g in self.groups(dims) if self.crosses_nodes(g)]

    # -------------------------------------------------------------- display
    def __repr__(self) -> str:
        sizes = " ".join(f"{d}={s}" for d, s in self.sizes.items())
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        experts += f" etp={self.etp}" if self.etp != self.tp else ""
        return f"ParallelGrid(world={self.world_size}: {sizes}{experts}, order={self.order})"

    def formula(self) -> str:
        """The rank formula, e.g. ``rank = tp + 2*(cp + 1*(dp + 2*pp))``."""
        dims = self.order_dims
        text = dims[-1]
        for d in reversed(dims[:-1]):
            text = f"{d} + {self.sizes[d]}*{text if text in DIMS else f'({text})'}"
        return f"rank = {text}"

    def describe(self, dims: Iterable[str] = DIMS, max_groups: int = 16) -> str:
        """Multi-line summary: layout, nodes, and each dim's groups.

        Groups that cross nodes are marked with ``*``. At most ``max_groups``
        groups are printed per dim.
        """
        lines = [repr(self), _("{nodes} node(s) x {gpus} GPUs; {formula}").format(
            nodes=self.num_nodes, gpus=self.gpus_per_node, formula=self.formula())]
        for dims_ in dims:
            gs = self.groups(dims_)
            lines += _group_lines("-".join(parse_dims(dims_)), gs, [self.crosses_nodes(g) for g in gs], max_groups)
        if self.num_nodes > 1:
            lines.append(_("(* = group spans more than one node)"))
        return "\n".join(lines)


def _group_lines(name: str, gs: list[list[int]], crosses: list[bool], max_groups: int) -> list[str]:
    """One dimension's groups for `describe`: how many, their size, how many cross nodes; then the groups."""
    if len(gs[0]) == 1:
        return [_("{name}: size 1 (every rank is its own group)").format(name=name)]
    more = [_("... ({count} more)").format(count=len(gs) - max_groups)] if len(gs) > max_groups else []
    return [_("{name}: {count} group(s) of {size}, {crossing} cross nodes").format(
        name=name, count=len(gs), size=len(gs[0]), crossing=sum(crosses)),
        "  " + " ".join([f"{g}{'*' if c else ''}" for g, c in zip(gs[:max_groups], crosses)] + more)]


@dataclass(frozen=True, repr=False)
class ExpertGrid:
    """The expert layers' ``etp x ep x edp x pp`` grid of a `ParallelGrid` (its ``expert``; module docstring).

    etp: the experts' tensor parallelism; ep: expert parallelism, the experts split over its ranks; edp: the
    expert-data-parallel replicas of each expert, ``world / (etp * ep * pp)``, over which their gradients are
    averaged; pp: the same stages as the dense layers. ``order`` names the four, fastest first."""

    world_size: int
    etp: int
    ep: int
    pp: int
    order: str = "etp-ep-edp-pp"
    gpus_per_node: int | None = None
    _strides: dict[str, int] = field(init=False, compare=False, hash=False, default_factory=dict)

    def __post_init__(self) -> None:
        if sorted(self.order.split("-")) != sorted(EXPERT_DIMS):
            raise ValueError(f"expert order {self.order!r} must name each of {', '.join(EXPERT_DIMS)} once")
        stride = 1
        for name in self.order.split("-"):
            self._strides[name] = stride
            stride *= self.sizes[name]

    edp = property(lambda self: self.world_size // (self.etp * self.ep * self.pp))   # expert-data-parallel size

    @property
    def sizes(self) -> dict[str, int]:
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each expert dim."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} out of range: valid ranks are 0..{self.world_size - 1}")
        return {d: rank // self._strides[d] % self.sizes[d] for d in EXPERT_DIMS}

    def groups(self, dims: str | Iterable[str]) -> list[list[int]]:
        """All groups along ``dims`` of the expert grid (``"ep"``, ``"edp"``, ``"etp-ep"``, ...), as
        `ParallelGrid.groups`."""
        return _orthogonal_groups(self.world_size, self._strides, self.sizes, parse_dims(dims, EXPERT_DIMS))

    def group_of(self, rank: int, dims: str | Iterable[str]) -> list[int]:
        """The group along ``dims`` that contains ``rank``."""
        self.coords(rank)                                                            # refuses a bad rank
        return next(g for g in self.groups(dims) if rank in g)

    def __repr__(self) -> str:
        sizes = " ".join(f"{d}={s}" for d, s in self.sizes.items())
        return f"ExpertGrid(world={self.world_size}: {sizes}, order={self.order})"

    def describe(self, max_groups: int = 16) -> str:
        """Multi-line summary of the expert groups (``*``: the group spans nodes)."""
        gpn = self.gpus_per_node or self.world_size
        lines = [repr(self)]
        for d in ("etp", "ep", "edp"):
            gs = self.groups(d)
            lines += _group_lines(d, gs, [len({r // gpn for r in g}) > 1 for g in gs], max_groups)
        return "\n".join(lines)
