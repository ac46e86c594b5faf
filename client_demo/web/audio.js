// voicelane demo: audio output (AudioContext + jitter-buffer worklet) and per-context decoders.

/** Streaming linear resampler (mono). Exact pass-through when the rates match. */
export class Resampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    this.same = inRate === outRate;
    this.pos = 0; // position of the next output sample, relative to `prev` (index -1 of the next block)
    this.prev = 0;
    this.primed = false;
  }

  process(x) {
    if (this.same || x.length === 0) return x;
    // Work on [prev, ...x]: index 0 is the last sample of the previous block.
    let pos = this.pos;
    if (!this.primed) {
      this.primed = true;
      this.prev = x[0];
      pos = 0;
    }
    const len = x.length + 1;
    const at = (k) => (k === 0 ? this.prev : x[k - 1]);
    const out = new Float32Array(Math.max(0, Math.ceil((len - 1 - pos) / this.step)));
    let o = 0;
    while (pos < len - 1 && o < out.length) {
      const k = Math.floor(pos);
      const f = pos - k;
      out[o++] = at(k) + (at(k + 1) - at(k)) * f;
      pos += this.step;
    }
    this.pos = pos - (len - 1);
    this.prev = x[x.length - 1];
    return o === out.length ? out : out.subarray(0, o);
  }
}

/** The page's speaker: one AudioContext, one jitter-buffer worklet. */
export class Player {
  constructor() {
    this.ac = null;
    this.node = null;
    this.onmessage = () => {};
  }

  get rate() {
    return this.ac ? this.ac.sampleRate : 48000;
  }

  async start(prebufferMs) {
    if (this.ac) {
      if (this.ac.state !== "running") await this.ac.resume();
      return;
    }
    let ac;
    try {
      ac = new AudioContext({ sampleRate: 48000, latencyHint: "interactive" });
    } catch {
      ac = new AudioContext({ latencyHint: "interactive" }); // the browser's rate: we resample
    }
    await ac.audioWorklet.addModule(new URL("./worklet.js", import.meta.url));
    const node = new AudioWorkletNode(ac, "voicelane-jitter", {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { prebuffer: Math.round((ac.sampleRate * prebufferMs) / 1000) },
    });
    node.port.onmessage = (e) => this.onmessage(e.data);
    node.connect(ac.destination);
    this.ac = ac;
    this.node = node;
    if (ac.state !== "running") await ac.resume();
  }

  setPrebuffer(ms) {
    if (this.node) this.node.port.postMessage({ type: "config", prebuffer: (this.rate * ms) / 1000 });
  }

  open(key) {
    this.node.port.postMessage({ type: "open", ctx: key });
  }

  push(key, samples) {
    if (samples.length) this.node.port.postMessage({ type: "push", ctx: key, samples }, [samples.buffer]);
  }

  end(key) {
    this.node.port.postMessage({ type: "end", ctx: key });
  }

  clear(key) {
    if (this.node) this.node.port.postMessage(key === undefined ? { type: "clear" } : { type: "clear", ctx: key });
  }
}

export const hasWebCodecsOpus = async () => {
  if (typeof AudioDecoder === "undefined" || typeof EncodedAudioChunk === "undefined") return false;
  try {
    const r = await AudioDecoder.isConfigSupported({ codec: "opus", sampleRate: 48000, numberOfChannels: 1 });
    return !!r.supported;
  } catch {
    return false;
  }
};

/**
 * One context's raw Opus stream through WebCodecs. Output: Float32 at 48 kHz, the first `preSkip` samples
 * dropped (RFC 7845 pre-skip; the server tells it in context.created.opus.pre_skip).
 */
export class OpusStream {
  constructor(preSkip, onPcm, onError) {
    this.rate = 48000;
    this.skip = preSkip;
    this.closed = false;
    this.decoded = 0; // samples handed on (after pre-skip)
    this.onPcm = onPcm;
    this.dec = new AudioDecoder({
      output: (ad) => this.output(ad),
      error: (e) => {
        if (!this.closed) onError(e);
      },
    });
    this.dec.configure({ codec: "opus", sampleRate: 48000, numberOfChannels: 1 });
  }

  decode(payload, startSample) {
    if (this.closed || payload.length === 0) return;
    this.dec.decode(new EncodedAudioChunk({
      type: "key",
      timestamp: Math.round((startSample * 1e6) / 48000),
      duration: 20000,
      data: payload,
    }));
  }

  output(ad) {
    try {
      if (this.closed) return;
      const n = ad.numberOfFrames;
      let pcm = new Float32Array(n);
      try {
        ad.copyTo(pcm, { planeIndex: 0, format: "f32-planar" });
      } catch {
        // Older engines without format conversion: take the decoder's own format.
        if (ad.format && ad.format.startsWith("s16")) {
          const s = new Int16Array(n * (ad.format === "s16" ? ad.numberOfChannels : 1));
          ad.copyTo(s, { planeIndex: 0 });
          const step = ad.format === "s16" ? ad.numberOfChannels : 1;
          for (let i = 0; i < n; i++) pcm[i] = s[i * step] / 32768;
        } else {
          ad.copyTo(pcm, { planeIndex: 0 });
        }
      }
      if (this.skip > 0) {
        const k = Math.min(this.skip, pcm.length);
        this.skip -= k;
        pcm = pcm.subarray(k);
        if (pcm.length === 0) return;
        pcm = pcm.slice(); // own buffer (it is transferred to the worklet)
      }
      this.decoded += pcm.length;
      this.onPcm(pcm);
    } finally {
      ad.close();
    }
  }

  /** All packets given: resolves once every output has been delivered. */
  async end() {
    if (this.closed) return;
    await this.dec.flush();
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    try {
      this.dec.close();
    } catch {
      /* already closed */
    }
  }
}

/** PCM fallback (no WebCodecs): s16le or f32le samples straight from the payload. */
export class PcmStream {
  constructor(encoding, rate, onPcm) {
    this.rate = rate;
    this.f32 = encoding === "pcm_f32le";
    this.closed = false;
    this.decoded = 0;
    this.onPcm = onPcm;
  }

  decode(payload) {
    if (this.closed || payload.length === 0) return;
    const dv = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
    const n = Math.floor(payload.byteLength / (this.f32 ? 4 : 2));
    const pcm = new Float32Array(n);
    if (this.f32) for (let i = 0; i < n; i++) pcm[i] = dv.getFloat32(i * 4, true);
    else for (let i = 0; i < n; i++) pcm[i] = dv.getInt16(i * 2, true) / 32768;
    this.decoded += n;
    this.onPcm(pcm);
  }

  async end() {}

  close() {
    this.closed = true;
  }
}
