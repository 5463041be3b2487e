"""Tests for parlab.parallel.topology (pure) and parlab.parallel.groups (one multi-process test)."""

from __future__ import annotations

import itertools

import pytest

from parlab.launch import run
from parlab.parallel.topology import DIMS, ParallelGrid

COMBOS = ["tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-cp", "tp-cp-dp-pp"]


def as_sets(groups: list[list[int]]) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


# ---------------------------------------------------------------- seed example
@pytest.fixture
def seed() -> ParallelGrid:
    return ParallelGrid(16, tp=2, pp=4, dp=2, gpus_per_node=8)


def test_seed_example_groups(seed):
    assert seed.sizes == {"tp": 2, "cp": 1, "dp": 2, "pp": 4}
    assert as_sets(seed.groups("tp")) == as_sets(
        [[0, 1], [4, 5], [8, 9], [12, 13], [2, 3], [6, 7], [10, 11], [14, 15]]
    )
    assert as_sets(seed.groups("pp")) == as_sets([[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]])
    assert as_sets(seed.groups("dp")) == as_sets(
        [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    )
    assert as_sets(seed.groups("tp-pp")) == as_sets([[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]])
    assert seed.groups("cp") == [[r] for r in range(16)]
    # cp=1, so the dp-cp group is just the dp group.
    assert seed.groups("dp-cp") == seed.groups("dp")


def test_seed_example_nodes(seed):
    assert seed.num_nodes == 2
    assert [seed.node_of(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert seed.crossing_groups("tp") == []
    assert seed.crossing_groups("dp") == []
    assert seed.crossing_groups("pp") == seed.groups("pp")
    assert all(seed.crosses_nodes(g) for g in seed.groups("tp-pp"))
    assert not seed.crosses_nodes([0, 7]) and seed.crosses_nodes([7, 8])


def test_seed_example_display(seed):
    assert repr(seed) == "ParallelGrid(world=16: tp=2 cp=1 dp=2 pp=4, order=tp-cp-dp-pp)"
    text = seed.describe()
    assert "2 node(s) x 8 GPUs" in text
    assert "pp: 4 group(s) of 4, 4 cross nodes" in text
    assert "[0, 4, 8, 12]*" in text and "[0, 1]*" not in text
    assert seed.formula() == "rank = tp + 2*(cp + 1*(dp + 2*pp))"


def test_group_of_and_order_are_deterministic(seed):
    for dims in COMBOS:
        gs = seed.groups(dims)
        assert gs == sorted(gs) and all(g == sorted(g) for g in gs)
        for r in range(16):
            assert seed.group_of(r, dims) in gs and r in seed.group_of(r, dims)
    # A combination names a set of dims: spelling order does not matter.
    assert seed.groups("pp-tp") == seed.groups("tp-pp") == seed.groups(("pp", "tp"))
    assert seed.group_of(5, "pp-tp") == [0, 1, 4, 5, 8, 9, 12, 13]


# ----------------------------------------------------------- layout formulas
CONFIGS = [  # (world, tp, pp, cp)
    (1, 1, 1, 1), (8, 8, 1, 1), (8, 2, 2, 1), (8, 1, 1, 8), (16, 2, 4, 1), (16, 2, 2, 2),
    (24, 2, 3, 1), (32, 4, 2, 2), (48, 3, 2, 2), (64, 8, 4, 1), (64, 2, 2, 4), (96, 4, 3, 2),
]  # fmt: skip


@pytest.mark.parametrize("world,tp,pp,cp", CONFIGS)
def test_megatron_default_formula(world, tp, pp, cp):
    g = ParallelGrid(world, tp=tp, pp=pp, cp=cp)
    dp = world // (tp * pp * cp)
    assert g.dp == dp
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        r = t + tp * (c + cp * (d + dp * p))
        assert g.rank(tp=t, cp=c, dp=d, pp=p) == r
        assert g.coords(r) == {"tp": t, "cp": c, "dp": d, "pp": p}


def test_alternative_order():
    # dp slower than pp: pp stages are neighbours, data-parallel replicas far apart.
    g = ParallelGrid(16, tp=2, pp=4, order="tp-cp-pp-dp")
    for t, d, p in itertools.product(range(2), range(2), range(4)):
        assert g.rank(tp=t, dp=d, pp=p) == t + 2 * (p + 4 * d)
    assert g.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("dp") == [[r, r + 8] for r in range(8)]
    assert g.groups("tp-pp") == [list(range(8)), list(range(8, 16))]
    assert g.strides == {"tp": 1, "cp": 2, "pp": 2, "dp": 8}
    # Fully reversed: tp is now the slowest dimension.
    h = ParallelGrid(16, tp=2, pp=4, order="pp-dp-cp-tp")
    assert h.groups("tp") == [[r, r + 8] for r in range(8)]
    assert h.groups("pp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert h != g and h == ParallelGrid(16, tp=2, pp=4, dp=2, order="pp-dp-cp-tp")


# --------------------------------------------- partition sweep up to 1024 GPUs
SWEEP = [
    (w, tp, pp, cp)
    for w in (1, 8, 16, 64, 512, 1024)
    for tp, pp, cp in [(1, 1, 1), (2, 1, 1), (8, 1, 1), (2, 4, 1), (8, 8, 2), (4, 2, 4), (8, 16, 1)]
    if w % (tp * pp * cp) == 0
]


@pytest.mark.parametrize("world,tp,pp,cp", SWEEP)
def test_partition_sweep(world, tp, pp, cp):
    gpn = min(world, 8)
    g = ParallelGrid(world, tp=tp, pp=pp, cp=cp, gpus_per_node=gpn)
    everyone = list(range(world))
    for r in everyone:
        assert g.rank(**g.coords(r)) == r
    for dims in COMBOS:
        gs = g.groups(dims)
        expected = 1
        for d in dims.split("-"):
            expected *= g.sizes[d]
        assert all(len(x) == expected for x in gs)
        assert len(gs) == world // expected
        assert sorted(itertools.chain.from_iterable(gs)) == everyone  # a partition
    # Default order puts tp innermost: tp groups never leave a node when tp <= gpus_per_node.
    assert g.crossing_groups("tp") == []
    assert g.num_nodes == world // gpn


# --------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=12, tp=2, pp=4), r"world_size 12 is not divisible by tp\*pp\*cp = 8"),
        (dict(world_size=16, tp=2, pp=2, dp=3), r"dp=3 but world_size 16 / \(tp\*pp\*cp = 4\) = 4"),
        (dict(world_size=16, tp=0), r"tp must be a positive int, got 0"),
        (dict(world_size=16, pp=-2), r"pp must be a positive int, got -2"),
        (dict(world_size=16, cp=2.0), r"cp must be a positive int, got 2.0 \(float\)"),
        (dict(world_size=16, tp=True), r"tp must be a positive int"),
        (dict(world_size=0), r"world_size must be a positive int"),
        (dict(world_size="8"), r"world_size must be a positive int"),
        (dict(world_size=16, dp=0), r"dp must be a positive int"),
        (dict(world_size=16, order="tp-cp-dp"), r"must name each of tp, cp, dp, pp exactly once"),
        (dict(world_size=16, order="tp-cp-dp-pp-dp"), r"must name each of tp, cp, dp, pp exactly once"),
        (dict(world_size=16, order="tp-sp-dp-pp"), r"unknown dimension name\(s\) \['sp'\] in order"),
        (dict(world_size=16, order="tp,cp,dp,pp"), r"unknown dimension name"),
        (dict(world_size=16, gpus_per_node=0), r"gpus_per_node must be a positive int"),
        (dict(world_size=12, gpus_per_node=8), r"world_size 12 is not divisible by gpus_per_node=8"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelGrid(**kwargs)


def test_method_errors(seed):
    with pytest.raises(ValueError, match=r"unknown dimension name\(s\) \['ep'\]"):
        seed.groups("ep")
    with pytest.raises(ValueError, match=r"unknown dimension name\(s\) \['pipe'\]"):
        seed.group_of(0, "tp-pipe")
    with pytest.raises(ValueError, match="dimension repeated"):
        seed.groups("tp-tp")
    with pytest.raises(ValueError, match="dims must be names"):
        seed.groups("")
    with pytest.raises(ValueError, match=r"rank 16 out of range: valid ranks are 0\.\.15"):
        seed.coords(16)
    with pytest.raises(ValueError, match="rank -1 out of range"):
        seed.node_of(-1)
    with pytest.raises(ValueError, match=r"pp=4 out of range: pp coordinates are 0\.\.3"):
        seed.rank(pp=4)


def test_grid_is_frozen(seed):
    with pytest.raises(AttributeError):
        seed.tp = 4  # type: ignore[misc]
    assert hash(seed) == hash(ParallelGrid(16, tp=2, pp=4, gpus_per_node=8))
    assert set(DIMS) == {"tp", "cp", "dp", "pp"}


def test_topology_does_not_import_torch():
    # Load the module file on its own: parlab/__init__ imports torch, topology must not.
    import subprocess
    import sys

    import parlab.parallel.topology

    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('topology', {parlab.parallel.topology.__file__!r}); "
        "m = sys.modules['topology'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "assert m.ParallelGrid(16, tp=2).dp == 8; "
        "assert 'torch' not in sys.modules, 'topology imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------- process groups, 8 real ranks
def _check_groups() -> dict:
    import torch
    import torch.distributed as dist

    from parlab.parallel.groups import build_groups

    grid = ParallelGrid(8, tp=2, pp=2, dp=2)
    pg = build_groups(grid)
    rank = dist.get_rank()
    errors = []
    for bad in (lambda: build_groups(ParallelGrid(16, tp=2)), lambda: pg.get("cp-pp"), lambda: pg.nope):
        try:
            bad()
        except Exception as e:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(e).__name__}: {e}")
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=pg.tp)
    return {
        "coords": pg.coords,
        "ranks": {d: pg.ranks(d) for d in ("tp", "pp", "dp", "mp", "dp-cp")},
        "tp_sum": x.item(),
        "pp": (pg.prev_rank("pp"), pg.next_rank("pp"), pg.is_first("pp"), pg.is_last("pp")),
        "local": {d: pg.local_rank(d) for d in ("tp", "pp", "dp")},
        "same_mp": pg.mp is pg.get("tp-pp") is pg.tp_pp,
        "world_size_tp": dist.get_world_size(group=pg.tp),
        "errors": errors,
    }


def test_build_groups_on_8_ranks():
    grid = ParallelGrid(8, tp=2, pp=2, dp=2)
    results = run(_check_groups, 8, backend="gloo", echo=False).results
    assert len(results) == 8
    for rank, res in enumerate(results):
        c = grid.coords(rank)
        assert res["coords"] == c
        for d in ("tp", "pp", "dp"):
            assert res["ranks"][d] == grid.group_of(rank, d)
            assert res["local"][d] == c[d]
        assert res["ranks"]["mp"] == grid.group_of(rank, "tp-pp")
        assert res["tp_sum"] == sum(grid.group_of(rank, "tp"))
        pp = grid.group_of(rank, "pp")
        other = pp[1 - c["pp"]]
        assert res["pp"] == (other, other, c["pp"] == 0, c["pp"] == 1)
        assert res["same_mp"] and res["world_size_tp"] == 2
        wrong_world, not_built, no_attr = res["errors"]
        assert wrong_world.startswith("ValueError: grid.world_size=16 but torch.distributed has 8 ranks")
        assert not_built.startswith("KeyError") and "build_groups" in not_built
        assert no_attr.startswith("AttributeError") and "'nope'" in no_attr


def test_build_groups_needs_init():
    from parlab.parallel.groups import build_groups

    with pytest.raises(RuntimeError, match="not initialized"):
        build_groups(ParallelGrid(8, tp=2))


# ---------------------------------------------------------------- the expert grid (MoE parallel folding)
def _megatron_groups(world, sizes, order, token):
    """Megatron-Core's RankGenerator.get_ranks (parallel_state.py), transcribed as an independent oracle: the
    order completed with the size-1 dims it lacks, then generate_masked_orthogonal_rank_groups."""
    for name, size in sizes.items():
        if name not in order.split("-"):
            assert size == 1
            order += "-" + name
    names = order.split("-")
    shape = [sizes[n] for n in names]
    mask = [n in token.split("-") for n in names]

    def prefix(a):
        out = [1]
        for v in a:
            out.append(out[-1] * v)
        return out

    def decompose(i, shp):
        return [(i // d) % s for s, d in zip(shp, prefix(shp))]

    stride = prefix(shape)
    m_shape = [s for s, k in zip(shape, mask) if k]
    u_shape = [s for s, k in zip(shape, mask) if not k]
    m_stride = [d for d, k in zip(stride, mask) if k]
    u_stride = [d for d, k in zip(stride, mask) if not k]
    size = prefix(m_shape)[-1]
    return [[sum(a * b for a, b in zip(decompose(j, m_shape), m_stride))
             + sum(a * b for a, b in zip(decompose(g, u_shape), u_stride)) for j in range(size)]
            for g in range(world // size)]


EXPERT_LAYOUTS = [(8, 1, 1, 1, 8, None), (8, 2, 1, 1, 4, None), (8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 4, None),
                  (16, 4, 1, 2, 2, 2), (16, 1, 4, 2, 2, None), (32, 2, 2, 2, 4, 1), (32, 4, 2, 1, 8, 2),
                  (64, 8, 2, 2, 8, 1), (64, 2, 4, 2, 4, 4)]


@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", EXPERT_LAYOUTS)
def test_dense_and_expert_groups_equal_megatrons_rank_generators(world, tp, pp, cp, ep, etp):
    g = ParallelGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    dense = {"tp": tp, "pp": pp, "dp": g.dp, "ep": 1, "cp": cp}
    for token in ("tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-cp-dp-pp"):
        assert g.groups(token) == _megatron_groups(world, dense, "tp-cp-ep-dp-pp", token), token
    e = g.expert
    assert (e.etp, e.ep, e.edp, e.pp) == (etp or tp, ep, world // ((etp or tp) * ep * pp), pp)
    experts = {"tp": e.etp, "pp": pp, "dp": e.edp, "ep": ep, "cp": 1}
    for ours, theirs in (("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("etp-ep", "tp-ep"), ("etp-ep-pp", "tp-ep-pp")):
        assert e.groups(ours) == _megatron_groups(world, experts, "tp-cp-ep-dp-pp", theirs), ours
    for r in range(world):                     # every rank: one EP group and one EDP group, disjoint but one
        assert set(e.group_of(r, "ep")) & set(e.group_of(r, "edp")) == {r}
        assert g.expert.coords(r)["pp"] == g.coords(r)["pp"]          # the same stage in both grids


def test_expert_grid_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"world_size 16 is not divisible by etp\*ep\*pp = 24"):
        ParallelGrid(16, tp=2, pp=2, ep=6)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        ParallelGrid(8, ep=0)
    with pytest.raises(ValueError, match=r"the expert layers' groups are grid.expert.groups"):
        ParallelGrid(8, ep=2).groups("ep")
    with pytest.raises(ValueError, match=r"unknown dimension name\(s\) \['dp'\]"):
        ParallelGrid(8, ep=2).expert.groups("dp")
    assert repr(ParallelGrid(8, tp=2, ep=4)) == "ParallelGrid(world=8: tp=2 cp=1 dp=4 pp=1 ep=4, order=tp-cp-dp-pp)"
