// parlab.course.figcheck: what a student would see wrong in a drawn plotly figure, measured from the page.
// window.parlabCheck(gd) -> list of problem strings for the figure drawn in the div `gd`.
// window.parlabCheckLabels(list) -> the ipywidgets descriptions that do not fit their label box.
(function () {
  const MIN_PX = 10;            // no text smaller than this
  const SLACK = 1;              // px of rounding allowed at the figure's edges and between boxes
  const COLOUR_DIST = 40;       // legend swatches closer than this (RGB distance, 0..441) look the same colour

  function box(el) {
    const r = el.getBoundingClientRect();
    return { l: r.left, r: r.right, t: r.top, b: r.bottom, w: r.width, h: r.height };
  }
  function overlap(a, b) {
    const w = Math.min(a.r, b.r) - Math.max(a.l, b.l), h = Math.min(a.b, b.b) - Math.max(a.t, b.t);
    return w > SLACK && h > SLACK;
  }
  function words(el) { return (el.textContent || "").replace(/\s+/g, " ").trim(); }
  function short(s) { return s.length > 50 ? s.slice(0, 47) + "..." : s; }

  // the text boxes a reader must be able to read, each a unit that must not overlap another unit
  function textBoxes(gd) {
    const out = [];
    const add = (el, kind) => {
      const b = box(el), text = words(el);
      if (b.w > 0 && b.h > 0 && text) out.push({ kind, text, b, el });
    };
    gd.querySelectorAll(".infolayer .g-gtitle text.gtitle").forEach(e => add(e, "title"));
    gd.querySelectorAll(".infolayer g[class^='g-x'] text, .infolayer g[class^='g-y'] text").forEach(
      e => add(e, "axis title"));
    gd.querySelectorAll(".annotation").forEach(e => {
      const t = e.querySelector("text");
      if (t) add(t, "annotation");
    });
    gd.querySelectorAll(".legend").forEach(e => add(e, "legend"));
    gd.querySelectorAll(".slider-container").forEach(e => add(e, "slider"));
    gd.querySelectorAll(".updatemenu-container").forEach(e => add(e, "buttons"));
    gd.querySelectorAll(".xtick text, .ytick text, [class*='xtick'] > text, [class*='ytick'] > text").forEach(
      e => add(e, "tick label"));
    return out;
  }

  function fontProblems(gd) {
    const small = new Map();
    gd.querySelectorAll("svg text, svg tspan").forEach(el => {
      if (el.closest(".hoverlayer") || el.closest(".modebar")) return;
      const own = Array.from(el.childNodes).filter(n => n.nodeType === 3).map(n => n.textContent).join("").trim();
      if (!own) return;
      const ctm = el.getScreenCTM && (el.ownerSVGElement ? el.getScreenCTM() : null);
      const scale = ctm ? Math.hypot(ctm.a, ctm.b) : 1;     // plotly shrinks bar labels with transform: scale()
      const px = parseFloat(getComputedStyle(el).fontSize) * scale;
      const b = el.getBoundingClientRect();
      if (b.width === 0 && b.height === 0) return;           // not displayed
      if (px < MIN_PX - 0.05) small.set(short(own), px);
    });
    if (!small.size) return [];
    const eg = Array.from(small).slice(0, 3).map(([t, px]) => `"${t}" ${px.toFixed(1)} px`).join(", ");
    return [`${small.size} texts smaller than ${MIN_PX} px, e.g. ${eg}`];
  }

  function axisExtent(gd, id) {   // [lo, hi] of the data on axis `id` ("x", "y2", ...), in the axis' units
    const fl = gd._fullLayout, ax = fl[id[0] + "axis" + id.slice(1)];
    const stacked = ["stack", "relative"].includes(fl.barmode);
    const vals = [], sums = new Map();
    const push = v => {
      if (v === null || v === undefined || v === "") return;
      let n = typeof v === "number" ? v : Number(v);
      if (!isFinite(n)) return;
      if (ax.type === "log") { if (n <= 0) return; n = Math.log10(n); }
      vals.push(n);
    };
    const letter = id[0], other = letter === "x" ? "y" : "x";
    for (const tr of gd._fullData) {
      if (tr.visible !== true || tr[letter + "axis"] !== id) continue;
      const arr = tr[letter];
      if (!arr) continue;
      const horizontal = tr.type === "bar" && tr.orientation === "h";
      const barAxis = tr.type === "bar" && ((letter === "x") === horizontal);
      for (let i = 0; i < arr.length; i++) {
        if (!barAxis) { push(arr[i]); continue; }
        const base = Array.isArray(tr.base) ? Number(tr.base[i] || 0) : Number(tr.base || 0);
        const v = Number(arr[i]);
        if (stacked && !tr.base) {             // stacked bars: each position's running sum is the extent
          const key = tr[other + "axis"] + "|" + (tr[other] ? tr[other][i] : i) + "|" + (v >= 0);
          const s = (sums.get(key) || 0) + v;
          sums.set(key, s);
          push(0); push(s);
        } else { push(base); push(base + v); }
      }
    }
    for (const s of (fl.shapes || [])) {
      if (s[letter + "ref"] === id) { push(s[letter + "0"]); push(s[letter + "1"]); }
    }
    // annotations are labels, not data: an axis stretched to reach one (e.g. a label given a data value on a
    // log axis, where plotly reads it as log10) is exactly what this check is for
    if (!vals.length) return null;
    return [Math.min(...vals), Math.max(...vals)];
  }

  function rangeProblems(gd) {
    const fl = gd._fullLayout, out = [], extents = new Map(), axes = [];
    for (const key of Object.keys(fl)) {      // shared axes (matches) draw the union of their data
      const m = key.match(/^([xy])axis(\d*)$/);
      if (!m || !fl[key]) continue;
      const id = m[1] + m[2], group = fl[key].matches || id, ext = axisExtent(gd, id);
      axes.push([key, id, group]);
      if (!ext) continue;
      const prev = extents.get(group);
      extents.set(group, prev ? [Math.min(prev[0], ext[0]), Math.max(prev[1], ext[1])] : ext);
    }
    for (const [key, id, group] of axes) {
      const ax = fl[key];
      if (ax.visible === false || !ax.range || !["linear", "log"].includes(ax.type)) continue;
      const ext = extents.get(group);
      if (!ext) continue;
      // rangemode "tozero" asks for a zero baseline (a magnitude read against 0): the axis may reach 0 however
      // far the data lie from it
      const [lo, hi] = ax.rangemode === "tozero" ? [Math.min(ext[0], 0), Math.max(ext[1], 0)] : ext, span = hi - lo;
      const pad = Math.max(0.5 * span, ax.type === "log" ? 0.5 : (span > 0 ? 0 : Math.max(1, Math.abs(lo))));
      const [r0, r1] = ax.range[0] <= ax.range[1] ? ax.range : [ax.range[1], ax.range[0]];
      if (r0 < lo - pad - 1e-9 || r1 > hi + pad + 1e-9) {
        const f = v => ax.type === "log" ? "1e" + v.toFixed(1) : v.toPrecision(3);
        out.push(`${key} runs ${f(r0)}..${f(r1)} but its data lie in ${f(lo)}..${f(hi)}`);
      }
    }
    return out;
  }

  // text drawn with the data (marker labels, bar labels) is clipped to its plot area: a label outside it is cut
  function clippedProblems(gd) {
    const out = new Set();
    gd.querySelectorAll(".scatterlayer .textpoint text, .barlayer text.bartext").forEach(el => {
      const text = words(el);
      if (!text) return;
      const holder = el.closest("[clip-path]");
      if (!holder || !gd.contains(holder)) return;
      const id = (holder.getAttribute("clip-path").match(/#([^)'"]+)/) || [])[1];
      const clip = id && document.getElementById(id);
      const rect = clip && clip.querySelector("rect");
      if (!rect) return;
      // the clip rectangle is in the user space of the element it clips: map its corners through that CTM
      const m = holder.getScreenCTM(), pt = (x, y) => new DOMPoint(x, y).matrixTransform(m);
      const x = rect.x.baseVal.value, y = rect.y.baseVal.value;
      const p0 = pt(x, y), p1 = pt(x + rect.width.baseVal.value, y + rect.height.baseVal.value);
      const c = { l: Math.min(p0.x, p1.x), r: Math.max(p0.x, p1.x), t: Math.min(p0.y, p1.y), b: Math.max(p0.y, p1.y) };
      const t = box(el);
      if (t.w === 0 || t.h === 0) return;
      if (t.l < c.l - SLACK || t.r > c.r + SLACK || t.t < c.t - SLACK || t.b > c.b + SLACK)
        out.add(`data label cut off by the plot area: "${short(text)}"`);
    });
    // and two data labels must not cover each other
    const labels = Array.from(gd.querySelectorAll(".scatterlayer .textpoint text"))
      .filter(el => words(el)).map(el => ({ text: words(el), b: box(el) })).filter(l => l.b.w > 0);
    let shown = 0;
    for (let i = 0; i < labels.length && shown < 3; i++) {
      for (let j = i + 1; j < labels.length && shown < 3; j++) {
        if (overlap(labels[i].b, labels[j].b)) {
          out.add(`data label "${short(labels[i].text)}" overlaps data label "${short(labels[j].text)}"`);
          shown++;
        }
      }
    }
    return Array.from(out);
  }

  // a bar's label must not be crossed by what is drawn after it: another bar's outline (lesson 05's scheduled cells,
  // drawn over the measured ones, ran their red sides through the micro-batch numbers), an opaque bar, or a shape
  // drawn above the data
  function paintsStroke(st) {
    return st.stroke && st.stroke !== "none" && rgb(st.stroke) && parseFloat(st.strokeWidth) > 0 &&
      parseFloat(st.strokeOpacity || 1) > 0;
  }
  function paintsFill(st) {
    return st.fill && st.fill !== "none" && (rgb(st.fill) || /url\(/.test(st.fill)) && parseFloat(st.fillOpacity || 1) > 0;
  }
  function coveredTextProblems(gd) {
    const texts = Array.from(gd.querySelectorAll(".barlayer text.bartext")).filter(el => words(el))
      .map(el => ({ el, text: words(el), b: box(el) })).filter(t => t.b.w > 0 && t.b.h > 0);
    if (!texts.length) return [];
    const painted = Array.from(gd.querySelectorAll(".barlayer .point path, .layer-above .shapelayer path"))
      .map(el => ({ el, b: box(el), st: getComputedStyle(el) })).filter(p => p.b.w > 0 || p.b.h > 0);
    const hits = [];
    for (const t of texts) {
      const c = { l: t.b.l + 2, r: t.b.r - 2, t: t.b.t + 2, b: t.b.b - 2 };       // the glyphs, not the line box
      const inX = x => x > c.l && x < c.r, inY = y => y > c.t && y < c.b;
      const spansX = p => p.b.l < c.r && p.b.r > c.l, spansY = p => p.b.t < c.b && p.b.b > c.t;
      const over = painted.find(p => {
        if (p.el.closest(".point") === t.el.closest(".point")) return false;        // its own bar
        if (!(t.el.compareDocumentPosition(p.el) & Node.DOCUMENT_POSITION_FOLLOWING)) return false;   // drawn under
        if (!(spansX(p) && spansY(p))) return false;
        if (paintsFill(p.st)) return true;
        return paintsStroke(p.st) && ((inX(p.b.l) || inX(p.b.r)) || (inY(p.b.t) || inY(p.b.b)));
      });
      if (over) hits.push(t.text);
    }
    if (!hits.length) return [];
    return [`${hits.length} bar labels crossed by a bar or shape drawn over them (an outline's edge through the ` +
            `text), e.g. "${hits.slice(0, 5).map(short).join('", "')}"`];
  }

  // plotly does not draw an annotation anchored on a data axis outside that axis' range (on a log axis its
  // position is read as log10: a label given the raw value lands far off the plot and silently disappears)
  function hiddenAnnotationProblems(gd) {
    const fl = gd._fullLayout, out = [];
    for (const a of (fl.annotations || [])) {
      if (a.visible === false || !a.text) continue;
      for (const letter of ["x", "y"]) {
        const ref = a[letter + "ref"] || "";
        if (!/^[xy]\d*$/.test(ref)) continue;                  // "paper" and "x domain" are always on the figure
        const ax = fl[ref[0] + "axis" + ref.slice(1)];
        if (!ax || !ax.range || !["linear", "log"].includes(ax.type) || typeof a[letter] !== "number") continue;
        const [r0, r1] = ax.range[0] <= ax.range[1] ? ax.range : [ax.range[1], ax.range[0]];
        const v = a[letter], eps = 1e-9 * Math.max(1, Math.abs(r1 - r0));
        if (v < r0 - eps || v > r1 + eps) {
          const note = ax.type === "log" ? " (a log axis: give log10 of the value)" : "";
          out.push(`annotation "${short(words({ textContent: a.text }))}" is not drawn: ${letter}=${v.toPrecision(3)} ` +
                   `lies outside ${ref}'s range ${r0.toPrecision(3)}..${r1.toPrecision(3)}${note}`);
        }
      }
    }
    return out;
  }

  // plotly labels minor log ticks with a single digit ("2" at 20 between 10 and 100): read as 2
  function logLabelProblems(gd) {
    const fl = gd._fullLayout, out = [];
    for (const key of Object.keys(fl)) {
      const ax = fl[key];
      if (!/^[xy]axis\d*$/.test(key) || !ax || ax.type !== "log" || ax.visible === false) continue;
      for (const t of (ax._vals || [])) {
        const text = String(t.text || "").replace(/<[^>]*>/g, "").replace(/\u2212/g, "-").trim();
        if (!/^-?\d+(\.\d+)?$/.test(text) || !(Number(text) > 0)) continue;
        if (Math.abs(Math.log10(Number(text)) - t.x) > 0.01) {
          out.push(`${key} labels ${Number(10 ** t.x).toPrecision(3)} as "${text}" (plotly's minor log labels): ` +
                   "use minorloglabels='none' or tickvals");
          break;
        }
      }
    }
    return out;
  }

  // two legend entries in one colour cannot be told apart (e.g. two region names that hash to the same blue)
  function rgb(c) {
    const m = (c || "").match(/rgba?\(\s*([\d.]+)[,\s]+([\d.]+)[,\s]+([\d.]+)(?:[,\s/]+([\d.]+))?/);
    if (!m || (m[4] !== undefined && Number(m[4]) === 0)) return null;
    return [Number(m[1]), Number(m[2]), Number(m[3])];
  }
  function paints(el) {        // the colours an SVG element paints with; a pattern fill: the colours inside it
    const st = getComputedStyle(el), out = [];
    for (const v of [st.fill, st.stroke]) {
      const id = (v.match(/url\(["']?#([^"')]+)/) || [])[1];
      if (id) {
        const pat = document.getElementById(id);
        if (pat) pat.querySelectorAll("*").forEach(c => out.push(...paints(c)));
      } else if (rgb(v)) out.push(rgb(v));
    }
    return out;
  }
  function legendColourProblems(gd) {
    const out = [], swatches = [];
    gd.querySelectorAll(".legend .traces").forEach(tr => {
      const name = words(tr.querySelector(".legendtext") || tr);
      const paths = Array.from(tr.querySelectorAll(".layers path"));      // fill, line and marker
      if (!name || !paths.length) return;
      const cs = paths.flatMap(paints);                 // a dashed line or another marker shape tells them apart
      const shape = paths.map(p => (p.getAttribute("d") || "") + "|" + getComputedStyle(p).strokeDasharray).join();
      if (cs.length) swatches.push({ name, cs, shape });
    });
    const near = (a, b) => Math.hypot(a[0] - b[0], a[1] - b[1], a[2] - b[2]) < COLOUR_DIST;
    for (let i = 0; i < swatches.length; i++) {
      for (let j = i + 1; j < swatches.length; j++) {
        const a = swatches[i], b = swatches[j];
        if (a.name !== b.name && a.shape === b.shape && a.cs.length === b.cs.length &&
            a.cs.every((c, k) => near(c, b.cs[k])))
          out.push(`legend entries "${short(a.name)}" and "${short(b.name)}" have the same colour ` +
                   `rgb(${a.cs[0].join(", ")})`);
      }
    }
    return out;
  }

  // plotly's toolbar (modebar) shows at the top right while the mouse is over the figure, over whatever is there
  // (issue 39: long titles ran under it); figcheck draws figures with it, hidden until hovered, as JupyterLab does
  function toolbarProblems(gd, boxes) {
    const bar = gd.querySelector(".modebar");
    if (!bar) return [];
    const b = box(bar);
    if (b.w === 0 || b.h === 0) return [];
    return boxes.filter(t => t.kind !== "tick label" && overlap(t.b, b))
      .map(t => `${t.kind} "${short(t.text)}" lies under plotly's toolbar (shown on hover at the top right): ` +
                `start it below style.TOOLBAR_PX (style.top_title) or give it a top margin of 80 px or more`);
  }

  window.parlabCheck = function (gd) {
    const problems = [];
    const fig = box(gd.querySelector(".main-svg") || gd);
    const boxes = textBoxes(gd);
    for (const t of boxes) {       // cut off: every text box inside the figure
      if (t.b.l < fig.l - SLACK || t.b.r > fig.r + SLACK || t.b.t < fig.t - SLACK || t.b.b > fig.b + SLACK)
        problems.push(`${t.kind} cut off at the figure's edge: "${short(t.text)}"`);
    }
    for (let i = 0; i < boxes.length; i++) {
      for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i], c = boxes[j];
        if (a.kind === "tick label" && c.kind === "tick label") continue;     // plotly spaces its own ticks
        if (a.el.contains(c.el) || c.el.contains(a.el)) continue;
        if (overlap(a.b, c.b))
          problems.push(`${a.kind} "${short(a.text)}" overlaps ${c.kind} "${short(c.text)}"`);
      }
    }
    const names = Array.from(gd.querySelectorAll(".legend .traces .legendtext")).map(words);
    const seen = new Set();
    for (const n of names) {
      if (seen.has(n)) problems.push(`legend lists "${short(n)}" twice`);
      seen.add(n);
    }
    problems.push(...toolbarProblems(gd, boxes), ...legendColourProblems(gd), ...logLabelProblems(gd));
    gd.querySelectorAll(".legend rect.scrollbar").forEach(bar => {     // a legend taller than its figure scrolls:
      const b = box(bar);                                              // its last entries are hidden on a slide
      if (b.h > 0 && b.w > 0) problems.push(`legend does not fit the figure's height: it scrolls (` +
        `${gd.querySelectorAll(".legend .traces").length} entries); make the figure taller or the legend shorter`);
    });
    problems.push(...fontProblems(gd), ...rangeProblems(gd), ...clippedProblems(gd), ...hiddenAnnotationProblems(gd),
                  ...coveredTextProblems(gd));
    return Array.from(new Set(problems));
  };

  // ipywidgets draws a description in a label box 80 px wide (13 px UI font) and cuts longer ones with "...";
  // the UI font differs between systems, so a label must fit in Arial's metrics and in the wider DejaVu Sans
  window.parlabCheckLabels = function (labels) {
    const host = document.createElement("div");
    document.body.appendChild(host);
    const cut = [];
    for (const l of labels) {
      for (const font of ["'Liberation Sans', Arial, Helvetica", "'DejaVu Sans', Verdana"]) {
        const el = document.createElement("div");
        el.textContent = l.description;
        el.style.cssText = `font-family: ${font}, sans-serif; font-size: 13px; white-space: nowrap;` +
          `overflow: hidden; text-overflow: ellipsis; box-sizing: border-box; width: ${l.width || "80px"}`;
        host.appendChild(el);
        if (el.scrollWidth > el.clientWidth + 0.5) { cut.push(l.description); break; }
      }
    }
    host.remove();
    return cut;
  };
})();
