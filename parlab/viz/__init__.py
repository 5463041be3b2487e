"""parlab.viz: plotly figures of what the ranks did. Fed by a `Trace`; never communicates.

Examples::

    import parlab
    from parlab import viz

    res = parlab.run(train_step, 4, trace=True)    # any fn using parlab.comm / parlab.trace.region
    viz.timeline(res.trace)                        # one lane per rank: compute, collectives, p2p over time
    viz.timeline(res, ranks=[0, 1], time_unit="us", show_labels=True)
    viz.comm_animation(res.trace)                  # who sends what to whom, step by step of each algorithm (play)
    viz.bytes_bars(res.trace)                      # wire bytes sent per rank, stacked by op
    viz.bytes_bars(res.trace, by="label")          # ... or by label prefix ("grad bucket 3" -> "grad bucket")
    viz.grid_figure(parlab.parallel.topology.ParallelGrid(16, tp=2, pp=4, gpus_per_node=8), highlight="pp")

    # plain records work too, e.g. a simulated 1F1B schedule in abstract time steps:
    sched = [dict(rank=0, op="forward", start=0, end=1, label="mb 0"),
             dict(rank=1, op="forward", start=1, end=2, label="mb 0"),
             dict(rank=0, op="send", start=1, end=1.2, nbytes=4096, peer=1, group=[0, 1])]
    viz.timeline(sched, time_unit="steps", show_labels=True)

    # figures are ordinary plotly figures: they show in JupyterLab and export to one static HTML file
    import plotly.io as pio
    html = pio.to_html(viz.comm_animation(res.trace), include_plotlyjs=True)   # self-contained file
    # (plotly's HTML export plays an animation once on load; pass auto_play=False to open it at step 1)

`viz.comm_steps` is the animation's data: a trace's sends and collective calls as steps, each with the messages
of its algorithm (pure; `comm_animation` draws them).

Figures for one technique live in their own module, used by its lesson:
`viz.data_parallel`, `viz.memory` (ZeRO/FSDP), `viz.tensor_parallel`, `viz.pipeline` (schedule timelines),
`viz.context_parallel` (ring and Ulysses), `viz.expert` (tokens per expert, the all-to-all matrix), `viz.planner` (layout search), `viz.explorer` (one layout's memory
and step time beside a published run: lesson 07's layout explorer); `grid_figure` draws a rank grid.

`python -m parlab.course.figcheck` draws every lesson figure in headless Chromium and checks it from the page
(overlapping or cut-off text, stretched axes, duplicate legend entries, text under 10 px), with a screenshot each.

Colours are shared by every lesson (`parlab.viz.style`): blues for compute regions
(forward / backward / optimizer), one colour per collective, mustard for send/recv.
"""
from parlab.viz import style
from parlab.viz.animation import Move, Step, algorithm_steps, comm_animation, comm_steps, step_edges
from parlab.viz.grid import grid_figure
from parlab.viz.timeline import as_trace, bytes_bars, from_records, timeline

__all__ = ["timeline", "comm_animation", "bytes_bars", "from_records", "as_trace", "comm_steps", "step_edges",
           "Step", "Move", "algorithm_steps", "style", "grid_figure"]
