// Minimal canvas charts: line and scatter, with optional shaded x-ranges. No dependencies.
// drawChart(canvas, {series: [{name, color, points: [[x, y], ...]}], kind: 'line'|'scatter',
//                    xTime: bool, xInteger: bool, yMin, yMax, xLabel, floating: bool,
//                    shade: [[x0, x1, color?], ...]})
// A point of a line with no neighbour to join (one second of data, a gap either side) is a dot.
"use strict";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const n = raw / mag;
  return (n >= 5 ? 5 : n >= 2 ? 2 : 1) * mag;
}

function timeStep(span) {
  for (const s of [1, 2, 5, 10, 15, 30, 60, 120, 300, 600]) if (span / s <= 5) return s;
  return 1800;
}

function fmt(v, step) {
  if (step !== undefined) {          // as many decimals as the tick step needs: 44.5 and 45 stay apart
    return v.toFixed(Math.max(0, Math.min(3, -Math.floor(Math.log10(step) + 1e-9))));
  }
  const a = Math.abs(v);
  if (a >= 10) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  return v.toFixed(2);
}

function fmtTime(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

function drawChart(canvas, opt) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, 'DejaVu Sans', sans-serif";
  const pad = {l: 42, r: 8, t: 16, b: 20};
  const series = (opt.series || []).filter(s => s.points && s.points.length);
  let xs = [], ys = [];
  for (const s of series) for (const p of s.points) { if (p[1] !== null && isFinite(p[1])) { xs.push(p[0]); ys.push(p[1]); } }
  if (!xs.length) {
    ctx.fillStyle = "#9ca3af";
    ctx.fillText(opt.empty || "no data yet", w / 2 - 30, h / 2);
    return 0;
  }
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (opt.xMin !== undefined) x0 = Math.min(x0, opt.xMin);
  if (x1 === x0) x1 = x0 + 1;
  let y0 = opt.yMin !== undefined ? opt.yMin : Math.min(...ys);
  let y1 = opt.yMax !== undefined ? Math.max(opt.yMax, Math.max(...ys)) : Math.max(...ys);
  if (opt.yMin === undefined && !opt.floating) y0 = Math.min(0, y0);
  if (opt.floating) { const m = Math.max(1, (y1 - y0) * 0.2); y0 -= m; y1 += m; }
  if (y1 === y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const X = x => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);

  // shaded ranges (e.g. throttled periods): [x0, x1] or [x0, x1, color]
  ctx.globalAlpha = 0.14;
  for (const [a, b, color] of opt.shade || []) {
    ctx.fillStyle = color || "#dc2626";
    const xa = Math.max(X(a), pad.l), xb = Math.min(X(b), w - pad.r);
    if (xb > xa) ctx.fillRect(xa, pad.t, Math.max(2, xb - xa), h - pad.t - pad.b);
  }
  ctx.globalAlpha = 1;
  // grid and y ticks
  ctx.strokeStyle = "#e5e7eb"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
  const ys_ = niceStep(y1 - y0, 4);
  for (let v = Math.ceil(y0 / ys_) * ys_; v <= y1; v += ys_) {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(v)); ctx.lineTo(w - pad.r, Y(v)); ctx.stroke();
    ctx.fillText(fmt(v, ys_), 2, Y(v) + 4);
  }
  // x ticks (whole seconds on time axes, so labels never repeat)
  let xs_ = opt.xTime ? timeStep(x1 - x0) : niceStep(x1 - x0, 5);
  if (opt.xInteger) xs_ = Math.max(1, Math.round(xs_));
  for (let v = Math.ceil(x0 / xs_) * xs_; v <= x1; v += xs_) {
    const label = opt.xTime ? fmtTime(v) : fmt(v, xs_);
    ctx.fillText(label, Math.min(X(v) - 14, w - 48), h - 5);
  }
  if (opt.xLabel) ctx.fillText(opt.xLabel, w - pad.r - ctx.measureText(opt.xLabel).width, pad.t - 4);
  // data
  let drawn = 0, lx = pad.l;
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 1.5;
    if (opt.kind === "scatter") {
      for (const p of s.points) if (p[1] !== null) { ctx.fillRect(X(p[0]) - 1.5, Y(p[1]) - 1.5, 3, 3); drawn++; }
    } else {
      ctx.beginPath();
      let pen = false;
      const ok = p => p && p[1] !== null && isFinite(p[1]);
      s.points.forEach((p, j) => {
        if (!ok(p)) { pen = false; return; }
        if (pen) ctx.lineTo(X(p[0]), Y(p[1])); else ctx.moveTo(X(p[0]), Y(p[1]));
        if (!pen && !ok(s.points[j + 1])) ctx.fillRect(X(p[0]) - 2, Y(p[1]) - 2, 4, 4);
        pen = true; drawn++;
      });
      ctx.stroke();
    }
    // legend along the top
    if (series.length > 1 || s.name) {
      ctx.fillRect(lx, 3, 8, 8);
      ctx.fillStyle = "#374151";
      ctx.fillText(s.name, lx + 11, 11);
      lx += 18 + ctx.measureText(s.name).width;
    }
  });
  return drawn;
}

window.drawChart = drawChart;
window.PALETTE = PALETTE;
