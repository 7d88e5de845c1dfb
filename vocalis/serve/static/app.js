// Vocalis web page: stream 16-bit PCM from /v1/audio/speech into Web Audio as it arrives.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { controller: null, sampleRate: 24000 };
// Exposed for tests and curious users: numbers of the last synthesis.
window.vocalisStats = { status: "idle", firstChunkMs: null, rtf: null, audioSeconds: 0, chunks: 0, bytes: 0 };

function headers(extra = {}) {
  const key = $("api-key").value.trim();
  localStorage.setItem("vocalis-api-key", key);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "muted";
  window.vocalisStats.status = text;
}

async function loadHealth() {
  const r = await fetch("health");
  if (r.ok) {
    const h = await r.json();
    state.sampleRate = h.sample_rate;
    $("model").textContent = h.model;
  }
}

async function loadVoices(select) {
  const r = await fetch("v1/audio/voices", { headers: headers() });
  if (!r.ok) { setStatus(`voices: ${await errorText(r)}`, true); return; }
  const body = await r.json();
  const list = $("voice");
  list.innerHTML = "";
  for (const v of body.data) {
    const opt = new Option(`${v.name} (${v.kind}, ${v.modes.join("/")})`, v.name);
    list.add(opt);
  }
  for (const [alias, target] of Object.entries(body.aliases || {})) {
    list.add(new Option(`${alias} → ${target}`, alias));
  }
  if (select) list.value = select;
  window.vocalisStats.voices = body.data.map((v) => v.name);
}

function wavBlob(chunks, sampleRate) {
  const n = chunks.reduce((a, c) => a + c.length, 0);
  const buf = new ArrayBuffer(44 + 2 * n);
  const dv = new DataView(buf);
  const str = (o, s) => [...s].forEach((ch, i) => dv.setUint8(o + i, ch.charCodeAt(0)));
  str(0, "RIFF"); dv.setUint32(4, 36 + 2 * n, true); str(8, "WAVE"); str(12, "fmt ");
  dv.setUint32(16, 16, true); dv.setUint16(20, 1, true); dv.setUint16(22, 1, true);
  dv.setUint32(24, sampleRate, true); dv.setUint32(28, 2 * sampleRate, true);
  dv.setUint16(32, 2, true); dv.setUint16(34, 16, true); str(36, "data"); dv.setUint32(40, 2 * n, true);
  let o = 44;
  for (const c of chunks) for (let i = 0; i < c.length; i++, o += 2) dv.setInt16(o, c[i], true);
  return new Blob([buf], { type: "audio/wav" });
}

async function speak() {
  const stats = window.vocalisStats;
  Object.assign(stats, { firstChunkMs: null, rtf: null, audioSeconds: 0, chunks: 0, bytes: 0, error: null,
                        playedSeconds: 0, audioContext: false });
  ["first-chunk", "rtf", "audio-seconds", "chunks"].forEach((id) => { $(id).textContent = "–"; });
  const body = {
    model: "vocalis", input: $("text").value, voice: $("voice").value || undefined,
    response_format: "pcm", speed: parseFloat($("speed").value) || 1.0,
  };
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  if ($("instructions").value.trim()) body.instructions = $("instructions").value.trim();

  let ctx = null;
  try {
    ctx = new AudioContext({ sampleRate: state.sampleRate });
    await ctx.resume();
  } catch (e) {
    ctx = null;  // no audio output (e.g. a server without sound): still receive and measure
  }
  stats.audioContext = ctx !== null;
  state.controller = new AbortController();
  $("speak").disabled = true; $("stop").disabled = false;
  setStatus("waiting for the first chunk…");
  const t0 = performance.now();
  let playAt = 0;
  let carry = null;  // a byte left over from an odd-length network chunk
  const pieces = [];
  try {
    const r = await fetch("v1/audio/speech", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (stats.firstChunkMs === null) {
        stats.firstChunkMs = performance.now() - t0;
        $("first-chunk").textContent = stats.firstChunkMs.toFixed(0);
        setStatus("playing…");
      }
      let bytes = value;
      if (carry !== null) { bytes = new Uint8Array(value.length + 1); bytes[0] = carry; bytes.set(value, 1); carry = null; }
      if (bytes.length % 2) { carry = bytes[bytes.length - 1]; bytes = bytes.subarray(0, bytes.length - 1); }
      const pcm = new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
      pieces.push(pcm);
      stats.bytes += value.length; stats.chunks += 1;
      stats.audioSeconds += pcm.length / state.sampleRate;
      $("chunks").textContent = stats.chunks;
      $("audio-seconds").textContent = stats.audioSeconds.toFixed(2);
      if (ctx && pcm.length) {
        const buf = ctx.createBuffer(1, pcm.length, state.sampleRate);
        const ch = buf.getChannelData(0);
        for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
        const src = ctx.createBufferSource();
        src.buffer = buf; src.connect(ctx.destination);
        playAt = Math.max(playAt, ctx.currentTime + 0.05);
        src.start(playAt);
        playAt += buf.duration;
        stats.playedSeconds += buf.duration;
      }
    }
    const wall = (performance.now() - t0) / 1000;
    stats.rtf = stats.audioSeconds > 0 ? wall / stats.audioSeconds : null;
    $("rtf").textContent = stats.rtf === null ? "–" : stats.rtf.toFixed(3);
    $("player").src = URL.createObjectURL(wavBlob(pieces, state.sampleRate));
    setStatus("done");
  } catch (e) {
    stats.error = String(e.message || e);
    setStatus(e.name === "AbortError" ? "stopped" : `error: ${stats.error}`, e.name !== "AbortError");
  } finally {
    $("speak").disabled = false; $("stop").disabled = true;
    state.controller = null;
  }
}

async function createVoice() {
  const name = $("voice-name").value.trim();
  const file = $("voice-file").files[0];
  const status = $("voice-status");
  if (!name || !file) { status.textContent = "a name and a clip are needed"; status.className = "error"; return; }
  const form = new FormData();
  form.append("name", name);
  form.append("text", $("voice-text").value);
  form.append("audio", file);
  status.textContent = "computing the voice…"; status.className = "muted";
  const r = await fetch("v1/audio/voices", { method: "POST", headers: headers(), body: form });
  if (!r.ok) { status.textContent = await errorText(r); status.className = "error"; return; }
  status.textContent = `saved ${name}`;
  await loadVoices(name);
}

$("api-key").value = localStorage.getItem("vocalis-api-key") || "";
$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("create-voice").addEventListener("click", createVoice);
$("api-key").addEventListener("change", () => loadVoices());
loadHealth().then(() => loadVoices()).then(() => { document.body.dataset.ready = "1"; });
