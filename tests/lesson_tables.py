"""What a student reads in the printed tables of lessons 02 and 07, checked in the lessons as executed top to bottom
(tests/test_viz_browser.py in English, tests/test_i18n_browser.py in Chinese, the suite's one run of each): the
columns line up by display width (a Chinese character takes two columns) in both languages, and in Chinese no
English word is left but the names the glossary keeps. The cells that look rows up by the names these tables print
(eaf19c4d, 45c495c5) ran without error, or the lesson test fails.
"""
import re

import nbformat

from parlab.i18n.columns import width

#: English a Chinese table may keep: the glossary's rank, and names (GPipe, GPT)
KEPT = {"rank", "GPipe", "GPT"}


def english(text: str) -> list[str]:
    """The words of 3+ Latin letters in `text` that `KEPT` does not allow (tests/test_i18n_tables.py uses it too)."""
    return [w for w in re.findall(r"[A-Za-z]{3,}", text) if w not in KEPT]


def _cell(nb, cell_id: str):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def stdout(nb, cell_id: str) -> list[str]:
    """The lines the executed cell `cell_id` printed."""
    return "".join(o.get("text", "") for o in _cell(nb, cell_id).get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout").splitlines()


def check_lesson_02(nb: nbformat.NotebookNode, lang: str) -> None:
    """Cells l02-04 (the other ranks' losses), l02-08 (bytes per phase: header and rows in the same display
    columns), l02-12 (the two buckets' '=' one under the other), l02-17 (memory categories as the figure's legend
    names them) and 87c9e763 (the three views): no English word left in Chinese but rank, GPT, DDP, gloo,
    all-reduce, None and units."""
    table = stdout(nb, "l02-08")[:7]
    edges = {width(line.rstrip()) for line in table[1:]}
    header_cells = [m.end() for m in re.finditer(r"rank \d", table[0])]
    assert len(edges) == 1 and width(table[0][:header_cells[-1]]) == edges.pop(), "\n".join(table)
    buckets = stdout(nb, "l02-12")[:2]
    assert len({width(line[:line.index("=")]) for line in buckets}) == 1, "\n".join(buckets)
    mem = stdout(nb, "l02-17")[2:]
    assert len(mem) == 8 and len({width(line[:line.index(" rank 0")]) for line in mem}) == 1, "\n".join(mem)
    views = stdout(nb, "87c9e763")
    assert len(views) == 3 and len({width(line[:line.index(" ms")]) for line in views}) == 1, "\n".join(views)
    if lang == "zh_CN":
        losses = stdout(nb, "l02-04")[:1]
        text = "\n".join(losses + table + [line.split("=")[0] for line in buckets] + mem + views)
        assert [w for w in english(re.sub(r"all-reduce|None", "", text)) if w not in {"DDP", "gloo", "MiB"}] == [], text
        assert "其他 rank" in losses[0] and "优化器状态" in "\n".join(mem), (losses, mem)


def check_lesson_07(nb: nbformat.NotebookNode, lang: str) -> None:
    """Cells 2fb49810 (bytes per dimension, traced and by formula, and each dimension's link) and 7ae61743 (the
    replayed placements): columns end in one display column in both languages; in Chinese no English word is
    left (the links were "inter-node"/"intra-node", the placements "TP inside a node ..."), and cell 850eafca's
    bars ("Try it": GB per GPU along each dimension) say in Chinese which link each uses."""
    traffic, places = stdout(nb, "2fb49810")[:4], stdout(nb, "7ae61743")
    link_column = {width(line) - width(re.split(r"\s{2,}", line)[-1]) for line in traffic}   # where the link starts
    numbers_end = {width(line[:m.end()]) for line in traffic[1:] for m in [list(re.finditer(r"\d ", line))[-1]]}
    assert len(link_column) == 1 and len(numbers_end) == 1, "\n".join(traffic)
    assert width(traffic[0][:traffic[0].rindex(re.split(r"\s{2,}", traffic[0])[-1])].rstrip()) == min(numbers_end) - 1
    assert len(places) == 5 and len({width(line.rstrip()) for line in places}) == 1, "\n".join(places)
    assert len({width(line[:line.index(" ms")]) for line in places[1:]}) == 1, "\n".join(places)
    if lang == "zh_CN":
        assert english("\n".join(traffic + places)) == [], "\n".join(traffic + places)
        assert {line.split()[-1] for line in traffic[1:]} <= {"跨节点", "节点内"}, traffic
        bars = next(o for o in _cell(nb, "850eafca").outputs if "application/vnd.plotly.v1+json" in o.get("data", {}))
        text = bars["data"]["application/vnd.plotly.v1+json"]["data"][0]["text"]
        assert list(text) == ["节点内", "节点内", "跨节点", "规模 1"], text
    else:
        assert {line.split()[-1] for line in traffic[1:]} == {"node", "nodes"}, traffic
