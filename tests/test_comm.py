"""Traced communication: each wrapper behaves like torch's and records exactly what it sent."""
import json

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import comm
from parlab.trace import Trace, recording, region, wire_bytes


def _every_collective(n):
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.full((n,), float(r + 1))                    # (n,) float32 on every rank
    out = {}
    t = x.clone(); comm.all_reduce(t, label="ar"); out["all_reduce"] = t
    t = x.clone(); comm.broadcast(t, src=w - 1); out["broadcast"] = t
    t = x.clone(); comm.reduce(t, dst=0); out["reduce"] = t if r == 0 else None
    g = torch.empty(n * w); comm.all_gather(g, x); out["all_gather"] = g
    s = torch.empty(n); comm.reduce_scatter(s, torch.arange(n * w, dtype=torch.float32)); out["reduce_scatter"] = s
    a = torch.empty(n * w); comm.all_to_all(a, torch.arange(n * w, dtype=torch.float32) + 100 * r)
    out["all_to_all"] = a
    gl = [torch.empty(n) for _ in range(w)] if r == 0 else None
    comm.gather(x, gl, dst=0); out["gather"] = gl
    sc = torch.empty(n); comm.scatter(sc, [torch.full((n,), float(j)) for j in range(w)] if r == 0 else None, src=0)
    out["scatter"] = sc
    comm.barrier()
    # a ring of point-to-point messages, half blocking, half asynchronous
    nxt, prv = (r + 1) % w, (r - 1) % w
    buf = torch.empty(n)
    if r % 2 == 0:
        comm.send(x, nxt); comm.recv(buf, prv)
    else:
        comm.recv(buf, prv); comm.send(x, nxt)
    out["ring"] = buf
    reqs = [comm.isend(x * 2, nxt, label="async"), comm.irecv(buf2 := torch.empty(n), prv, label="async")]
    [q.wait() for q in reqs]
    out["async_ring"] = buf2
    with region("compute", label="matmul"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_wrappers_compute_what_torch_computes(world_size):
    n = 6
    res = parlab.run(_every_collective, world_size, n, trace=True)
    w = world_size
    total = w * (w + 1) / 2
    for r, out in enumerate(res.results):
        assert torch.equal(out["all_reduce"], torch.full((n,), total))
        assert torch.equal(out["broadcast"], torch.full((n,), float(w)))
        assert torch.equal(out["all_gather"], torch.cat([torch.full((n,), float(j + 1)) for j in range(w)]))
        assert torch.equal(out["reduce_scatter"], w * torch.arange(r * n, (r + 1) * n, dtype=torch.float32))
        assert torch.equal(out["all_to_all"], torch.cat([torch.arange(r * n, (r + 1) * n) + 100.0 * j
                                                         for j in range(w)]))
        assert torch.equal(out["scatter"], torch.full((n,), float(r)))
        assert torch.equal(out["ring"], torch.full((n,), float((r - 1) % w + 1)))
        assert torch.equal(out["async_ring"], torch.full((n,), 2.0 * ((r - 1) % w + 1)))
    assert torch.equal(res[0]["reduce"], torch.full((n,), total))
    assert [g[0].item() for g in res[0]["gather"]] == [j + 1.0 for j in range(w)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_trace_counts_and_bytes(world_size):
    n, w = 6, world_size
    tr = parlab.run(_every_collective, w, n, trace=True).trace
    x = n * 4  # bytes of one (n,) float32 tensor
    for r in range(w):
        rows = {row["op"]: row for row in tr.table() if row["rank"] == r}
        assert rows["all_reduce"]["calls"] == 1 and rows["all_reduce"]["payload_bytes"] == x
        assert rows["all_reduce"]["sent_bytes"] == pytest.approx(2 * (w - 1) / w * x)
        assert rows["all_gather"]["payload_bytes"] == w * x
        assert rows["all_gather"]["sent_bytes"] == pytest.approx((w - 1) * x)       # (N-1)/N of N*x
        assert rows["reduce_scatter"]["sent_bytes"] == pytest.approx((w - 1) * x)
        assert rows["all_to_all"]["sent_bytes"] == pytest.approx((w - 1) * x)
        assert rows["send"]["calls"] == 2 and rows["send"]["payload_bytes"] == 2 * x   # blocking + async
        assert rows["recv"]["calls"] == 2 and rows["recv"]["recv_bytes"] == 2 * x
        assert rows["barrier"]["calls"] == 1
        assert rows["gather"]["sent_bytes"] == (0 if r == 0 else x)
        assert rows["scatter"]["recv_bytes"] == (0 if r == 0 else x)
    # a broadcast chain from rank w-1: everyone but the root receives x, everyone but the chain's end sends x
    bsent = tr.bytes_per_rank("broadcast")
    assert sum(bsent.values()) == (w - 1) * x and bsent[w - 2] == 0
    # every call of every rank is one event; p2p events name their peer; async events have an end time
    ev = tr.filter(rank=1)
    assert len(ev.comm()) == 13
    sends = tr.filter(op="send", rank=1).events
    assert all(e.peer == 2 % w for e in sends)
    asyncs = [e for e in tr.events if e.asynchronous]
    assert len(asyncs) == 2 * w and all(e.end >= e.start for e in asyncs)
    assert tr.count("all_reduce") == w and tr.filter(label="ar").events[0].label == "ar"
    assert len(tr.filter(kind="compute")) == w and tr.filter(kind="compute").events[0].label == "matmul"
    assert all(e.group == tuple(range(w)) for e in tr.comm())


def test_chrome_trace_has_one_event_per_call(tmp_path):
    tr = parlab.run(_every_collective, 2, 4, trace=True).trace
    doc = tr.to_chrome(str(tmp_path / "t.json"))
    loaded = json.load(open(tmp_path / "t.json"))
    assert loaded == json.loads(json.dumps(doc))
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tr.events)
    assert {e["tid"] for e in spans} == {0, 1} and min(e["ts"] for e in spans) == 0
    assert all(e["dur"] >= 0 for e in spans)
    recs = tr.records()
    assert len(recs) == len(tr) and recs[0]["start"] == 0.0 and "wire_bytes" in recs[0]


def _untraced():
    t = torch.ones(3)
    comm.all_reduce(t)
    w = comm.isend(t, (dist.get_rank() + 1) % 2)
    b = torch.empty(3)
    comm.recv(b, (dist.get_rank() + 1) % 2)
    w.wait()
    with recording() as rec:          # recording can also be switched on locally, e.g. under torchrun
        comm.all_reduce(t, label="local")
    return len(rec.events), rec.events[0].label, type(w).__name__


def test_tracing_off_records_nothing_and_returns_torch_handles():
    res = parlab.run(_untraced, 2)
    assert res.trace is None
    assert res.results[0][:2] == (1, "local")
    assert res.results[0][2] != "TracedWork"


def _groups():
    r = dist.get_rank()
    even = dist.new_group([0, 2])
    odd = dist.new_group([1, 3])
    mine = even if r % 2 == 0 else odd
    t = torch.tensor([float(r)])
    comm.all_reduce(t, group=mine)
    g = comm.all_gather_dim(torch.tensor([[float(r)]]), dim=1, group=mine)     # (1, 2)
    s = comm.reduce_scatter_dim(torch.arange(4.0).reshape(2, 2), dim=1, group=mine)  # (2, 1)
    parts = comm.all_gather_uneven(torch.arange(float(r + 1)), group=mine)
    return t.item(), g.tolist(), s.tolist(), [p.tolist() for p in parts]


def test_subgroups_and_tensor_helpers():
    res = parlab.run(_groups, 4, trace=True)
    assert [x[0] for x in res.results] == [2.0, 4.0, 2.0, 4.0]
    assert res[0][1] == [[0.0, 2.0]] and res[3][1] == [[1.0, 3.0]]
    assert res[0][2] == [[0.0], [4.0]] and res[2][2] == [[2.0], [6.0]]
    assert res[1][3] == [[0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]
    groups = {e.group for e in res.trace.filter(op="all_reduce")}
    assert groups == {(0, 2), (1, 3)}


def _bad_rs():
    comm.reduce_scatter_dim(torch.ones(3), dim=0)


def test_reduce_scatter_size_error():
    with pytest.raises(parlab.RankError, match="size 3 is not divisible by the group size 2"):
        parlab.run(_bad_rs, 2, echo=False)


def test_wire_byte_formulas():
    assert wire_bytes("all_reduce", 800, 4) == 1200
    assert wire_bytes("all_gather", 800, 4) == 600
    assert wire_bytes("all_reduce", 800, 1) == 0
    assert Trace([]).table() == []
