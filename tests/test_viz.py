"""parlab.viz: figures built from a real traced run have the structure a student reads off them."""
import math
import pathlib
import time

import plotly.io as pio
import pytest
import torch

import parlab
from parlab import comm, viz
from parlab.trace import COLLECTIVES, Event, Trace, mark, region
from parlab.viz import style
from parlab.viz.timeline import ASYNC_SHIFT, ASYNC_WIDTH, SYNC_WIDTH

WORLD = 4


def _lesson(n=16):
    """A little of everything: a compute region, two collectives, a ring of sends, an overlapped async all-reduce."""
    r, w = comm.get_rank(), comm.get_world_size()
    with region("forward", label="mb 0"):
        torch.randn(16, 16) @ torch.randn(16, 16)
    x = torch.ones(n)                                        # (n,) float32: 64 bytes
    comm.all_reduce(x, label="grads")
    comm.broadcast(x, src=0, label="weights")
    buf, nxt, prv = torch.empty(n), (r + 1) % w, (r - 1) % w
    if r % 2 == 0:                                           # even ranks send first, odd ranks receive first
        comm.send(x, nxt, label="ring"); comm.recv(buf, prv, label="ring")
    else:
        comm.recv(buf, prv, label="ring"); comm.send(x, nxt, label="ring")
    work = comm.all_reduce(torch.ones(4 * n), async_op=True, label="grad bucket 0")
    with region("backward"):
        time.sleep(0.001)
    work.wait()
    mark("step done")
    return r


@pytest.fixture(scope="module")
def trace() -> Trace:
    return parlab.run(_lesson, WORLD, trace=True).trace


def _points(fig, name):
    """(base, width, y, hovertext) of every bar of the trace called `name`."""
    (t,) = [d for d in fig.data if d.name == name]
    return list(zip(t.base, t.x, t.y, t.hovertext))


# ---------------------------------------------------------------------- timeline
def test_timeline_one_lane_per_rank_rank0_on_top(trace):
    fig = viz.timeline(trace, title="lesson")
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(WORLD)]
    assert list(fig.layout.yaxis.tickvals) == list(range(WORLD))
    lo, hi = fig.layout.yaxis.range
    assert lo > hi                                             # reversed: lane 0 (rank 0) at the top
    assert fig.layout.title.text == "lesson" and fig.layout.barmode == "overlay"


def test_timeline_one_bar_per_event_in_its_lane(trace):
    fig = viz.timeline(trace)                                  # milliseconds since the first event
    bars = [d for d in fig.data if d.type == "bar"]
    assert sum(len(d.base) for d in bars) == len([e for e in trace if e.kind != "mark"])
    assert len(bars) == len({(e.kind, e.op) for e in trace if e.kind != "mark"})   # one trace per colour
    for e in trace:
        if e.kind == "mark":
            continue
        lane = e.rank + (ASYNC_SHIFT if e.asynchronous else 0.0)
        hits = [p for p in _points(fig, e.op) if p[0] == pytest.approx((e.start - trace.t0) * 1e3)
                and p[1] == pytest.approx(e.duration * 1e3) and p[2] == pytest.approx(lane)]
        assert len(hits) >= 1, e
    (ar,) = [d for d in fig.data if d.name == "all_reduce"]
    assert ar.marker.color == style.COLLECTIVE_COLORS["all_reduce"]
    (fwd,) = [d for d in fig.data if d.name == "forward"]
    assert fwd.marker.color == style.COMPUTE_COLORS["forward"] and fwd.legendgroup == "compute"


def test_async_collectives_are_thin_and_offset_so_overlap_shows(trace):
    fig = viz.timeline(trace)
    (ar,) = [d for d in fig.data if d.name == "all_reduce"]
    for y, width, hover in zip(ar.y, ar.width, ar.hovertext):
        if "grad bucket 0" in hover:                           # the async one
            assert width == ASYNC_WIDTH and y % 1 == pytest.approx(ASYNC_SHIFT) and "async" in hover
        else:
            assert width == SYNC_WIDTH and y == int(y)
    names = [d.name for d in fig.data]
    assert names.index("backward") < names.index("all_reduce")   # communication is drawn over compute


def test_hover_shows_op_label_bytes_group_peer(trace):
    fig = viz.timeline(trace)
    grads = [h for *_, h in _points(fig, "all_reduce") if "grads" in h]
    assert len(grads) == WORLD
    assert all("payload 64 B" in h and "wire 96 B" in h and "group [0, 1, 2, 3]" in h and "16 × float32" in h
               for h in grads)                                 # 2 (N-1)/N * 64 B = 96 B on the wire
    sends = [h for *_, h in _points(fig, "send")]
    assert len(sends) == WORLD and all("ring" in h and "peer" in h and "64 B" in h and "duration" in h
                                       for h in sends)
    assert all("root 0" in h for *_, h in _points(fig, "broadcast"))


def test_marks_are_markers(trace):
    fig = viz.timeline(trace, show_labels=True)
    (m,) = [d for d in fig.data if d.name == "marks"]
    assert m.type == "scatter" and m.marker.symbol == "diamond"
    assert sorted(m.y) == list(range(WORLD)) and list(m.text) == ["step done"] * WORLD


def test_timeline_options(trace):
    fig = viz.timeline(trace, ranks=[2, 0], time_unit="us")
    assert list(fig.layout.yaxis.ticktext) == ["rank 2", "rank 0"]
    lanes = {y for d in fig.data for y in d.y}
    assert lanes <= {0, 1, ASYNC_SHIFT, 1 + ASYNC_SHIFT}        # rank 2 in lane 0, rank 0 in lane 1, no others
    (e,) = [e for e in trace.filter(rank=2, op="broadcast")]
    (lane0,) = [p[:3] for p in _points(fig, "broadcast") if p[2] == 0]
    assert lane0 == pytest.approx(((e.start - trace.t0) * 1e6, e.duration * 1e6, 0))
    assert "us" in fig.layout.xaxis.title.text
    with pytest.raises(ValueError, match="time_unit"):
        viz.timeline(trace, time_unit="hours")


# ---------------------------------------------------------------------- plain records
def test_records_input_draws_the_same(trace):
    a, b = viz.timeline(trace), viz.timeline(trace.records())
    assert [d.name for d in a.data] == [d.name for d in b.data]
    for da, db in zip(a.data, b.data):
        assert list(da.x) == pytest.approx(list(db.x)) and list(da.y) == list(db.y)
    back = viz.from_records(trace.records(relative=False))
    assert [(e.rank, e.op, e.wire_bytes, e.group) for e in back] == [(e.rank, e.op, e.wire_bytes, e.group)
                                                                     for e in trace]


def test_schedule_records_without_events():
    sched = [dict(rank=0, op="forward", start=0, end=1, label="mb 0"),
             dict(rank=1, op="forward", start=1, end=2, label="mb 0"),
             dict(rank=0, op="send", start=1, end=1.5, nbytes=4096, peer=1, group=[0, 1], label="act mb 0"),
             dict(rank=1, op="bubble done", start=2, end=2)]
    tr = viz.from_records(sched)
    assert [e.kind for e in tr] == ["compute", "p2p", "compute", "mark"]
    fig = viz.timeline(sched, time_unit="steps", show_labels=True)
    assert [p[:3] for p in _points(fig, "forward")] == [(0, 1, 0), (1, 1, 1)]
    assert [p[:3] for p in _points(fig, "send")] == [(1, 0.5, 0)]
    assert "4.10 kB" in _points(fig, "send")[0][3]
    assert list([d for d in fig.data if d.name == "forward"][0].text) == ["mb 0", "mb 0"]
    steps = viz.comm_steps(sched)                              # a send without its recv is still one step
    assert len(steps) == 1 and steps[0].edges == [(0, 1, 4096.0)]


def test_bad_inputs_say_what_to_pass():
    with pytest.raises(ValueError, match="rank, op, start and end"):
        viz.timeline([dict(rank=0, op="forward", end=1)])
    with pytest.raises(ValueError, match="not a dict"):
        viz.from_records([("forward", 0, 1)])
    with pytest.raises(ValueError, match="parlab.Trace"):
        viz.timeline(42)
    with pytest.raises(ValueError, match="trace=True"):
        viz.timeline(parlab.RunResult(results=[0], outputs=[""], trace=None))


def test_empty_trace_gives_a_figure_that_says_so():
    for fig in (viz.timeline(Trace()), viz.comm_animation([]), viz.bytes_bars(Trace())):
        assert len(fig.data) == 0 and len(fig.frames) == 0
        assert "nothing" in fig.layout.annotations[0].text


# ---------------------------------------------------------------------- who sends what to whom
def test_steps_group_collectives_and_pair_sends_with_recvs(trace):
    steps = viz.comm_steps(trace)
    assert [s.op for s in steps].count("all_reduce") == 2 and [s.op for s in steps].count("broadcast") == 1
    p2p = [s for s in steps if s.kind == "p2p"]
    assert sorted(s.group for s in p2p) == sorted((r, (r + 1) % WORLD) for r in range(WORLD))
    for s in p2p:
        (send,) = [e for e in s.events if e.op == "send"]
        (recv,) = [e for e in s.events if e.op == "recv"]
        assert (send.rank, send.peer) == (recv.peer, recv.rank) == s.group
    for s in steps:
        if s.kind == "collective":
            assert sorted(e.rank for e in s.events) == list(range(WORLD))
    assert len(steps) == 7 and [s.start for s in steps] == sorted(s.start for s in steps)


def test_animation_frames_edges_and_slider(trace):
    fig = viz.comm_animation(trace, title="lesson", per_call=True)
    steps = viz.comm_steps(trace)
    assert len(fig.frames) == len(steps) == 7
    slider = fig.layout.sliders[0]
    assert len(slider.steps) == len(fig.frames)
    assert [list(s.args[0]) for s in slider.steps] == [[f.name] for f in fig.frames]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["▶ play", "❚❚ pause"]
    pos = {int(t): (x, y) for t, x, y in zip(fig.data[2].text, fig.data[2].x, fig.data[2].y)}
    assert pos[0] == pytest.approx((0, 1))                   # rank 0 on top
    for frame, step in zip(fig.frames, steps):
        arrows, labels, nodes, chunks = frame.data
        xs, ys = arrows.x, arrows.y
        assert len(xs) == 3 * len(step.edges)                # start, end, gap per arrow
        assert "lesson" in frame.layout.title.text and step.op in frame.layout.title.text
        for k, (a, b, nbytes) in enumerate(step.edges):     # the arrow runs from near a to near b
            start, end = (xs[3 * k], ys[3 * k]), (xs[3 * k + 1], ys[3 * k + 1])
            assert math.dist(start, pos[a]) < math.dist(start, pos[b])
            assert math.dist(end, pos[b]) < math.dist(end, pos[a])
            assert labels.text[k] == style.human_bytes(nbytes)
        if step.kind == "p2p":
            a, b = step.group
            assert b == (a + 1) % WORLD and f"send rank {a} → rank {b} 'ring'" in frame.layout.title.text
        if step.label == "grads":                            # ring 0 -> 1 -> 2 -> 3 -> 0, 96 B per arrow
            assert step.edges == [(0, 1, 96.0), (1, 2, 96.0), (2, 3, 96.0), (3, 0, 96.0)]
            assert list(labels.text) == ["96 B"] * 4 and "64 B payload" in frame.layout.title.text


@pytest.mark.parametrize("op", [op for op in COLLECTIVES])
def test_arrows_leaving_a_rank_carry_its_wire_bytes(op):
    group = (0, 1, 2, 3, 4)
    evs = [Event(rank=r, kind="collective", op=op, start=0.0, end=1.0, group=group, peer=2, nbytes=1000)
           for r in group]
    (step,) = viz.comm_steps(evs)
    for e in evs:
        assert sum(nb for a, _, nb in step.edges if a == e.rank) == pytest.approx(e.wire_bytes), (op, e.rank)


#: how many steps each algorithm takes on N ranks (ring all-reduce: N-1 reduce-scatter + N-1 all-gather steps)
ALGORITHM_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
                   "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1, "broadcast": lambda n: n - 1,
                   "reduce": lambda n: n - 1, "scatter": lambda n: n - 1, "gather": lambda n: n - 1,
                   "barrier": lambda n: 1}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("op", [op for op in COLLECTIVES])
def test_every_animation_has_a_frame_per_algorithm_step(op, n):
    """A collective's animation steps through its algorithm, each frame one step, and the arrows of all its
    frames together carry each rank's wire bytes."""
    group = tuple(range(n))
    evs = [Event(rank=r, kind="collective", op=op, start=0.0, end=1.0, group=group, peer=n - 1, nbytes=1000 * n)
           for r in group]
    fig = viz.comm_animation(evs, title=op)
    assert len(fig.frames) >= ALGORITHM_STEPS[op](n) and len(fig.frames) == len(fig.layout.sliders[0].steps)
    (step,) = viz.comm_steps(evs)
    moves = [m for _, ms in viz.algorithm_steps(step) for m in ms]
    for e in evs:
        assert sum(m.nbytes for m in moves if m.src == e.rank) == pytest.approx(e.wire_bytes), (op, e.rank)
    if op in ("all_reduce", "reduce_scatter", "all_gather") and n > 2:
        for (_, ms) in viz.algorithm_steps(step):           # in every ring step each rank sends one chunk to its right
            assert sorted((m.src, m.dst) for m in ms) == [(r, (r + 1) % n) for r in range(n)]
            assert len({m.chunk for m in ms}) == n           # ... and the n chunks are all different


def test_ring_all_reduce_frames_show_sums_building_then_travelling():
    n = 4
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=tuple(range(n)), nbytes=4000)
           for r in range(n)]
    fig = viz.comm_animation(evs)
    red = style.color("collective", "all_reduce")
    after_rs = fig.frames[n - 2].data[3].marker.color         # after n-1 reduce-scatter steps ...
    for r in range(n):                                       # ... rank r holds the complete sum of chunk r
        assert after_rs[r * n + r] == red
        assert sum(c == red for c in after_rs[r * n:(r + 1) * n]) == 1
    assert set(fig.frames[-1].data[3].marker.color) == {red}  # at the end every rank holds every complete chunk
    assert "chunk" in fig.frames[0].data[1].text[0] and "reduce-scatter 1/3" in fig.frames[0].layout.title.text
    assert "all-gather 3/3" in fig.frames[-1].layout.title.text


def test_animation_max_frames_and_static_html(trace):
    fig = viz.comm_animation(trace, max_frames=3, per_call=True)
    assert len(fig.frames) == 3 == len(fig.layout.sliders[0].steps)
    assert "first 3 of 7 steps" in fig.layout.title.text
    fig = viz.comm_animation(trace, max_frames=3)
    assert len(fig.frames) == 3 and "first 3 of 19 frames" in fig.layout.title.text   # 6 + 3 + 4 sends + 6
    with pytest.raises(ValueError, match="max_frames"):
        viz.comm_animation(trace, max_frames=0)
    html = pio.to_html(viz.comm_animation(trace), include_plotlyjs=True)
    assert "Plotly.addFrames" in html and "plotly.js" in html.lower()
    assert "<div" in pio.to_html(viz.timeline(trace), include_plotlyjs=True)


# ---------------------------------------------------------------------- bytes per rank
def test_bytes_bars_match_the_trace_table(trace):
    fig = viz.bytes_bars(trace)
    assert fig.layout.barmode == "stack"
    for d in fig.data:
        want = trace.bytes_per_rank(d.name)
        assert list(d.x) == [f"rank {r}" for r in range(WORLD)]
        assert list(d.y) == pytest.approx([want[r] for r in range(WORLD)])
    assert "recv" not in [d.name for d in fig.data]            # receiving puts nothing on the wire
    by_label = viz.bytes_bars(trace, by="label")
    assert sorted(d.name for d in by_label.data) == ["grad bucket", "grads", "ring", "weights"]
    with pytest.raises(ValueError, match="by="):
        viz.bytes_bars(trace, by="rank")


# ---------------------------------------------------------------------- style and scale
def test_style_colours_are_distinct_and_stable():
    comm_colours = [style.color("collective", op) for op in style.COLLECTIVE_COLORS] + \
                   [style.color("p2p", op) for op in style.P2P_COLORS]
    assert len(set(comm_colours)) == len(comm_colours)
    assert style.color("compute", "attention") == style.color("compute", "attention")
    assert style.color("compute", "attention") not in comm_colours
    assert style.human_bytes(1536) == "1.54 kB" and style.human_bytes(96) == "96 B"
    assert style.human_bytes(4_000_000) == "4.00 MB" and style.human_bytes(2e12) == "2.00 TB"


def test_thousands_of_events_make_few_traces():
    evs = [Event(rank=i % 8, kind="compute" if i % 3 else "collective", op="forward" if i % 3 else "all_reduce",
                 start=i * 1e-3, end=i * 1e-3 + 5e-4, group=tuple(range(8)), nbytes=1024) for i in range(3000)]
    fig = viz.timeline(evs)
    assert len(fig.data) == 2 and sum(len(d.base) for d in fig.data) == 3000


def test_viz_never_communicates():
    for path in pathlib.Path(viz.__file__).parent.glob("*.py"):
        src = path.read_text()
        assert "torch.distributed" not in src and "import torch" not in src, path
        assert "import comm" not in src and "from ..comm" not in src and "parlab.comm import" not in src, path


def test_summary_writes_si_bytes():
    """4,000,000 bytes is 4.00 MB (SI), not 3.81 (that would be MiB labelled MB)."""
    from parlab.trace import Trace
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=(0, 1), nbytes=4_000_000)
           for r in (0, 1)]
    text = Trace(evs).summary()
    assert "4.00 MB" in text and "3.81" not in text


def test_memory_bars_write_totals_in_plain_numbers_when_asked():
    from parlab.parallel.zero import memory
    from parlab.viz.memory import memory_bars
    cols = [dict(stage=memory.STAGES[s], source="Nd=64", **memory.model_state_bytes(175e9, 64, s)) for s in range(4)]
    fig = memory_bars(cols, unit=1e9, unit_name="GB", totals=True)
    assert list(fig.data[-1].text) == ["2,800 GB", "733 GB", "388 GB", "43.8 GB"]      # not "2.8e+03 GB"
    assert all(d.text is None for d in fig.data[:-1]) and memory_bars(cols).data[-1].text is None


def test_planner_step_axis_labels_read_in_full():
    """Plotly's minor log labels write 20 s as "2"; the planner figure labels 1-2-5 steps in full instead."""
    from parlab.viz.planner import _ticks_125
    assert _ticks_125([23.8, 230.0]) == [20.0, 50.0, 100.0, 200.0, 500.0]
    assert _ticks_125([0.03, 0.045]) == [0.03, 0.04, 0.05]                   # a narrow range: 1..9 steps


def _uneven_all_to_all():
    """Rank r sends r * j + 1 rows of 2 float32 to rank j, none to its next rank: an uneven exchange."""
    r, n = comm.get_rank(), comm.get_world_size()
    rows = lambda a, b: 0 if b == (a + 1) % n else a * b + 1          # noqa: E731
    send = [rows(r, j) for j in range(n)]
    recv = [rows(j, r) for j in range(n)]
    out = torch.empty(sum(recv), 2)                                   # (rows received, 2)
    comm.all_to_all(out, torch.ones(sum(send), 2), recv, send, label="dispatch")


def test_uneven_all_to_all_arrows_carry_the_recorded_bytes():
    """An all-to-all's arrows are what each rank recorded for each peer (Event.splits, e.g. tokens to their
    experts), not X/N; summed per sender they are its wire bytes, and empty messages are not drawn."""
    from parlab.viz.animation import algorithm_steps, comm_steps, step_edges, step_title
    tr = parlab.run(_uneven_all_to_all, 3, trace=True).trace
    (step,) = [s for s in comm_steps(tr) if s.label == "dispatch"]
    edges = step_edges(step)
    assert sorted(edges) == [(0, 2, 8.0), (1, 0, 8.0), (2, 1, 24.0)]    # 8 bytes a row; the empty ones left out
    for e in step.events:                                            # the arrows leaving a rank: its wire bytes
        assert sum(nb for a, _, nb in edges if a == e.rank) == e.wire_bytes
    moves = [m for _, ms in algorithm_steps(step) for m in ms]
    assert sorted((m.src, m.dst, m.nbytes) for m in moves) == sorted(edges)
    assert step_title(step).endswith("16 B to 64 B payload, 8 B to 24 B per arrow")   # payloads: 2, 3, 8 rows
    assert step_title(step, per_call=False).endswith("up to 24 B sent by one rank in all")


def test_animation_heading_gives_a_calls_total_per_rank_not_per_arrow():
    """Played step by step, each arrow carries a chunk (X/N): the heading must not call the total 'per arrow'."""
    from parlab.viz.animation import Step, step_title
    ar = Step("all_reduce", "collective", "", (0, 1, 2, 3), 16)
    a2a = Step("all_to_all", "collective", "", (0, 1, 2, 3), 16)
    assert step_title(ar).endswith("16 B payload, 24 B per arrow")                       # one frame per call
    assert step_title(ar, per_call=False).endswith("16 B payload, 24 B sent per rank in all")
    assert step_title(a2a, per_call=False).endswith("16 B payload, 12 B sent per rank in all")   # 3 arrows of 4 B
    # a chain broadcast's last rank only receives; a scatter's root alone sends; uneven arrows give their range
    chain = Step("broadcast", "collective", "", (0, 1, 2, 3), 16, root=0)
    assert step_title(chain, per_call=False).endswith("16 B sent by each of ranks 0, 1, 2 in all, rank 3 sends nothing")
    scatter = Step("scatter", "collective", "", (0, 1, 2, 3), 16, root=0)
    assert step_title(scatter, per_call=False).endswith("12 B sent by rank 0 in all, ranks 1, 2, 3 send nothing")


def test_explorer_controls_speak_the_course_language_and_keep_their_values():
    """Lesson 07's explorer: each control labelled in the language in force, the recomputation modes' words
    translated while the values the explorer receives stay the code's; 15 controls laid out in 4 rows."""
    import ipywidgets

    from parlab.i18n import use_language
    from parlab.viz.explorer import CONTROLS, explorer_controls, explorer_panel
    settings = dict(model=(["gpt-175b"], "gpt-175b"), gpu=(["a100-80gb", "h100-80gb"], "a100-80gb"),
                    gpus=([8, 64], 64), precision=(["bf16", "fp8"], "bf16"), tp=([4, 8], 8), pp=([8], 8),
                    cp=([1], 1), zero=([0, 1], 0), batch=([64], 64), micro=([1], 1), schedule=(["1f1b"], "1f1b"),
                    v=([1, 3], 3), recompute=(["none", "selective", "full"], "selective"), sp=True,
                    attention=(["fused", "materialised"], "fused"))
    with use_language("en"):
        en = explorer_controls(**settings)
    with use_language("zh_CN"):
        zh = explorer_controls(**settings)
    assert list(en) == list(CONTROLS)                                   # laid out in CONTROLS' order
    assert [en[k].description for k in ("precision", "recompute", "batch")] == ["number format", "recompute",
                                                                                "global batch"]
    assert [zh[k].description for k in ("precision", "recompute", "batch")] == ["数值格式", "重计算", "全局批量"]
    assert zh["recompute"].options == (("无", "none"), ("选择性", "selective"), ("完全", "full"))
    assert zh["recompute"].value == "selective" and zh["sp"].value is True and zh["sp"].description == "序列并行 SP"
    grid = explorer_panel(en, ipywidgets.Output()).children[0]
    assert zh["attention"].options == (("融合（FlashAttention）", "fused"), ("分数写入显存", "materialised"))
    assert zh["attention"].value == "fused" and zh["attention"].description == "注意力内核"
    assert grid.layout.grid_template_rows == "repeat(4, auto)" and len(grid.children) == 15
    with pytest.raises(ValueError, match="no explorer control"):
        explorer_controls(precison=(["bf16"], "bf16"))
    with pytest.raises(ValueError, match="not one of its options"):
        explorer_controls(precision=(["bf16", "fp8"], "fp16"))


def test_explorer_capacity_labels_sit_beside_the_memory_plot():
    """Past 80 GB the stacked bar reaches the GPU's line: its label and the usable part's are placed right of the
    memory plot (x domain > 1), the GPU's above its line and the usable part's below its own, never on a bar."""
    import dataclasses
    from parlab.cluster.costs import CLUSTERS, model_preset
    from parlab.cluster.planner import estimate
    from parlab.viz.explorer import layout_figure
    cluster = dataclasses.replace(CLUSTERS["a100-80gb"], nodes=8)
    est = estimate(model_preset("gpt3-175b"), cluster, 64, tp=8, pp=8, micro_batch=2, recompute="none",
                   attention="materialised")                            # the scores kept: 2022's kernels
    assert est.total_bytes / 1e9 > 80                                   # the bar runs past both lines
    fig = layout_figure(est, cluster)
    labels = {a.text: a for a in fig.layout.annotations if a.text in ("80 GB GPU", "usable")}
    assert set(labels) == {"80 GB GPU", "usable"}
    for a in labels.values():
        assert a.xref == "x domain" and a.x >= 1 and a.xanchor == "left", a
    assert labels["80 GB GPU"].yanchor == "bottom" and labels["usable"].yanchor == "top"
    assert labels["usable"].y < labels["80 GB GPU"].y == 80


def test_titles_at_the_top_start_below_plotlys_toolbar():
    """Issue 39: plotly's toolbar, shown on hover at the top right, covered long titles placed at the figure's very
    top (the animations' headings, the replay toggles'); such titles come from style.top_title, below its band."""
    from parlab.viz.replay import toggle
    t = style.top_title("a title", x=0.015)
    assert (t["y"], t["yref"], t["yanchor"], t["pad"]["t"], t["x"]) == (1.0, "container", "top", style.TOOLBAR_PX, 0.015)
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=(0, 1), nbytes=8)
           for r in (0, 1)]
    runs = [Event(rank=r, kind="compute", op="forward", start=0.0, end=1.0) for r in (0, 1)]
    for fig in (viz.comm_animation(evs, title="all-reduce"), toggle(runs, runs, title="t", labels=("a", "b"))):
        title = fig.layout.title
        assert title.yref == "container" and title.y == 1.0 and title.yanchor == "top"
        assert title.pad.t >= style.TOOLBAR_PX + (12 if "<br>" in title.text else 0)   # plotly lifts several lines
    assert style.top_title("one<br>two")["pad"]["t"] == style.top_title("one", several_lines=True)["pad"]["t"] > t["pad"]["t"]
