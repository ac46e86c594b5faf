// voicelane demo: the jitter buffer, an AudioWorkletProcessor.
//
// The page posts decoded mono Float32 samples (already at the AudioContext's rate), tagged with a context key.
// Contexts play one after another, in the order they were opened; each has its own queue. The head context
// starts (and restarts after an underrun) once `prebuffer` samples of it are queued or its last sample has
// arrived. The processor counts what it really outputs, per context and in total, and reports back every
// ~25 ms and on every event.
//
// In:  {type:"open", ctx} {type:"push", ctx, samples} {type:"end", ctx} {type:"clear", ctx?} {type:"config", prebuffer}
// Out: {type:"stats", ...} and {type:"started"|"underrun"|"resumed"|"finished"|"cleared", ctx, frame, ...}

class JitterBuffer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.prebuffer = o.prebuffer ?? Math.round(sampleRate * 0.06);
    this.reportEvery = o.reportEvery ?? Math.round(sampleRate * 0.025);
    this.order = []; // context keys, play order
    this.ctxs = new Map(); // key -> {chunks: [{data, off}], played, queued, ended, started, state}
    this.cleared = new Set(); // contexts whose audio was cleared: their later pushes are dropped
    this.playing = false; // the head context is playing (not buffering)
    this.underruns = 0;
    this.output = 0; // real (non-silence) samples output since start
    this.droppedPushes = 0; // pushes for cleared contexts
    this.sinceReport = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  open(key) {
    let c = this.ctxs.get(key);
    if (!c) {
      c = { chunks: [], played: 0, queued: 0, ended: false, started: false, state: "buffering" };
      this.ctxs.set(key, c);
      this.order.push(key);
    }
    return c;
  }

  get buffered() {
    let n = 0;
    for (const c of this.ctxs.values()) n += c.queued;
    return n;
  }

  onMessage(m) {
    if ((m.type === "open" || m.type === "push" || m.type === "end") && this.cleared.has(m.ctx)) {
      if (m.type === "push") this.droppedPushes++;
      return;
    }
    switch (m.type) {
      case "open":
        this.open(m.ctx);
        break;
      case "push": {
        if (!m.samples.length) return;
        const c = this.open(m.ctx);
        c.chunks.push({ data: m.samples, off: 0 });
        c.queued += m.samples.length;
        break;
      }
      case "end": {
        const c = this.open(m.ctx);
        c.ended = true;
        break;
      }
      case "clear": {
        // Barge-in: drop the queued audio now; the next render quantum is already silent for these contexts.
        const keys = m.ctx === undefined ? [...this.order] : [m.ctx];
        for (const key of keys) {
          this.cleared.add(key);
          const c = this.ctxs.get(key);
          if (!c) continue;
          this.port.postMessage({ type: "cleared", ctx: key, played: c.played, dropped: c.queued,
                                  output: this.output, frame: currentFrame });
          this.ctxs.delete(key);
        }
        const head = this.order[0];
        this.order = this.order.filter((k) => this.ctxs.has(k));
        if (this.order[0] !== head) this.playing = false;
        this.report();
        break;
      }
      case "config":
        if (typeof m.prebuffer === "number") this.prebuffer = Math.max(0, Math.round(m.prebuffer));
        break;
    }
  }

  process(inputs, outputs) {
    const outs = outputs[0];
    const out = outs[0];
    const n = out.length;
    let i = 0;
    while (i < n && this.order.length) {
      const key = this.order[0];
      const c = this.ctxs.get(key);
      if (!this.playing) {
        if (c.queued > 0 && (c.queued >= this.prebuffer || c.ended)) {
          this.playing = true;
          if (!c.started) {
            c.started = true;
            this.port.postMessage({ type: "started", ctx: key, frame: currentFrame + i });
          } else if (c.state === "underrun") {
            this.port.postMessage({ type: "resumed", ctx: key, frame: currentFrame + i });
          }
          c.state = "playing";
        } else if (c.queued === 0 && c.ended) {
          this.finish(key, c, i); // nothing (more) to play: next context
          continue;
        } else {
          break; // buffering
        }
      }
      while (i < n && c.chunks.length) {
        const q = c.chunks[0];
        const take = Math.min(n - i, q.data.length - q.off);
        out.set(q.data.subarray(q.off, q.off + take), i);
        i += take;
        q.off += take;
        c.played += take;
        c.queued -= take;
        this.output += take;
        if (q.off >= q.data.length) c.chunks.shift();
      }
      if (c.queued === 0) {
        if (c.ended) {
          this.finish(key, c, i);
        } else if (i < n) {
          // Ran dry while the context still expects audio: an underrun. Rebuffer before playing on.
          this.playing = false;
          this.underruns++;
          c.state = "underrun";
          this.port.postMessage({ type: "underrun", ctx: key, frame: currentFrame + i, underruns: this.underruns });
          break;
        }
      }
    }
    out.fill(0, i);
    for (let ch = 1; ch < outs.length; ch++) outs[ch].set(out);
    this.sinceReport += n;
    if (this.sinceReport >= this.reportEvery) this.report();
    return true;
  }

  finish(key, c, i) {
    c.state = "finished";
    this.port.postMessage({ type: "finished", ctx: key, played: c.played, frame: currentFrame + i });
    this.ctxs.delete(key);
    this.order.shift();
    this.playing = false;
  }

  report() {
    this.sinceReport = 0;
    const ctxs = [];
    for (const key of this.order) {
      const c = this.ctxs.get(key);
      ctxs.push([key, c.played, c.queued, c.state]);
    }
    this.port.postMessage({ type: "stats", frame: currentFrame, buffered: this.buffered, underruns: this.underruns,
                            output: this.output, droppedPushes: this.droppedPushes, ctxs });
  }
}

registerProcessor("voicelane-jitter", JitterBuffer);
