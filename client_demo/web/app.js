// voicelane demo page: connect, speak or stream simulated LLM text, hear it, barge in, watch the numbers.
import { OpusStream, PcmStream, Player, Resampler, hasWebCodecsOpus } from "./audio.js";
import { Session, defaultServerUrl, normaliseUrl, parseFrame } from "./protocol.js";
import { drawTimeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(window.location.search);
const ACK_INTERVAL_MS = 200;
const OPUS_FORMAT = { encoding: "opus", sample_rate: 48000, channels: 1, frame_ms: 20, bitrate: 32000 };
const PCM_FORMAT = { encoding: "pcm_s16le", sample_rate: 24000, channels: 1 };

const player = new Player();
const state = {
  session: null,
  created: null,
  codec: null, // "opus" (WebCodecs) | "pcm"
  utterances: [],
  byContext: new Map(),
  byStream: new Map(),
  seq: 0,
  llm: null, // {u, tokens, i, timer}
  audio: { buffered: 0, output: 0, underruns: 0, droppedPushes: 0 },
  counters: { packets: 0, bytes: 0, late: 0, stray: 0, acks: 0, errors: 0 },
};
const KEEP_UTTERANCES = 50;

const now = () => performance.now();
const ms = (samples, rate) => (samples / rate) * 1000;
const fmtMs = (v) => (v === undefined || v === null ? "–" : `${Math.round(v)}`);

// ------------------------------------------------------------------------------------------------ log

function log(dir, msg) {
  const t = new Date().toISOString().slice(11, 23);
  const text = typeof msg === "string" ? msg : JSON.stringify(msg);
  const el = $("log");
  const line = document.createElement("div");
  line.className = `log-${dir}`;
  line.textContent = `${t} ${dir === "in" ? "←" : dir === "out" ? "→" : "·"} ${text}`;
  el.appendChild(line);
  while (el.childElementCount > 200) el.firstElementChild.remove();
  el.scrollTop = el.scrollHeight;
}

function send(msg, quiet = false) {
  if (!state.session || !state.session.send(msg)) return false;
  if (!quiet) log("out", msg);
  return true;
}

// ------------------------------------------------------------------------------------------------ connection

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.dataset.kind = kind;
}

async function connect() {
  if (state.session) {
    disconnect();
    return;
  }
  const key = $("key").value.trim();
  let url;
  try {
    url = normaliseUrl($("url").value || defaultServerUrl());
  } catch (e) {
    setStatus(`bad URL: ${e.message}`, "error");
    return;
  }
  if (!window.isSecureContext || !window.AudioWorkletNode) {
    // AudioWorklet (and WebCodecs) exist only in secure contexts: https, or http on localhost / 127.0.0.1.
    setStatus("audio needs a secure context: open the page via https, localhost or 127.0.0.1 (e.g. ssh -L)", "error");
    return;
  }
  $("connect").disabled = true;
  state.fatal = null;
  setStatus("connecting…", "busy");
  try {
    await player.start(Number($("prebuffer").value)); // inside the click: browsers allow audio to start here
    state.codec = $("format").value === "pcm" || !(await hasWebCodecsOpus()) ? "pcm" : "opus";
    const session = new Session({ onJson, onAudio, onClose });
    state.session = session;
    let created;
    try {
      created = await session.connect(url, key, "subprotocol");
    } catch (e) {
      // A server that does not negotiate subprotocols fails the handshake: fall back to ?token=<key>.
      if (!key || e.opened || e.code) throw e;
      log("info", "subprotocol handshake failed; retrying with ?token=");
      created = await session.connect(url, key, "token");
    }
    state.created = created;
    fillCatalog(created);
    setStatus(`connected · ${created.model || "model"}`, "ok");
    $("connect").textContent = "Disconnect";
    showSessionInfo();
    ping();
    document.body.classList.add("connected");
  } catch (e) {
    setStatus(`not connected: ${e.message}`, "error");
    log("info", `connect failed: ${e.message}`);
    state.session = null;
  } finally {
    $("connect").disabled = false;
  }
}

function showSessionInfo() {
  const c = state.created;
  if (!c) return;
  const rtt = state.rtt === undefined ? "" : ` · rtt ${state.rtt.toFixed(1)} ms`;
  const random = c.random_weights ? " · random weights (noise)" : "";
  $("session-info").textContent = `session ${c.session_id} · ${c.protocol}${rtt}${random}`;
}

/** Browsers cannot send WebSocket pings: a `ping` message measures the round trip and keeps the session alive
 * while the page is open (the server closes sessions idle for limits.idle_timeout_s). */
function ping() {
  if (!state.session || !state.session.open) return;
  state.pingSent = { id: `p${Date.now()}`, t: now() };
  send({ type: "ping", id: state.pingSent.id }, true);
}

setInterval(ping, 15000);

function disconnect() {
  stopLlm();
  if (state.session) state.session.close();
}

function onClose(e) {
  state.session = null;
  state.created = null;
  document.body.classList.remove("connected");
  $("connect").textContent = "Connect";
  stopLlm();
  player.clear();
  state.byStream.clear(); // stream ids are per socket: the next session starts from 1 again
  for (const u of state.utterances) {
    if (!u.final) {
      u.final = true;
      u.status = u.status === "done" ? "done" : "closed";
      if (u.decoder) u.decoder.close();
    }
  }
  if (state.fatal) setStatus(`disconnected: ${state.fatal}`, "error");
  else setStatus(`disconnected (${e.code}${e.reason ? ` ${e.reason}` : ""})`, e.code === 1000 ? "idle" : "error");
  log("info", `socket closed ${e.code} ${e.reason || ""}`);
}

function fillCatalog(created) {
  const voices = (created.voices || []).map((v) => (typeof v === "string" ? { name: v, languages: [] } : v));
  const defaults = created.defaults || {};
  const vSel = $("voice");
  vSel.replaceChildren();
  for (const v of voices) {
    const o = document.createElement("option");
    o.value = v.name;
    o.textContent = v.name;
    vSel.appendChild(o);
  }
  const wantVoice = (params.get("voice") || defaults.voice || "").toLowerCase();
  const match = [...vSel.options].find((o) => o.value.toLowerCase() === wantVoice);
  if (match) vSel.value = match.value;
  state.voices = voices;
  fillLanguages(params.get("language") || defaults.language);
}

/** The languages of the chosen voice (all the server's languages when the voice lists none). */
function fillLanguages(want) {
  const lSel = $("language");
  const keep = want || lSel.value;
  const voice = (state.voices || []).find((v) => v.name === $("voice").value);
  let langs = voice && voice.languages && voice.languages.length ? voice.languages
    : (state.created && state.created.languages) || [];
  if (!langs.includes("auto")) langs = ["auto", ...langs];
  lSel.replaceChildren();
  for (const l of langs) {
    const o = document.createElement("option");
    o.value = l;
    o.textContent = l;
    lSel.appendChild(o);
  }
  if (keep && langs.includes(keep)) lSel.value = keep;
}

// ------------------------------------------------------------------------------------------------ utterances

function newUtterance(kind) {
  if (!state.session || !state.session.open) {
    setStatus("connect first", "error");
    return null;
  }
  const n = ++state.seq;
  const u = {
    n,
    kind,
    contextId: `${kind}-${n}-${Math.random().toString(36).slice(2, 8)}`,
    t0: now(),
    text: [], // ms after t0 of each text message
    chars: 0,
    preview: "",
    packets: [], // ms after t0 of each audio packet
    underruns: [], // [start, end] ms after t0
    status: "opening",
    streamId: null,
    decoder: null,
    resampler: null,
    decoded: 0,
    sourceRate: 48000,
    played: 0, // samples at the AudioContext rate
    queued: 0,
    playState: "buffering",
    lateDropped: 0,
    acks: 0,
    bytes: 0,
    final: false,
    ackDone: false,
  };
  state.utterances.push(u);
  state.byContext.set(u.contextId, u);
  while (state.utterances.length > KEEP_UTTERANCES && state.utterances[0].final) {
    const old = state.utterances.shift();
    state.byContext.delete(old.contextId);
    state.byStream.delete(old.streamId);
  }
  player.open(u.contextId);
  send({
    type: "context.create",
    context_id: u.contextId,
    voice: $("voice").value || undefined,
    language: $("language").value || undefined,
    output_format: state.codec === "opus" ? OPUS_FORMAT : PCM_FORMAT,
  });
  return u;
}

function sendText(u, text) {
  if (!send({ type: "text", context_id: u.contextId, text }, u.kind === "llm")) return false;
  u.text.push(now() - u.t0);
  u.chars += text.length;
  if (u.preview.length < 80) u.preview += text;
  return true;
}

function speak() {
  const text = $("text").value;
  if (!text.trim()) return;
  const u = newUtterance("speak");
  if (!u) return;
  sendText(u, text);
  send({ type: "context.close", context_id: u.contextId });
  return u.contextId;
}

function onContextCreated(msg, u) {
  u.streamId = msg.stream_id;
  u.traceId = msg.trace_id;
  u.seed = msg.seed;
  state.byStream.set(msg.stream_id, u);
  if (u.cancelled) return; // barge-in came first: its packets are only counted and dropped
  if (u.status === "error") {
    // Its create was refused, but the text sent right behind it opened a context with the session defaults
    // (a first text creates one): that is not what the user asked for, so end it and drop its audio.
    u.cancelled = true;
    send({ type: "context.cancel", context_id: u.contextId });
    return;
  }
  u.status = "speaking";
  const fmt = msg.output_format || {};
  const enc = fmt.encoding || (state.codec === "opus" ? "opus" : "pcm_s16le");
  const onPcm = (pcm) => onDecoded(u, pcm);
  if (enc === "opus") {
    u.preSkip = (msg.opus && msg.opus.pre_skip) || 0;
    u.decoder = new OpusStream(u.preSkip, onPcm, (e) => {
      u.error = `decoder: ${e.message}`;
      log("info", `${u.contextId} decoder error: ${e.message}`);
    });
  } else {
    u.preSkip = 0;
    u.decoder = new PcmStream(enc, fmt.sample_rate || 24000, onPcm);
  }
  u.sourceRate = u.decoder.rate;
  u.resampler = new Resampler(u.decoder.rate, player.rate);
}

function onDecoded(u, pcm) {
  if (u.cancelled) return;
  u.decoded += pcm.length;
  const out = u.resampler.process(pcm);
  player.push(u.contextId, out);
}

function endAudio(u) {
  if (u.endSent || !u.decoder) return;
  u.endSent = true;
  u.decoder.end().then(
    () => !u.cancelled && player.end(u.contextId),
    () => !u.cancelled && player.end(u.contextId),
  );
}

function onAudio(buf) {
  let f;
  try {
    f = parseFrame(buf);
  } catch (e) {
    log("info", `bad audio frame: ${e.message}`);
    return;
  }
  const u = state.byStream.get(f.streamId);
  if (!u) {
    state.counters.stray++;
    return;
  }
  if (u.cancelled) {
    u.lateDropped++; // a packet of a stream we barged in on: never decoded, never played
    state.counters.late++;
    return;
  }
  const t = now() - u.t0;
  state.counters.packets++;
  state.counters.bytes += f.payload.length;
  u.bytes += f.payload.length;
  u.packets.push(t);
  if (u.firstPacket === undefined) u.firstPacket = t;
  if (f.payload.length) {
    try {
      u.decoder.decode(f.payload, f.startSample);
    } catch (e) {
      u.error = `decode: ${e.message}`;
    }
  }
  if (f.last) endAudio(u);
}

function onJson(msg) {
  const u = msg.context_id !== undefined ? state.byContext.get(msg.context_id) : undefined;
  if (msg.type !== "pong") log("in", msg);
  switch (msg.type) {
    case "context.created":
      if (u) onContextCreated(msg, u);
      break;
    case "pong":
      if (state.pingSent && msg.id === state.pingSent.id) {
        state.rtt = now() - state.pingSent.t;
        state.pingSent = null;
        showSessionInfo();
      }
      break;
    case "context.done":
      if (!u) break;
      u.done = msg;
      u.doneAt = now() - u.t0;
      if (u.cancelled) {
        // Our cancel crossed the server's done: the audio was cut here (the server answers a warning).
        u.status = "interrupted";
        finishUtterance(u);
        break;
      }
      u.status = "done";
      endAudio(u);
      if (!u.decoder) finishUtterance(u);
      break;
    case "context.cancelled":
      if (!u) break;
      u.serverCancelled = msg;
      if (u.status !== "error") u.status = "cancelled"; // a refused utterance stays refused on screen
      finishUtterance(u);
      break;
    case "error":
      state.counters.errors++;
      if (u && state.llm && state.llm.u === u && ["context_closed", "unknown_context"].includes(msg.code)) {
        stopLlm(); // the context ended under the stream (e.g. an idle timeout): stop feeding it
      }
      if (u && !u.done && !u.serverCancelled) {
        u.error = `${msg.code}: ${msg.message}`;
        if (["overloaded", "context_limit", "unknown_voice", "unknown_language", "unsupported_format",
             "invalid_field", "duplicate_context", "context_closed"].includes(msg.code) && !u.streamId) {
          u.status = "error";
          if (state.llm && state.llm.u === u) stopLlm();
          player.clear(u.contextId);
          finishUtterance(u);
          // A bare "error" told a new user nothing: say what was refused, why, and whether to retry.
          setStatus(`#${u.n} refused: ${msg.code}: ${msg.message}${msg.retryable ? " (retry shortly)" : ""}`,
                    "error");
        }
      }
      if (msg.fatal) {
        state.fatal = `${msg.code}: ${msg.message}`;
        setStatus(state.fatal, "error");
      }
      break;
    case "session.draining":
      setStatus(`server draining (${msg.deadline_s} s): reconnect elsewhere`, "busy");
      break;
  }
}

function finishUtterance(u) {
  if (u.final) return;
  u.final = true;
  if (u.decoder && u.cancelled) u.decoder.close();
}

// ------------------------------------------------------------------------------------------------ worklet reports

player.onmessage = (m) => {
  const u = m.ctx !== undefined ? state.byContext.get(m.ctx) : undefined;
  const t = u ? now() - u.t0 : 0;
  switch (m.type) {
    case "stats":
      state.audio = m;
      state.statsAt = now();
      for (const [key, played, queued, st] of m.ctxs) {
        const v = state.byContext.get(key);
        if (v && !v.cancelled) {
          v.played = played;
          v.queued = queued;
          v.playState = st;
        }
      }
      break;
    case "started":
      if (!u) break;
      u.playStart = t;
      u.firstPlayed = t;
      u.playState = "playing";
      ack(u);
      break;
    case "underrun":
      if (!u) break;
      u.underruns.push([t, undefined]);
      u.playState = "underrun";
      ack(u);
      break;
    case "resumed":
      if (!u) break;
      if (u.underruns.length) u.underruns[u.underruns.length - 1][1] = t;
      u.playState = "playing";
      break;
    case "finished":
      if (!u) break;
      u.played = m.played;
      u.queued = 0;
      u.playEnd = t;
      u.playState = "finished";
      ack(u);
      if (u.done) finishUtterance(u);
      break;
    case "cleared":
      if (!u) break;
      u.clearedPlayed = m.played; // what this context had played when its audio was dropped
      u.outputAtClear = m.output; // the worklet's total output at that moment
      u.played = m.played;
      u.queued = 0;
      u.playEnd = u.playEnd ?? t;
      break;
  }
};

function ack(u) {
  if (u.ackDone || u.cancelled || u.streamId === null || !state.session) return;
  const st = u.playState === "finished" ? "finished" : u.playState === "underrun" ? "underrun"
    : u.playState === "playing" ? "playing" : "buffering";
  const ok = send({
    type: "playback",
    context_id: u.contextId,
    played_ms: Math.round(ms(u.played, player.rate) * 10) / 10,
    state: st,
    buffered_ms: Math.round(ms(u.queued, player.rate) * 10) / 10,
  }, true);
  if (!ok) return;
  u.acks++;
  state.counters.acks++;
  if (st === "finished") u.ackDone = true;
}

setInterval(() => {
  for (const u of state.utterances) if (!u.ackDone && !u.cancelled && u.status !== "error") ack(u);
}, ACK_INTERVAL_MS);

// ------------------------------------------------------------------------------------------------ barge-in

/** Samples of `u` played by now: the worklet's last report (at most ~25 ms old) plus the time since, if playing. */
function playedNow(u) {
  if (u.playState !== "playing" || state.statsAt === undefined) return u.played;
  const since = Math.round(((now() - state.statsAt) / 1000) * player.rate);
  return u.played + Math.max(0, Math.min(u.queued, since));
}

function bargeIn(source = "button") {
  const t = now();
  const llmActive = !!state.llm;
  stopLlm();
  player.clear(); // the worklet drops every queued sample; the next render quantum is silent
  let n = 0;
  for (const u of state.utterances) {
    if (u.final || u.cancelled) continue;
    const serverActive = !u.done && !u.serverCancelled && u.status !== "error";
    if (!serverActive && u.playState === "finished") continue;
    u.cancelled = true;
    u.cancelAt = t - u.t0;
    u.cancelSource = source;
    if (u.decoder) u.decoder.close();
    if (serverActive) {
      send({ type: "context.cancel", context_id: u.contextId,
             played_ms: Math.round(ms(playedNow(u), player.rate) * 10) / 10 });
      u.cancelSent = true;
      u.status = "cancelling";
    } else {
      u.status = "interrupted"; // the server had finished; only local playback is cut
      finishUtterance(u);
    }
    n++;
  }
  if (n) log("info", `barge-in (${source}): ${n} context(s) cancelled`);
  const progress = $("llm-progress");
  if (llmActive) {
    const cut = document.createElement("span");
    cut.className = "cut";
    cut.textContent = " ✕ interrupted";
    progress.appendChild(cut);
  }
  const btn = $("barge");
  btn.classList.add("flash");
  setTimeout(() => btn.classList.remove("flash"), 250);
  return n;
}

// ------------------------------------------------------------------------------------------------ simulated LLM

function startLlm() {
  if (state.llm) {
    bargeIn("stop"); // stopping the stream mid-sentence is an interruption: cancel its context
    return;
  }
  const text = $("llm-text").value;
  const tokens = text.match(/\s*\S+/g) || [];
  if (!tokens.length) return;
  const u = newUtterance("llm");
  if (!u) return;
  state.llm = { u, tokens, i: 0, timer: null };
  $("llm-start").textContent = "Stop stream";
  $("llm-progress").replaceChildren();
  const step = () => {
    const l = state.llm;
    if (!l || l.u !== u) return;
    if (l.i >= l.tokens.length) {
      send({ type: "flush", context_id: u.contextId });
      send({ type: "context.close", context_id: u.contextId });
      endLlm();
      return;
    }
    const tok = l.tokens[l.i++];
    sendText(u, tok);
    const span = document.createElement("span");
    span.textContent = tok;
    $("llm-progress").appendChild(span);
    l.timer = setTimeout(step, 1000 / Number($("rate").value));
  };
  step();
  return u.contextId;
}

function endLlm() {
  if (state.llm && state.llm.timer) clearTimeout(state.llm.timer);
  state.llm = null;
  $("llm-start").textContent = "Start stream";
}

function stopLlm() {
  endLlm(); // the timer only: whoever stops the stream also decides what happens to its context
}

// ------------------------------------------------------------------------------------------------ readouts

function render() {
  const last = [...state.utterances].reverse().find((u) => u.firstPacket !== undefined);
  $("ttfa").textContent = fmtMs(last && last.firstPlayed);
  $("ttfa-sub").textContent = last
    ? `played · 1st packet ${fmtMs(last.firstPacket)} · server ${fmtMs(last.done && last.done.ttfa_ms)}`
    : "played · 1st packet – · server –";
  const rate = player.rate;
  const bufMs = ms(state.audio.buffered || 0, rate);
  $("buffer").textContent = fmtMs(bufMs);
  $("buffer-bar").style.width = `${Math.min(100, bufMs / 10)}%`;
  $("buffer-sub").textContent = `target ${$("prebuffer").value} ms · `
    + `${player.ac ? `${player.ac.sampleRate / 1000} kHz ${player.ac.state}` : "audio off"}`;
  $("underruns").textContent = `${state.audio.underruns || 0}`;
  $("underruns").dataset.bad = state.audio.underruns ? "1" : "";
  const cur = state.utterances[state.utterances.length - 1];
  $("underruns-sub").textContent = `last utterance ${cur ? cur.underruns.length : 0}`;
  $("packets").textContent = `${state.counters.packets}`;
  $("packets-sub").textContent = `${(state.counters.bytes / 1024).toFixed(1)} KiB · late dropped ${state.counters.late}`
    + ` · acks ${state.counters.acks}`;
  $("played").textContent = (ms(state.audio.output || 0, rate) / 1000).toFixed(1);
  $("played-sub").textContent = state.codec === "opus" ? "WebCodecs Opus" : state.codec === "pcm" ? "PCM (no WebCodecs)"
    : "decoder –";
  renderTable();
  drawTimeline($("timeline"), state.utterances.map(timelineRow), now());
}

function timelineRow(u) {
  return { n: u.n, kind: u.kind, t0: u.t0, text: u.text, packets: u.packets, underruns: u.underruns,
           playStart: u.playStart, playEnd: u.playEnd, cancelAt: u.cancelAt, doneAt: u.doneAt,
           firstPlayed: u.firstPlayed, final: u.final };
}

function renderTable() {
  const body = $("utterances");
  const rows = state.utterances.slice(-8).reverse();
  const sig = JSON.stringify(rows.map((u) => [u.n, u.status, u.firstPlayed, u.played, u.decoded, u.packets.length,
    u.lateDropped, !!u.done, u.underruns.length, u.error]));
  if (body.dataset.sig === sig) return;
  body.dataset.sig = sig;
  body.replaceChildren();
  for (const u of rows) {
    const tr = document.createElement("tr");
    const cells = [
      `#${u.n}`,
      u.kind,
      u.preview.trim().slice(0, 40) + (u.chars > 40 ? "…" : ""),
      `${fmtMs(u.firstPacket)} / ${fmtMs(u.firstPlayed)} / ${fmtMs(u.done && u.done.ttfa_ms)}`,
      `${fmtMs(u.done && u.done.audio_ms)} / ${fmtMs(ms(u.decoded, u.sourceRate))}`,
      fmtMs(ms(u.played, player.rate)),
      `${u.packets.length}${u.lateDropped ? ` (+${u.lateDropped} late)` : ""}`,
      `${u.underruns.length}`,
      u.error && u.status === "error" ? u.error.slice(0, 120) : u.status,
    ];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 8) td.className = `st-${u.status}`;
      if (i === 8 && u.error) td.title = u.error;
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

setInterval(render, 100);

// ------------------------------------------------------------------------------------------------ wiring

function isEditable(el) {
  return el && (el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName));
}

function init() {
  $("url").value = defaultServerUrl();
  if (params.get("key")) $("key").value = params.get("key");
  if (params.get("format")) $("format").value = params.get("format");
  if (params.get("rate")) $("rate").value = params.get("rate");
  $("rate-value").textContent = $("rate").value;
  $("prebuffer-value").textContent = $("prebuffer").value;
  $("conn-form").addEventListener("submit", (e) => {
    e.preventDefault();
    connect();
  });
  $("speak").addEventListener("click", speak);
  $("llm-start").addEventListener("click", startLlm);
  $("barge").addEventListener("click", () => bargeIn("button"));
  $("voice").addEventListener("change", () => fillLanguages());
  $("rate").addEventListener("input", () => ($("rate-value").textContent = $("rate").value));
  $("prebuffer").addEventListener("input", () => {
    $("prebuffer-value").textContent = $("prebuffer").value;
    player.setPrebuffer(Number($("prebuffer").value));
  });
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) speak();
  });
  // Space barges in (outside text fields, where it types a space); Escape barges in everywhere.
  document.addEventListener("keydown", (e) => {
    const space = e.code === "Space" && !isEditable(e.target);
    if (space || e.key === "Escape") {
      e.preventDefault();
      if (!e.repeat) bargeIn(space ? "space" : "escape");
    }
  }, true);
  document.addEventListener("keyup", (e) => {
    if (e.code === "Space" && !isEditable(e.target)) e.preventDefault(); // no click on a focused button
  }, true);
  for (const b of document.querySelectorAll("button")) b.addEventListener("click", () => b.blur());
  render();
  if (params.get("autoconnect") === "1") connect();
}

init();

// For tests and the curious: the page's state, JSON-friendly.
window.voicelane = {
  connect,
  speak,
  startLlm,
  bargeIn,
  snapshot() {
    const rate = player.rate;
    return {
      connected: !!(state.session && state.session.open),
      session: state.created && { session_id: state.created.session_id, model: state.created.model },
      codec: state.codec,
      audio: {
        rate,
        state: player.ac && player.ac.state,
        output_ms: ms(state.audio.output || 0, rate),
        buffered_ms: ms(state.audio.buffered || 0, rate),
        underruns: state.audio.underruns || 0,
        dropped_pushes: state.audio.droppedPushes || 0,
      },
      counters: { ...state.counters },
      llm_active: !!state.llm,
      utterances: state.utterances.map((u) => ({
        n: u.n,
        kind: u.kind,
        context_id: u.contextId,
        stream_id: u.streamId,
        status: u.status,
        final: u.final,
        chars: u.chars,
        texts: u.text.length,
        pre_skip: u.preSkip,
        source_rate: u.sourceRate,
        decoded_samples: u.decoded,
        decoded_ms: ms(u.decoded, u.sourceRate),
        played_ms: ms(u.played, rate),
        packets: u.packets.length,
        bytes: u.bytes,
        first_packet_ms: u.firstPacket,
        first_played_ms: u.firstPlayed,
        play_end_ms: u.playEnd,
        cancel_at_ms: u.cancelAt,
        cancel_sent: !!u.cancelSent,
        late_dropped: u.lateDropped,
        cleared_played_ms: u.clearedPlayed === undefined ? null : ms(u.clearedPlayed, rate),
        output_at_clear_ms: u.outputAtClear === undefined ? null : ms(u.outputAtClear, rate),
        acks: u.acks,
        underruns: u.underruns.length,
        done: u.done || null,
        cancelled: u.serverCancelled || null,
        error: u.error || null,
      })),
    };
  },
};
