// sglang-pacer dashboard: polls /admin/timeline and draws it with uPlot. No build step.
"use strict";

(function () {
  const POLL_MS = 1000;
  const WINDOW_S = 600;
  const STATUS_COLOURS = {
    applied: "#22863a", revived: "#22863a", acting: "#b08800", failed: "#b31d28",
    refused: "#b31d28", advised: "#6f42c1", noted: "#6f42c1",
  };
  // one state object, also read by the browser test
  const pacer = (window.pacer = { data: null, charts: {}, marks: 0, polls: 0, errors: [] });

  const $ = (sel) => document.querySelector(sel);
  const keyStore = window.sessionStorage;
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromHash) keyStore.setItem("pacer-admin-key", fromHash);

  $("#keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    keyStore.setItem("pacer-admin-key", $("#key").value);
    $("#keyform").hidden = true;
    poll();
  });

  function fmtTime(t) {
    return new Date(t * 1000).toLocaleTimeString();
  }

  function fmtNum(v, digits) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    return Number.isInteger(v) ? String(v) : v.toFixed(digits === undefined ? 2 : digits);
  }

  function shortNum(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
    if (a >= 1e3) return `${+(v / 1e3).toFixed(1)}k`;
    return `${+v.toFixed(2)}`;
  }

  // Decisions as vertical marks: drawn on every chart of their worker (and the proxy's chart).
  function marksPlugin(workerId) {
    return {
      hooks: {
        draw: [
          (u) => {
            const d = pacer.data;
            if (!d) return;
            const ctx = u.ctx;
            const [xmin, xmax] = [u.scales.x.min, u.scales.x.max];
            ctx.save();
            ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
            let drawn = 0; // labels of marks close together go on rows of their own
            for (const e of d.decisions) {
              if (e.t === null || e.t < xmin || e.t > xmax) continue;
              if (workerId !== null && e.worker !== workerId) continue;
              const x = Math.round(u.valToPos(e.t, "x", true));
              ctx.strokeStyle = STATUS_COLOURS[e.status] || "#444";
              ctx.lineWidth = 2 * devicePixelRatio;
              ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
              ctx.beginPath();
              ctx.moveTo(x, u.bbox.top);
              ctx.lineTo(x, u.bbox.top + u.bbox.height);
              ctx.stroke();
              ctx.fillStyle = ctx.strokeStyle;
              const gain = gainText(e);
              const row = 12 * (1 + (drawn++ % 3));
              ctx.fillText(`${e.rule} (${e.status})${gain ? ` gain ${gain.short}` : ""}`, x + 4 * devicePixelRatio,
                u.bbox.top + row * devicePixelRatio);
            }
            ctx.restore();
          },
        ],
      },
    };
  }

  function makeChart(el, title, series, workerId, yRange) {
    const opts = {
      title,
      width: Math.max(320, el.clientWidth || 480),
      height: 200,
      scales: { x: { time: true }, y: yRange ? { range: yRange } : { auto: true } },
      series: [{}].concat(series.map((s) => Object.assign({ points: { show: false } }, s))),
      axes: [{}, { size: 56, values: (u, vals) => vals.map(shortNum) }],
      plugins: [marksPlugin(workerId)],
      legend: { live: true },
    };
    const data = [[]].concat(series.map(() => []));
    return new uPlot(opts, data, el);
  }

  function workerCharts(w) {
    const box = document.createElement("div");
    box.className = "worker";
    box.id = `worker-${w.id}`;
    box.innerHTML =
      `<h3></h3><div class="args"></div><div class="charts">` +
      `<div class="chart" data-series="queue"></div><div class="chart" data-series="token_usage"></div>` +
      `<div class="chart" data-series="gen_throughput"></div><div class="chart" data-series="retractions_per_min"></div>` +
      `</div>`;
    $("#workers").appendChild(box);
    const el = (name) => box.querySelector(`[data-series="${name}"]`);
    return {
      box,
      queue: makeChart(el("queue"), "Server queue against the band, running requests", [
        { label: "#queue-req", stroke: "#d73a49", width: 2 },
        { label: "#running-req", stroke: "#0366d6", width: 2 },
        { label: "in flight (proxy)", stroke: "#6a737d" },
        { label: "band low", stroke: "#28a745", dash: [6, 4] },
        { label: "band high", stroke: "#28a745", dash: [2, 4] },
      ], w.id),
      token_usage: makeChart(el("token_usage"), "Token usage (KV pool)", [
        { label: "token usage", stroke: "#6f42c1", width: 2, fill: "rgba(111,66,193,0.08)" },
      ], w.id, [0, 1]),
      gen_throughput: makeChart(el("gen_throughput"), "Generation throughput (tokens/s)", [
        { label: "tokens/s", stroke: "#e36209", width: 2 },
      ], w.id),
      retractions_per_min: makeChart(el("retractions_per_min"), "Retractions per minute", [
        { label: "retractions/min", stroke: "#b31d28", width: 2 },
      ], w.id),
    };
  }

  // A pause in the samples (the worker restarting, scrapes failing) is a gap in the curves, not a
  // straight line across it: a null row where two samples are much further apart than usual.
  function withGaps(cols) {
    const t = cols[0];
    if (t.length < 3) return cols;
    const steps = t.slice(1).map((v, i) => v - t[i]).sort((a, b) => a - b);
    const limit = Math.max(3 * steps[Math.floor(steps.length / 2)], 2);
    const out = cols.map(() => []);
    for (let i = 0; i < t.length; i++) {
      if (i > 0 && t[i] - t[i - 1] > limit) {
        out[0].push(t[i - 1] + limit / 2);
        for (let c = 1; c < cols.length; c++) out[c].push(null);
      }
      for (let c = 0; c < cols.length; c++) out[c].push(cols[c][i]);
    }
    return out;
  }

  function renderWorker(w, d) {
    let c = pacer.charts[w.id];
    if (!c) c = pacer.charts[w.id] = workerCharts(w);
    const s = w.series;
    const pool = w.pool ? ` · pool ${w.pool}` : "";
    c.box.querySelector("h3").textContent =
      `${w.id}${pool} · ${w.state}${w.managed ? "" : " (external)"} · restarts ${w.restarts} · ${w.url}`;
    c.box.querySelector(".args").textContent =
      Object.entries(w.args).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join("  ") || "(no args)";
    const lo = s.t.map(() => d.band[0]);
    const hi = s.t.map(() => d.band[1]);
    c.queue.setData(withGaps([s.t, s.queue, s.running, s.in_flight, lo, hi]));
    c.token_usage.setData(withGaps([s.t, s.token_usage]));
    c.gen_throughput.setData(withGaps([s.t, s.gen_throughput]));
    c.retractions_per_min.setData(withGaps([s.t, s.retractions_per_min]));
  }

  function renderProxy(d) {
    const p = d.proxy;
    const classes = Object.keys(p).filter((k) => k.startsWith("queue_"));
    const key = classes.join(",");
    if (!pacer.charts.__proxy || pacer.charts.__proxy.key !== key) {
      if (pacer.charts.__proxy) pacer.charts.__proxy.chart.destroy();
      const el = $("#chart-proxy");
      el.innerHTML = "";
      const palette = ["#d73a49", "#0366d6", "#e36209", "#6f42c1"];
      const series = classes.map((c, i) => ({ label: c.slice(6), stroke: palette[i % palette.length], width: 2 }));
      series.push({ label: "in flight", stroke: "#6a737d" });
      pacer.charts.__proxy = { key, chart: makeChart(el, "Waiting in the proxy, per class; in flight to workers", series, null) };
    }
    pacer.charts.__proxy.chart.setData([p.t].concat(classes.map((c) => p[c]), [p.in_flight]));
  }

  function describeChange(e) {
    const parts = Object.entries(e.changes || {}).map(([k, [a, b]]) => `${k} ${fmtNum(a)} → ${fmtNum(b)}`);
    return parts.join(", ") || e.action || "";
  }

  function gainOf(e, name) {
    if (e[name] !== undefined) return e[name];
    if (e.outcome && e.outcome[name] !== undefined) return e.outcome[name];
    return undefined;
  }

  // the journal's top-level figures of a gain, shown with the evidence
  const GAIN_FIELDS = [
    "predicted_gain", "predicted_ratio", "predicted_throughput", "predicted_current", "twin_error",
    "prediction_requests", "measured_gain", "measured_throughput", "first_token_before_s", "first_token_after_s",
    "met_prediction", "prediction_tolerance", "not_predicted", "not_measured",
  ];

  function pct(v) {
    return typeof v === "number" ? `${v >= 0 ? "+" : ""}${(v * 100).toFixed(1)}%` : "–";
  }

  // A decision's gain: predicted / measured (short), and in words what the figures do not say by
  // themselves (an output budget's prediction met within the twin's error or not, why one is missing).
  function gainText(e) {
    const predicted = gainOf(e, "predicted_gain");
    const measured = gainOf(e, "measured_gain");
    if (predicted === undefined && measured === undefined && !e.not_predicted && !e.not_measured) return null;
    let short = `${pct(predicted)} / ${pct(measured)}`;
    const words = [];
    if (typeof e.met_prediction === "boolean") {
      short += e.met_prediction ? " ✓" : " ✗";
      const within = e.met_prediction ? "within" : "outside";
      const tolerance = typeof e.prediction_tolerance === "number" ? ` (${(e.prediction_tolerance * 100).toFixed(1)}%)` : "";
      words.push(`measured ${within} the twin's error${tolerance}`);
    }
    if (e.not_predicted) words.push(`not predicted: ${e.not_predicted}`);
    if (e.not_measured) words.push(`not measured: ${e.not_measured}`);
    return { short, words: words.join("; ") };
  }

  function renderDecisions(d) {
    const body = $("#decisions tbody");
    body.innerHTML = "";
    for (const e of d.decisions.slice().reverse()) {
      const tr = document.createElement("tr");
      tr.className = "decision";
      tr.dataset.rule = e.rule;
      tr.dataset.status = e.status;
      tr.dataset.worker = e.worker;
      const gain = gainText(e);
      const verdict = e.outcome && e.outcome.verdict ? ` (${e.outcome.verdict})` : "";
      const cells = [
        e.t ? fmtTime(e.t) : e.time, e.worker, e.rule, e.status, describeChange(e),
        `${gain ? gain.short : "– / –"}${verdict}`,
      ];
      for (const text of cells) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      tr.children[3].className = `st-${e.status}`;
      const gainCell = tr.children[5];
      gainCell.className = "gain";
      if (gain && gain.words) {
        gainCell.title = gain.words;
        const note = document.createElement("div");
        note.className = "muted";
        note.textContent = gain.words;
        gainCell.appendChild(note);
      }
      const td = document.createElement("td");
      td.className = "reason";
      const details = document.createElement("details");
      const summary = document.createElement("summary");
      summary.textContent = e.reason + (e.detail ? ` — ${e.detail}` : "");
      const pre = document.createElement("pre");
      const figures = Object.fromEntries(GAIN_FIELDS.filter((k) => e[k] !== undefined).map((k) => [k, e[k]]));
      const shown = { evidence: e.evidence, gain: Object.keys(figures).length ? figures : undefined, outcome: e.outcome, act: e.act };
      pre.textContent = JSON.stringify(shown, null, 1);
      details.append(summary, pre);
      td.appendChild(details);
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function render(d) {
    pacer.data = d;
    const queue = Object.entries(d.proxy)
      .filter(([k]) => k.startsWith("queue_"))
      .map(([k, v]) => `${k.slice(6)} ${v.length ? v[v.length - 1] : 0}`)
      .join(", ");
    const inFlight = d.proxy.in_flight.length ? d.proxy.in_flight[d.proxy.in_flight.length - 1] : 0;
    $("#summary").textContent =
      `controller ${d.mode} · band [${d.band[0]}, ${d.band[1]}] · proxy queue: ${queue || "0"} · in flight ${inFlight} · ` +
      `${d.workers.length} worker(s) · ${d.decisions.length} decision(s)`;
    $("#mode").textContent = d.mode;
    $("#updated").textContent = `updated ${fmtTime(d.now)}`;
    for (const w of d.workers) renderWorker(w, d);
    renderProxy(d);
    renderDecisions(d);
    const shown = d.decisions.filter((e) => e.t !== null && e.t >= d.now - d.window_s);
    pacer.marks = shown.length;
    document.body.dataset.marks = String(shown.length);
  }

  async function poll() {
    const headers = {};
    const key = keyStore.getItem("pacer-admin-key");
    if (key) headers.Authorization = `Bearer ${key}`;
    try {
      const r = await fetch(`/admin/timeline?window_s=${WINDOW_S}`, { headers, cache: "no-store" });
      if (r.status === 401 || r.status === 403) {
        $("#keyform").hidden = false;
        $("#summary").textContent = "admin key needed";
        return;
      }
      if (!r.ok) throw new Error(`/admin/timeline answered ${r.status}`);
      render(await r.json());
      pacer.polls += 1;
      $("#error").hidden = true;
    } catch (err) {
      pacer.errors.push(String(err));
      $("#error").textContent = `cannot read the proxy: ${err}`;
      $("#error").hidden = false;
    } finally {
      clearTimeout(pacer.timer);
      pacer.timer = setTimeout(poll, POLL_MS);
    }
  }

  window.addEventListener("resize", () => {
    for (const c of Object.values(pacer.charts)) {
      for (const u of [c.queue, c.token_usage, c.gen_throughput, c.retractions_per_min, c.chart]) {
        if (u) u.setSize({ width: Math.max(320, u.root.parentElement.clientWidth), height: 200 });
      }
    }
  });
  poll();
})();
