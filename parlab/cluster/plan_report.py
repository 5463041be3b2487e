"""The planner's answers as text: the ranked table, the volume table and why the best layout is best.

`format_table(estimates)` prints `parlab.cluster.planner.Estimate`s as a fixed-width table (memory split, time split,
step time, model TFLOP/s per GPU); `format_volume_table(rows)` the bytes per GPU and step along each dimension
(`planner.volume_table`); `explain(ranked, every)` says, for tp, pp, dp, the ZeRO stage, recomputation and the
micro-batch, what the best layout with another value would cost and which term makes the difference. Pure text
formatting of estimates: it computes nothing (``parlab plan`` prints all three).
"""
from __future__ import annotations

from parlab.i18n import _
from parlab.i18n.columns import pad, width

__all__ = ["explain", "format_table", "format_volume_table", "DIMS", "GB", "RC_MARK"]

GB = 1e9
DIMS = ("tp", "cp", "dp", "pp")
RC_MARK = {"none": "n", "selective": "s", "full": "y"}      # the table's rc column


def _dominant(a, b) -> str:
    """The cost term that differs most between two estimates, as words."""
    terms = {"bubble_s": _("pipeline bubble"), "tp_s": _("TP communication"), "dp_s": _("exposed DP communication"),
             "pp_s": _("PP communication"), "cp_s": _("CP communication"),
             "compute_s": _("compute (recomputation)")}
    k = max(terms, key=lambda k: abs(getattr(b, k) - getattr(a, k)))
    return _("{term} {theirs:.2f} s vs {ours:.2f} s").format(term=terms[k], theirs=getattr(b, k), ours=getattr(a, k))


def _link(size: int, crosses: bool) -> str:
    """Where a dimension's groups run, as words."""
    return _("no group") if size == 1 else _("crosses nodes") if crosses else _("inside a node")


def _value(dim: str, attr: str, value) -> str:
    """A layout's choice along one axis, as words: "tp=8", "ZeRO-1" or "no ZeRO", "full recomputation" or "no
    recomputation" (not a Python boolean)."""
    if attr == "zero":
        return _("ZeRO-{stage}").format(stage=value) if value else _("no ZeRO")
    if attr == "recompute":
        return _("full recomputation") if value else _("no recomputation")
    return f"{dim}={value}"


def explain(ranked: list, every: list | None = None, gpus_per_node: int | None = None) -> str:
    """Why the first layout of `ranked` has its tp, pp, dp (and the rest): the best alternative for each."""
    top = ranked[0]
    every = every or ranked
    lines = [_("Best: {layout}: {step:.2f} s/step, {gb:.1f} GB per GPU, {tflops:.0f} TFLOP/s per GPU.").format(
        layout=top.layout, step=top.step_s, gb=top.total_bytes / GB, tflops=top.achieved_tflops)]
    where = {d: _link(getattr(top, d), top.crosses[d]) for d in DIMS}
    lines.append("  " + _("tp={tp} ({tp_link}), pp={pp} ({pp_link}), dp={dp} ({dp_link}); per GPU and step TP sends "
                          "{tp_gb:.1f} GB, DP {dp_gb:.1f} GB, PP {pp_gb:.2f} GB.").format(
        tp=top.tp, pp=top.pp, dp=top.dp, tp_link=where["tp"], pp_link=where["pp"], dp_link=where["dp"],
        tp_gb=top.volume["tp"] / GB, dp_gb=top.volume["dp"] / GB, pp_gb=top.volume["pp"] / GB))
    for dim, attr in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), (_("ZeRO stage"), "zero"),
                      (_("recomputation"), "recompute"), (_("micro-batch"), "micro_batch")):
        others = [e for e in every if getattr(e, attr) != getattr(top, attr)]
        fitting = [e for e in others if e.fits]
        ours = _value(dim, attr, getattr(top, attr))
        if fitting:
            alt = min(fitting, key=lambda e: (e.step_s, e.total_bytes))
            fields = dict(ours=ours, theirs=_value(dim, attr, getattr(alt, attr)), layout=alt.layout, step=alt.step_s,
                          gb=alt.total_bytes / GB)
            if alt.step_s - top.step_s < 0.005 * top.step_s:
                lines.append("  " + _("{ours} or {theirs}: a tie within 0.5% ({layout}: {step:.2f} s, {gb:.1f} GB): "
                                      "closer than this model can tell apart; either is a sound choice.").format(
                    **fields))
                continue
            lines.append("  " + _("{ours} rather than {theirs}: the best such layout ({layout}) takes {step:.2f} s "
                                  "(+{more:.0f}%), mostly {term}.").format(
                **fields, more=100 * (alt.step_s / top.step_s - 1), term=_dominant(top, alt)))
        elif others:
            alt = min(others, key=lambda e: e.total_bytes)
            lines.append("  " + _("{ours}: no layout with another {dim} fits (smallest {layout} {reason}).").format(
                dim=dim, ours=ours, layout=alt.layout, reason=alt.reason))
    return "\n".join(lines)


def format_table(estimates: list, top: int | None = 10) -> str:
    """A fixed-width text table: layout, memory split, time split, step time, throughput (columns padded by
    display width, so that they line up in Chinese too)."""
    words = {k: pad(v, n, ">") for k, v, n in (("states", _("states"), 8), ("act", _("act"), 6),
                                               ("total", _("total GB"), 8), ("compute", _("compute"), 7),
                                               ("bubble", _("bubble"), 6), ("step", _("step s"), 7))}
    note = _("note")
    shown = estimates[:top] if top else estimates
    moe = any(getattr(e, "ep", 1) > 1 for e in shown)        # the ep column and EP's time, when a layout has ep > 1
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'v':>1} {'dp':>4} {'cp':>2}{'  ep' if moe else ''} {'b':>2} {'m':>4} "
            f"{'Z':>1} {'rc':>2} | {words['states']} {words['act']} {words['total']} | {words['compute']} "
            f"{words['bubble']} {'TP':>6} {'DP':>6} {'PP':>6} {'CP':>6}{'     EP' if moe else ''} {words['step']} "
            f"{'TF/GPU':>6} {note}")
    rows = [head, "-" * width(head)]
    no = _("NO: {reason}")
    for i, e in enumerate(shown, 1):
        states = e.params_bytes + e.grads_bytes + e.optimizer_bytes
        x = {d: "*" if e.crosses[d] and e.volume[d] else " " for d in DIMS}
        ep, ep_s = (f" {e.ep:>3}", f" {e.ep_s:>6.2f}") if moe else ("", "")
        rows.append(f"{i:>3} {e.tp:>3} {e.pp:>3} {e.virtual:>1} {e.dp:>4} {e.cp:>2}{ep} {e.micro_batch:>2} "
                    f"{e.micro_batches:>4} {e.zero:>1} {RC_MARK[e.recomputation]:>2} | {states / GB:>8.1f} "
                    f"{e.activation_bytes / GB:>6.1f} {e.total_bytes / GB:>8.1f} | {e.compute_s:>7.2f} "
                    f"{e.bubble_s:>6.2f} {e.tp_s:>5.2f}{x['tp']} {e.dp_s:>5.2f}{x['dp']} {e.pp_s:>5.2f}{x['pp']} "
                    f"{e.cp_s:>5.2f}{x['cp']}{ep_s} {e.step_s:>7.2f} {e.achieved_tflops:>6.0f} "
                    f"{'' if e.fits else no.format(reason=e.reason)}")
    rows.append(_("(times in s per step; * = that dimension's groups cross nodes; DP = exposed part; rc: y = full "
                  "recomputation, s = selective, n = none; in a layout's name, rc = full recomputation, sel = "
                  "selective)"))
    if moe:
        rows.append(_("(ep = expert-parallel size, the experts split over ep ranks; EP = the all-to-alls of the "
                      "mixture-of-experts layers, in s per step)"))
    return "\n".join(rows)


def format_volume_table(rows: list[dict]) -> str:
    """`planner.volume_table`'s rows as a text table: dimension, size, GB per GPU and step, link, what is sent."""
    dim, size, gb, link, what = _("dim"), _("size"), _("GB/GPU/step"), _("link"), _("what")
    out = [f"{pad(dim, 4)} {pad(size, 4, '>')} {pad(gb, 12, '>')} {pad(link, 10)} {what}"]
    for r in rows:
        where = "-" if r["size"] == 1 else _("inter-node") if r["crosses_nodes"] else _("intra-node")
        out.append(f"{r['dim']:<4} {r['size']:>4} {r['bytes'] / GB:>12.3f} {pad(where, 10)} {r['what']}")
    return "\n".join(out)
