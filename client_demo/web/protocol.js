// voicelane demo: the WebSocket protocol (docs/protocol.md): JSON messages and binary audio frames.

export const FLAG_FIRST = 1;
export const FLAG_LAST = 2;
export const FLAG_SEGMENT_START = 4;

/** The 16-byte big-endian header of a binary audio frame, and its payload (a view, no copy). */
export function parseFrame(buf) {
  if (buf.byteLength < 16) throw new Error(`audio frame shorter than its header: ${buf.byteLength} bytes`);
  const dv = new DataView(buf);
  const version = dv.getUint8(0);
  const kind = dv.getUint8(1);
  if (version !== 1 || kind !== 1) throw new Error(`unknown audio frame version ${version} kind ${kind}`);
  const flags = dv.getUint16(2);
  return {
    flags,
    first: !!(flags & FLAG_FIRST),
    last: !!(flags & FLAG_LAST),
    segmentStart: !!(flags & FLAG_SEGMENT_START),
    streamId: dv.getUint32(4),
    seq: dv.getUint32(8),
    startSample: dv.getUint32(12),
    payload: new Uint8Array(buf, 16),
  };
}

/** The gateway URL of a page served by voicelane (same origin), or the one given as ?server=. */
export function defaultServerUrl(loc = window.location) {
  const q = new URLSearchParams(loc.search).get("server");
  if (q) return normaliseUrl(q);
  const scheme = loc.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${loc.host}/v1/tts/ws`;
}

/** Accepts ws(s)://, http(s):// or host:port; a bare origin gets the gateway path. */
export function normaliseUrl(s) {
  s = s.trim();
  if (!/^[a-z]+:\/\//i.test(s)) s = `ws://${s}`;
  const u = new URL(s.replace(/^http/i, "ws"));
  if (u.pathname === "/" || u.pathname === "") u.pathname = "/v1/tts/ws";
  return u.toString();
}

/**
 * One session. Browsers cannot set headers, so a key travels as the subprotocol `bearer.<key>` (beside
 * `voicelane.v1`), or, if the handshake with subprotocols fails, as `?token=<key>`.
 */
export class Session {
  constructor({ onJson, onAudio, onClose }) {
    this.ws = null;
    this.onJson = onJson;
    this.onAudio = onAudio;
    this.onClose = onClose;
    this.created = null;
    this.sent = 0;
    this.bytesIn = 0;
  }

  connect(url, key, authMode = "subprotocol") {
    return new Promise((resolve, reject) => {
      let target = url;
      let protocols;
      if (key && authMode === "token") {
        const u = new URL(url);
        u.searchParams.set("token", key);
        target = u.toString();
      } else if (key) {
        protocols = ["voicelane.v1", `bearer.${key}`];
      }
      let ws;
      try {
        ws = protocols ? new WebSocket(target, protocols) : new WebSocket(target);
      } catch (e) {
        reject(e);
        return;
      }
      ws.binaryType = "arraybuffer";
      this.ws = ws;
      let opened = false;
      let settled = false;
      ws.onopen = () => {
        opened = true;
      };
      ws.onmessage = (e) => {
        if (typeof e.data === "string") {
          let msg;
          try {
            msg = JSON.parse(e.data);
          } catch {
            return;
          }
          if (msg.type === "session.created" && !settled) {
            settled = true;
            this.created = msg;
            resolve(msg);
          }
          if (msg.type === "error" && msg.fatal && !settled) {
            settled = true;
            reject(Object.assign(new Error(`${msg.code}: ${msg.message}`), { code: msg.code }));
          }
          this.onJson(msg);
        } else {
          this.bytesIn += e.data.byteLength;
          this.onAudio(e.data);
        }
      };
      ws.onclose = (e) => {
        if (this.ws === ws) this.ws = null;
        if (!settled) {
          // Never became a session (handshake refused, or closed before session.created): only the caller knows.
          settled = true;
          reject(Object.assign(new Error(`socket closed (${e.code}${e.reason ? ` ${e.reason}` : ""})`),
                               { closeCode: e.code, opened }));
          return;
        }
        this.onClose(e);
      };
    });
  }

  get open() {
    return !!this.ws && this.ws.readyState === WebSocket.OPEN;
  }

  send(msg) {
    if (!this.open) return false;
    this.ws.send(JSON.stringify(msg));
    this.sent++;
    return true;
  }

  close() {
    if (!this.ws) return;
    this.send({ type: "session.close" });
    const ws = this.ws;
    setTimeout(() => {
      if (ws.readyState <= WebSocket.OPEN) ws.close(1000);
    }, 300);
  }
}
