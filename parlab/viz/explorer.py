"""One layout, explained: the memory of its fullest GPU and where its step time goes, beside a published run.

`layout_figure(estimate, cluster)` draws one `parlab.cluster.planner.Estimate` (the planner's reading of one layout)
as two stacked bars: memory per GPU (parameters, gradients, optimizer state, activations, ZeRO-3 buffers) against
the GPU's capacity and its usable part, and the step time split into compute, pipeline bubble and the exposed
communication of each dimension (`parlab.viz.planner.TERMS`). Given `published_s`, a second bar shows the
published step time of the same layout. Lesson 07's layout explorer redraws it for every control a student moves.

`explorer_controls(**settings)` makes the explorer's controls (ipywidgets dropdowns and a checkbox, labelled in the
language in force) and `explorer_panel(controls, output)` lays them out in a grid of a few rows above the figures
they redraw, so that a control and its figure fit one screen (a column of 14 controls pushed the figures 500 px
down).

`published_figure(rows)` compares the model with published runs: one group of bars per run (published, the model,
and another estimate when given), the model's error written above. `rows` are (label, published seconds, Estimate)
or (label, published seconds, Estimate, other seconds), e.g. Calculon's figure for the run.

Plotly graph_objects and ipywidgets only; pure (never communicates, never estimates: it draws what it is given).
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from parlab.i18n import _
from parlab.viz.planner import terms

__all__ = ["layout_figure", "published_figure", "MEMORY_PARTS", "memory_parts", "CONTROLS", "control_names",
           "explorer_controls", "explorer_panel"]

GB = 1e9
#: memory parts of an Estimate, bottom to top, with their colours
#: (ColorBrewer Dark2, apart from the step-time colours of `TERMS` drawn beside them)
MEMORY_PARTS = (("params_bytes", "parameters", "#1b9e77"), ("grads_bytes", "gradients", "#d95f02"),
                ("optimizer_bytes", "optimizer state", "#7570b3"), ("activation_bytes", "activations", "#e7298a"),
                ("buffer_bytes", "ZeRO-3 buffers", "#66a61e"))


def memory_parts() -> tuple[tuple[str, str, str], ...]:
    """`MEMORY_PARTS` with its names in the language in force (what the legend shows)."""
    names = {"parameters": _("parameters"), "gradients": _("gradients"), "optimizer state": _("optimizer state"),
             "activations": _("activations"), "ZeRO-3 buffers": _("ZeRO-3 buffers")}
    return tuple((attr, names[name], colour) for attr, name, colour in MEMORY_PARTS)


def layout_figure(est, cluster, title: str | None = None, published_s: float | None = None,
                  height: int = 430) -> go.Figure:
    """Memory per GPU and step time of one layout (an `Estimate` of `cluster`); `published_s`: a measured step."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.42, 0.58], horizontal_spacing=0.16,
                        subplot_titles=(_("memory of the fullest GPU (GB)"), _("time of one step (s)")))
    planner = _("planner")                                  # the x category of the estimate's bar, and its label's
    for attr, name, colour in memory_parts():
        value = getattr(est, attr) / GB
        if value > 0:
            fig.add_trace(go.Bar(x=[_("this layout")], y=[value], name=name, marker_color=colour, legendgroup="mem",
                                 legendgrouptitle_text=_("memory"),
                                 hovertemplate=f"{name}: %{{y:.1f}} GB<extra></extra>"), row=1, col=1)
    # the capacity lines' labels sit right of the plot, the GPU's above its line and the usable part's below its
    # own: inside, a bar past 80 GB covered them, and on a tall axis the two lines are a few pixels apart
    for gb, text, dash, colour, side in ((cluster.gpu_mem_gb, _("{gb:g} GB GPU").format(gb=cluster.gpu_mem_gb),
                                          "solid", "#333", "bottom"),
                                         (cluster.mem_bytes / GB, _("usable"), "dash", "#888", "top")):
        fig.add_hline(y=gb, line_dash=dash, line_color=colour, row=1, col=1)
        fig.add_annotation(x=1, xref="x domain", xanchor="left", xshift=3, y=gb, yref="y", yanchor=side,
                           text=text, showarrow=False, font=dict(size=11, color=colour))
    for attr, name, colour in terms():
        value = getattr(est, attr)
        if value > 0:
            fig.add_trace(go.Bar(x=[planner], y=[value], name=name, marker_color=colour, legendgroup="time",
                                 legendgrouptitle_text=_("step time"),
                                 hovertemplate=f"{name}: %{{y:.2f}} s<extra></extra>"), row=1, col=2)
    if published_s is not None:
        fig.add_trace(go.Bar(x=[_("published")], y=[published_s], name=_("published step"), marker_color="#222",
                             legendgroup="time", text=[f"{published_s:g} s"], textposition="outside",
                             hovertemplate=_("published: %{y:.2f} s<extra></extra>")), row=1, col=2)
    fig.add_annotation(x=planner, y=est.step_s, text=f"{est.step_s:.2f} s", showarrow=False, yshift=12,
                       row=1, col=2)
    heading = (_("{layout}: {gb:.1f} GB per GPU (fits), {step:.2f} s per step, {tflops:.0f} TFLOP/s per GPU (MFU)")
               if est.fits else _("{layout}: {gb:.1f} GB per GPU (does not fit), {step:.2f} s per step, "
                                  "{tflops:.0f} TFLOP/s per GPU (MFU)"))
    fig.update_layout(barmode="stack", height=height, margin=dict(t=90, b=40, l=60, r=20),
                      title=title or heading.format(layout=est.layout, gb=est.total_bytes / GB, step=est.step_s,
                                                    tflops=est.achieved_tflops),
                      title_font_size=14, legend=dict(groupclick="toggleitem"))
    top = max(cluster.gpu_mem_gb, est.total_bytes / GB) * 1.15
    fig.update_yaxes(range=[0, top], row=1, col=1)
    return fig


def published_figure(rows, title: str | None = None, other: str = "Calculon") -> go.Figure:
    """Grouped bars, one group per published run: (label, published seconds, Estimate[, other seconds]) each;
    `other` names the fourth column's estimate; `title` defaults to "The model against published step times"."""
    title = _("The model against published step times") if title is None else title
    labels = [r[0] for r in rows]
    pub = [r[1] for r in rows]
    est = [r[2].step_s for r in rows]
    err = [f"{100 * (e / p - 1):+.1f}%" for p, e in zip(pub, est)]
    bars = [go.Bar(x=labels, y=pub, name=_("published"), marker_color="#222"),
            go.Bar(x=labels, y=est, name=_("parlab's model"), marker_color="#4c78a8", text=err, textposition="outside",
                   textfont_size=11, cliponaxis=False)]
    if all(len(r) > 3 for r in rows):
        bars.append(go.Bar(x=labels, y=[r[3] for r in rows], name=other, marker_color="#b0b0b0"))
    fig = go.Figure(bars)
    fig.update_layout(barmode="group", title=title, title_font_size=14, height=430, yaxis_title=_("seconds per step"),
                      uniformtext=dict(minsize=10, mode="show"),
                      margin=dict(t=60, b=110, l=60, r=20), xaxis_tickangle=-25)
    fig.update_yaxes(type="log", tickvals=[1, 2, 5, 10, 20, 50, 100, 200])       # 1 s (22B) to 94 s (1T)
    return fig


#: the explorer's controls in the order they are laid out, column by column: name -> its label in English
CONTROLS = {"model": "model", "gpu": "GPU", "gpus": "GPUs", "precision": "number format",
            "tp": "tp", "pp": "pp", "cp": "cp", "zero": "ZeRO",
            "batch": "global batch", "micro": "micro-batch", "schedule": "schedule", "v": "chunks v",
            "recompute": "recompute", "sp": "SP", "attention": "attention"}


def control_names() -> dict[str, str]:
    """`CONTROLS` with the labels in the language in force (tp, pp, cp and ZeRO are names, as in the code)."""
    return {"model": _("model"), "gpu": _("GPU"), "gpus": _("GPUs"), "precision": _("number format"),
            "tp": "tp", "pp": "pp", "cp": "cp", "zero": "ZeRO", "batch": _("global batch"),
            "micro": _("micro-batch"), "schedule": _("schedule"), "v": _("chunks v"), "recompute": _("recompute"),
            "sp": _("SP"), "attention": _("attention")}


def _option_names() -> dict[str, str]:
    """The words among the options a student reads (recomputation modes, attention kernels); other options are names
    (gpt-175b)."""
    return {"none": _("none"), "selective": _("selective"), "full": _("full"), "fused": _("fused"),
            "materialised": _("materialised")}


def explorer_controls(**settings) -> dict:
    """{name: widget} for the explorer's controls, in `CONTROLS` order: ``name=(options, value)`` makes a dropdown,
    ``name=True`` (or False) a checkbox; labels and option words in the language in force, the values unchanged
    (what `ipywidgets.interactive_output` passes to the explorer's function)."""
    import ipywidgets as widgets

    unknown = [k for k in settings if k not in CONTROLS]
    if unknown:
        raise ValueError(f"no explorer control {unknown}: the controls are {list(CONTROLS)}")
    names, words, out = control_names(), _option_names(), {}
    style, layout = {"description_width": "initial"}, widgets.Layout(width="auto")
    for key in (k for k in CONTROLS if k in settings):
        setting = settings[key]
        if isinstance(setting, bool):
            out[key] = widgets.Checkbox(value=setting, description=names[key], indent=False, style=style,
                                        layout=layout)
            continue
        options, value = setting
        if value not in options:
            raise ValueError(f"{key}={value!r} is not one of its options {list(options)}")
        out[key] = widgets.Dropdown(options=[(str(words.get(o, o)), o) for o in options], value=value,
                                    description=names[key], style=style, layout=layout)
    return out


def explorer_panel(controls: dict, output, rows: int = 4):
    """The controls in a grid filled column by column, `rows` to a column, above `output` (the figures they
    redraw): 15 controls take 4 rows instead of 15."""
    import ipywidgets as widgets

    columns = -(-len(controls) // rows)
    grid = widgets.GridBox(list(controls.values()), layout=widgets.Layout(
        grid_template_columns=f"repeat({columns}, minmax(0, 1fr))", grid_template_rows=f"repeat({rows}, auto)",
        grid_auto_flow="column", grid_gap="2px 18px", width="100%"))
    panel = widgets.VBox([grid, output])
    panel.add_class("parlab-explorer")
    return panel
