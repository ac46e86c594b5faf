// voicelane demo: a canvas timeline of the last utterances. One row per utterance, time 0 = its context.create;
// lanes: text sent (ticks), audio received (one tick per packet), played (bar; underruns cut it), cancelled (x).

export const COLORS = {
  text: "#8b93a7",
  received: "#4c8dff",
  played: "#2fbf71",
  underrun: "#f5a623",
  cancelled: "#ff5468",
  grid: "rgba(139,147,167,0.18)",
  label: "#c9cfdc",
  dim: "#8b93a7",
};

export function drawTimeline(canvas, utterances, now, maxRows = 6) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 600;
  const rows = utterances.slice(-maxRows);
  const rowH = 42;
  const top = 18;
  const cssH = top + Math.max(1, rows.length) * rowH + 6;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
    canvas.style.height = `${cssH}px`;
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, cssW, cssH);
  g.font = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  g.textBaseline = "middle";

  const labelW = 118;
  const x0 = labelW + 6;
  const w = cssW - x0 - 10;
  const end = (u) => {
    const t = [u.playEnd, u.cancelAt, u.doneAt, u.packets.length ? u.packets[u.packets.length - 1] : 0,
               u.text.length ? u.text[u.text.length - 1] : 0];
    const live = u.final ? 0 : now - u.t0;
    return Math.max(live, ...t.filter((v) => v !== undefined && v !== null));
  };
  let span = 2000;
  for (const u of rows) span = Math.max(span, end(u) * 1.05);
  const sx = (t) => x0 + (Math.max(0, t) / span) * w;

  // Grid: a line per second (or per 5 s on long spans).
  const stepMs = span > 12000 ? 5000 : span > 6000 ? 2000 : 1000;
  g.fillStyle = COLORS.dim;
  g.textAlign = "center";
  for (let t = 0; t <= span; t += stepMs) {
    g.strokeStyle = COLORS.grid;
    g.beginPath();
    g.moveTo(sx(t) + 0.5, top - 4);
    g.lineTo(sx(t) + 0.5, cssH - 4);
    g.stroke();
    g.fillText(`${t / 1000}s`, sx(t), 8);
  }

  if (!rows.length) {
    g.textAlign = "left";
    g.fillStyle = COLORS.dim;
    g.fillText("no utterances yet", x0, top + rowH / 2);
    return;
  }

  rows.forEach((u, r) => {
    const y = top + r * rowH;
    g.textAlign = "left";
    g.fillStyle = COLORS.label;
    g.fillText(`#${u.n} ${u.kind}`, 4, y + 10);
    g.fillStyle = COLORS.dim;
    const ttfa = u.firstPlayed !== undefined ? `${Math.round(u.firstPlayed)} ms` : "…";
    g.fillText(`TTFA ${ttfa}`, 4, y + 26);

    const lane = (k) => y + 6 + k * 10;
    // text sent
    g.strokeStyle = COLORS.text;
    for (const t of u.text) {
      g.beginPath();
      g.moveTo(sx(t) + 0.5, lane(0) - 3);
      g.lineTo(sx(t) + 0.5, lane(0) + 3);
      g.stroke();
    }
    // audio received
    g.strokeStyle = COLORS.received;
    for (const t of u.packets) {
      g.beginPath();
      g.moveTo(sx(t) + 0.5, lane(1) - 3);
      g.lineTo(sx(t) + 0.5, lane(1) + 3);
      g.stroke();
    }
    // played
    if (u.playStart !== undefined) {
      const stop = u.playEnd ?? u.cancelAt ?? now - u.t0;
      g.fillStyle = COLORS.played;
      g.fillRect(sx(u.playStart), lane(2) - 3, Math.max(1, sx(stop) - sx(u.playStart)), 6);
      g.fillStyle = COLORS.underrun;
      for (const [a, b] of u.underruns) {
        const bb = b ?? stop;
        g.fillRect(sx(a), lane(2) - 3, Math.max(2, sx(bb) - sx(a)), 6);
      }
    }
    // cancelled
    if (u.cancelAt !== undefined) {
      const cx = sx(u.cancelAt);
      g.strokeStyle = COLORS.cancelled;
      g.lineWidth = 2;
      g.beginPath();
      g.moveTo(cx - 4, lane(1) - 4);
      g.lineTo(cx + 4, lane(1) + 4);
      g.moveTo(cx + 4, lane(1) - 4);
      g.lineTo(cx - 4, lane(1) + 4);
      g.stroke();
      g.lineWidth = 1;
    }
    if (r < rows.length - 1) {
      g.strokeStyle = COLORS.grid;
      g.beginPath();
      g.moveTo(0, y + rowH - 4.5);
      g.lineTo(cssW, y + rowH - 4.5);
      g.stroke();
    }
  });
}
