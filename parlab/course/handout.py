"""Offline HTML handouts of executed lessons (``parlab course html``): math typeset and widgets shown, no network.

nbconvert's HTML page loads MathJax from a CDN and draws ipywidgets with a widget manager from a CDN, so
without a network a handout shows raw LaTeX and empty "Try it" cells. Two changes make a page read fully
offline:

* `offline_mathjax(out)` copies MathJax 2.7 from the ``jupyter-server-mathjax`` package (the copy the
  Jupyter server itself serves) into ``out/mathjax/`` and returns the relative URL for nbconvert's
  ``mathjax_url``, so the pages in ``out/`` typeset their formulas from their own folder;
* `static_widgets(nb)` replaces every widget view in an executed notebook by what it showed when the
  cell ran: a line naming each control and its initial value (its range or choices), then the outputs the
  widget's output area held (the figure drawn for the default setting). The saved widget state is then
  dropped, so nbconvert does not try to load a widget manager;
* `drop_remote_scripts(page)` removes the ``<script src="https://...">`` tags that are left (require.js in
  nbconvert's page, a MathJax 3 that plotly's notebook output asks for), so a page behaves the same with
  and without a network and never mixes two MathJax versions.

Plotly figures already carry plotly.js inside the page (the lessons use the ``notebook`` renderer).
"""
from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import nbformat

__all__ = ["offline_mathjax", "static_widgets", "drop_remote_scripts", "MATHJAX_CONFIG"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"      # a combined configuration jupyter-server-mathjax ships


def offline_mathjax(out: str | Path) -> str:
    """Copy MathJax into ``out/mathjax`` (once) and return the URL the pages in `out` load it from."""
    import jupyter_server_mathjax

    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (src / "MathJax.js").exists():
        raise FileNotFoundError(f"no MathJax.js in {src}: reinstall jupyter-server-mathjax")
    dst = Path(out) / "mathjax"
    if not (dst / "MathJax.js").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    return f"mathjax/MathJax.js?config={MATHJAX_CONFIG}"


def _describe(m: dict) -> str | None:
    """'microbatches = 8 (1 to 32)' for a control's saved state; None for containers and outputs."""
    name, st = m["model_name"], m["state"]
    if name in ("OutputModel", "VBoxModel", "HBoxModel", "GridBoxModel", "BoxModel", "LayoutModel") \
            or name.endswith("StyleModel"):
        return None
    label = st.get("description") or name.removesuffix("Model")
    if "_options_labels" in st:
        index = st.get("index")
        chosen = st["_options_labels"][index] if isinstance(index, int) else "-"
        choices = st["_options_labels"]
        shown = ", ".join(choices) if len(choices) <= 8 else f"{choices[0]} ... {choices[-1]}"
        return f"{label} = {chosen} (choices: {shown})"
    if "value" in st:
        rng = f" ({st['min']:g} to {st['max']:g})" if isinstance(st.get("min"), (int, float)) and \
            isinstance(st.get("max"), (int, float)) else ""
        if name == "FloatLogSliderModel":
            base = st.get("base", 10)
            rng = f" ({base ** st['min']:g} to {base ** st['max']:g})"
        return f"{label} = {st['value']}{rng}"
    return None


def _tree(state: dict, model_id: str, seen: set) -> list[str]:
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    out = [model_id]
    for v in state[model_id]["state"].get("children", []) or []:
        if isinstance(v, str) and v.startswith("IPY_MODEL_"):
            out += _tree(state, v[len("IPY_MODEL_"):], seen)
    return out


def static_widgets(nb: nbformat.NotebookNode) -> int:
    """Replace each widget view output of the executed `nb` by its controls' initial values and its output
    area's contents, in place; drop the widget state. Returns how many widget views were replaced."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    replaced = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            replaced += 1
            models = [state[i] for i in _tree(state, view["model_id"], set())]
            controls = [d for d in map(_describe, models) if d]
            if controls:
                text = ("Try it (interactive in JupyterLab; shown at its initial setting): "
                        + "; ".join(controls))
                outputs.append(nbformat.v4.new_output(
                    "display_data", data={"text/html": f'<p class="parlab-try-it"><i>{html.escape(text)}</i></p>',
                                          "text/plain": text}))
            for m in models:
                if m["model_name"] == "OutputModel":
                    outputs += [nbformat.from_dict(o) for o in m["state"].get("outputs", [])]
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return replaced


def drop_remote_scripts(page: str) -> str:
    """The page without ``<script src="http...">...</script>`` tags (everything it needs is inside it)."""
    return re.sub(r"""<script\b[^>]*\bsrc=["']https?://[^"']*["'][^>]*>\s*</script>""", "", page)
