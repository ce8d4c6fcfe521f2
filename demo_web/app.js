"use strict";
// The duplex browser demo: talk to the service over WebRTC (audio both ways, events on a
// data channel). Everything the page knows is kept in window.duplexDemo, for tests and
// the curious. No build step, no dependencies: it runs from `duplex serve` as is.
//
// URL options: ?autostart=1 connects at load; ?token=... for a server with auth;
// ?processing=0 turns the browser's noise suppression and gain control off (echo
// cancellation stays on); ?record=1 keeps the received audio (await duplexDemo.recording():
// a WebM/Opus file, base64).
//
// The page has a tool of its own, get_time, which the assistant may call (ask it the
// time): the call and its result show in the conversation, the result goes back on the
// data channel, and the reply that uses it is asked for once the calling reply is done.

const params = new URLSearchParams(location.search);
const token = params.get("token");
const auth = token ? { Authorization: `Bearer ${token}` } : {};
const $ = (id) => document.getElementById(id);

const demo = (window.duplexDemo = {
  state: "idle", // idle | listening | thinking | speaking
  connected: false,
  sessionId: null,
  transcripts: [], // {itemId, text, final}
  assistantTurns: [], // {responseId, itemId, text, heard, status}
  latencies: [], // duplex.turn.metrics events
  audioReceivedMs: 0, // received audio louder than -40 dBFS
  errors: [],
  micHelp: null, // what the page tells the user when the browser hides the microphone
  events: [], // the last 500 events, as received
  recording: null, // with ?record=1: async () => {mimeType, data: base64 WebM/Opus}
  stats: null, // async () => the received audio's WebRTC statistics (jitter buffer, concealment)
  toolCalls: [], // {callId, name, arguments, output}: the page's tool, called by the assistant
  send: (message) => channel && channel.readyState === "open" && channel.send(JSON.stringify(message)),
});

// The page's own tool: the assistant asks, the page answers.
const TOOLS = [{
  type: "function",
  name: "get_time",
  description: "The current local time where the user is.",
  parameters: { type: "object", properties: {} },
}];
const runTool = {
  get_time: () => ({ time: new Date().toLocaleTimeString([], { hour: "numeric", minute: "2-digit" }) }),
};
let answerAfter = null; // the response whose calls have their results: respond when it is done

let pc = null;
let channel = null;
let mic = null;
let audioContext = null;
let meters = null;
const items = new Map(); // conversation item id -> <li>

// -- service health --

async function waitUntilReady() {
  for (;;) {
    let body = { status: "unreachable" };
    try {
      body = await (await fetch("/healthz", { cache: "no-store" })).json();
    } catch (err) { /* not up yet */ }
    if ($("service").textContent !== `service ${body.status}`) { // a live region: announce changes only
      $("service").textContent = `service ${body.status}`;
      $("service").className = `badge ${body.status}`;
    }
    if (body.status === "ready") return;
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

// -- connecting --

async function start() {
  showError(null);
  $("talk").disabled = true;
  try {
    const processing = params.get("processing") !== "0";
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: processing, autoGainControl: processing },
    });
    const ice = await (await fetch("/webrtc/ice", { headers: auth })).json();
    pc = new RTCPeerConnection({ iceServers: ice.iceServers || [] });
    for (const track of mic.getAudioTracks()) pc.addTrack(track, mic);
    channel = pc.createDataChannel("events");
    channel.onopen = () => {
      demo.connected = true;
      setState("listening");
      demo.send({ type: "tools", tools: TOOLS, tool_choice: params.get("tool_choice") || "auto" });
    };
    channel.onmessage = (message) => onEvent(JSON.parse(message.data));
    channel.onclose = () => stop("the session ended");
    pc.ontrack = (event) => {
      const stream = event.streams[0] || new MediaStream([event.track]);
      $("speaker").srcObject = stream; // Chrome plays (and analyses) a remote stream only via an element
      listen(mic, stream);
    };
    pc.onconnectionstatechange = () => {
      if (pc && ["failed", "closed"].includes(pc.connectionState)) stop(`connection ${pc.connectionState}`);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc, 3000);
    const response = await fetch("/webrtc/offer", {
      method: "POST",
      headers: { ...auth, "Content-Type": "application/json" },
      body: JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp }),
    });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? `${body.error.code}: ${body.error.message}` : response.statusText);
    demo.sessionId = body.session_id;
    demo.stats = async () => {
      const report = await pc.getStats();
      return [...report.values()].find((s) => s.type === "inbound-rtp" && s.kind === "audio") || null;
    };
    await pc.setRemoteDescription({ type: "answer", sdp: body.sdp });
    $("talk").textContent = "Stop";
    $("talk").classList.add("on");
    $("text").disabled = $("send").disabled = false;
  } catch (err) {
    stop(null);
    showError(`Could not connect: ${connectError(err)}`);
  } finally {
    $("talk").disabled = false;
  }
}

function connectError(err) {
  if (err.name === "NotAllowedError") {
    return "the microphone was refused to this page. Allow it (the icon in the address bar) "
      + "and press Start talking again.";
  }
  if (err.name === "NotFoundError") return "no microphone was found. Connect one and press Start talking again.";
  if (err.name === "NotReadableError") return "the microphone is in use by another program, or failed to start.";
  return err.message || String(err);
}

// -- the microphone: browsers offer it to secure origins only (https, localhost) --

function microphoneHelp() {
  if (navigator.mediaDevices && navigator.mediaDevices.getUserMedia) return false;
  const help = $("mic-help");
  const para = (...parts) => {
    const p = document.createElement("p");
    p.append(...parts);
    return p;
  };
  const list = (...items) => {
    const ul = document.createElement("ul");
    for (const parts of items) {
      const li = document.createElement("li");
      li.append(...parts);
      ul.append(li);
    }
    return ul;
  };
  const code = (text) => {
    const c = document.createElement("code");
    c.textContent = text;
    return c;
  };
  if (window.isSecureContext) {
    help.replaceChildren(para(
      "This browser offers no microphone access to web pages (navigator.mediaDevices is missing). ",
      "Open this page in a current Chrome, Firefox, Edge or Safari.",
    ));
  } else {
    const port = location.port || (location.protocol === "https:" ? "443" : "80");
    const local = `http://localhost:${port}${location.pathname}${location.search}`;
    const link = document.createElement("a");
    link.href = local;
    link.textContent = local;
    help.replaceChildren(
      para(
        "The microphone is not available: this page was opened from ", code(location.origin),
        ", which the browser does not count as secure, so it hides the microphone from the page.",
      ),
      para("To talk to the assistant, open it from a secure origin instead:"),
      list(
        ["on the machine that runs duplex: ", link, " (localhost counts as secure);"],
        [
          "from another machine: forward the port (", code(`ssh -L ${port}:localhost:${port} THAT-MACHINE`),
          ") and open the same localhost address;",
        ],
        ["or serve it behind HTTPS (a reverse proxy with a certificate)."],
      ),
    );
  }
  help.hidden = false;
  demo.micHelp = help.innerText;
  return true;
}

function iceGathered(peer, ms) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); resolve(); };
    const timer = setTimeout(done, ms); // send what was gathered so far
    peer.addEventListener("icegatheringstatechange", () => {
      if (peer.iceGatheringState === "complete") done();
    });
  });
}

function stop(reason) {
  if (channel) channel.onclose = null;
  if (pc) pc.onconnectionstatechange = null;
  channel?.close();
  pc?.close();
  mic?.getTracks().forEach((track) => track.stop());
  channel = pc = mic = null;
  if (meters) clearInterval(meters.timer);
  meters = null;
  demo.connected = false;
  setState("idle");
  $("talk").textContent = "Start talking";
  $("talk").classList.remove("on");
  $("text").disabled = $("send").disabled = true;
  if (reason) showError(`Disconnected: ${reason}.`);
}

// -- what the server says --

function onEvent(event) {
  demo.events.push(event);
  if (demo.events.length > 500) demo.events.shift();
  switch (event.type) {
    case "duplex.state":
      if (event.state === "listening" || event.state === "user_speaking" || event.state === "interrupted") {
        setState("listening");
      } else if (event.state === "responding" && demo.state !== "speaking") {
        setState("thinking");
      }
      break;
    case "input_audio_buffer.speech_started":
      userLine(event.item_id, "…", false);
      break;
    case "conversation.item.input_audio_transcription.delta": { // each adds to the line
      const sofar = demo.transcripts.find((t) => t.itemId === event.item_id);
      userLine(event.item_id, (sofar && sofar.text !== "…" ? sofar.text : "") + event.delta, false);
      break;
    }
    case "conversation.item.input_audio_transcription.completed":
      userLine(event.item_id, event.transcript, true);
      break;
    case "response.created":
      setState("thinking");
      break;
    case "response.output_item.added": // the reply's item: its text and audio follow
      if (event.item.type !== "message") break; // a call: shown whole, below
      demo.assistantTurns.push({ responseId: event.response_id, itemId: event.item.id, text: "", heard: null, status: "in_progress" });
      break;
    case "response.function_call_arguments.done": { // the assistant calls the page's tool
      const tool = runTool[event.name];
      const output = JSON.stringify(tool ? tool() : { error: `no tool ${event.name}` });
      demo.toolCalls.push({ callId: event.call_id, name: event.name, arguments: event.arguments, output });
      demo.send({ type: "tool_result", call_id: event.call_id, output });
      answerAfter = event.response_id;
      const li = line(event.item_id, "tool");
      li.replaceChildren(label("tool"), document.createTextNode(`${event.name}(${event.arguments}) → ${output}`));
      break;
    }
    case "response.output_audio_transcript.delta":
      withTurn(event.item_id, (turn) => { turn.text += event.delta; });
      break;
    case "duplex.turn.metrics":
      demo.latencies.push(event);
      setState("speaking");
      showLatency();
      break;
    case "duplex.response.resumed":
      setState("speaking");
      break;
    case "duplex.item.heard": // a reply cut by a barge-in, as far as it was heard: after its response.done
      withTurn(event.item_id, (turn) => { turn.heard = event.transcript; });
      announce(`assistant:${event.item_id}`, event.transcript ? `Assistant, cut off: ${event.transcript}` : "Assistant, cut off");
      break;
    case "response.done": {
      const itemId = event.response.output.length ? event.response.output[0].id : null;
      withTurn(itemId, (turn) => {
        turn.status = event.response.status;
        if (turn.status === "cancelled" || !turn.text) return; // a cut reply is announced as heard
        const who = turn.status === "completed" ? "Assistant" : `Assistant (${turn.status})`;
        announce(`assistant:${itemId}`, `${who}: ${turn.text}`);
      });
      if (demo.state !== "listening") setState("listening");
      if (answerAfter === event.response.id) { // its calls have their results: the reply that uses them
        answerAfter = null;
        demo.send({ type: "respond", tool_choice: "auto" }); // it may speak, whatever choice called
      }
      break;
    }
    case "error":
      demo.errors.push(event.error);
      showError(`${event.error.code}: ${event.error.message}`);
      break;
  }
}

function setState(state) {
  demo.state = state;
  $("state").textContent = state;
  $("state").className = `state ${state}`;
}

function line(itemId, who) {
  let li = items.get(itemId);
  if (!li) {
    li = document.createElement("li");
    li.className = who;
    items.set(itemId, li);
    $("conversation").append(li);
  }
  return li;
}

function userLine(itemId, text, final) {
  let entry = demo.transcripts.find((t) => t.itemId === itemId);
  if (entry && entry.final && !final) return; // a late delta does not reopen a finished line
  if (!entry) demo.transcripts.push((entry = { itemId, text, final }));
  Object.assign(entry, { text, final });
  if (final) announce(`user:${itemId}`, `You: ${text}`);
  const li = line(itemId, "user");
  li.classList.toggle("partial", !final);
  li.replaceChildren(label("you"), document.createTextNode(text));
}

function withTurn(itemId, change) {
  const turn = demo.assistantTurns.find((t) => t.itemId === itemId);
  if (!turn) return;
  change(turn);
  const li = line(itemId, "assistant");
  const parts = [label("assistant")];
  if (turn.heard === null) {
    parts.push(document.createTextNode(turn.text));
  } else { // cut by a barge-in: what was not heard is struck through
    const cut = document.createElement("del");
    cut.textContent = turn.text.slice(turn.heard.length);
    parts.push(document.createTextNode(turn.heard), cut);
  }
  li.replaceChildren(...parts);
}

// The conversation list changes with every word, so it is not a live region: screen
// readers hear each finished line once, from a polite log that receives only those.
const announced = new Set(); // keys of the lines already announced
const ANNOUNCED_KEPT = 20; // older ones leave the (invisible) log: removals are not announced

function announce(key, text) {
  if (announced.has(key)) return;
  announced.add(key);
  const entry = document.createElement("p");
  entry.textContent = text;
  $("lines").append(entry);
  while ($("lines").childElementCount > ANNOUNCED_KEPT) $("lines").firstElementChild.remove();
}

function label(who) {
  const span = document.createElement("span");
  span.className = "who";
  span.textContent = who;
  return span;
}

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

// -- latency --

const STEPS = [
  ["endpoint_ms", "end of turn"], ["asr_final_ms", "ASR final"], ["llm_first_token_ms", "LLM first token"],
  ["first_phrase_ms", "first phrase"], ["tts_first_audio_ms", "TTS"], ["send_ms", "send"],
];

function showLatency() {
  const last = demo.latencies[demo.latencies.length - 1];
  const steps = STEPS.filter(([key]) => key in last).map(([key, name]) => `${name} ${Math.round(last[key])}`);
  $("latency").textContent = `voice-to-voice ${Math.round(last.voice_to_voice_ms)} ms (${steps.join(" · ")} ms)`;
  const canvas = $("chart");
  const g = canvas.getContext("2d");
  const turns = demo.latencies.slice(-12).map((m) => m.voice_to_voice_ms);
  const top = Math.max(1000, ...turns);
  const width = canvas.width / 12;
  g.clearRect(0, 0, canvas.width, canvas.height);
  g.font = "12px system-ui, sans-serif";
  turns.forEach((ms, i) => {
    const h = (ms / top) * (canvas.height - 20);
    g.fillStyle = "#6a9f6a";
    g.fillRect(i * width + 6, canvas.height - h, width - 12, h);
    g.fillStyle = "#222";
    g.fillText(`${Math.round(ms)}`, i * width + 8, canvas.height - h - 4);
  });
}

// -- levels, and what was heard --

function listen(input, output) {
  audioContext = audioContext || new AudioContext();
  audioContext.resume();
  const analyser = (stream) => {
    const node = audioContext.createAnalyser();
    node.fftSize = 1024;
    audioContext.createMediaStreamSource(stream).connect(node);
    return node;
  };
  const nodes = { in: analyser(input), out: analyser(output) };
  if (params.get("record") === "1") record(output);
  const buffer = new Float32Array(1024);
  const rms = (node) => {
    node.getFloatTimeDomainData(buffer);
    return Math.sqrt(buffer.reduce((sum, x) => sum + x * x, 0) / buffer.length);
  };
  let last = performance.now();
  const timer = setInterval(() => {
    const now = performance.now();
    const levelIn = rms(nodes.in);
    const levelOut = rms(nodes.out);
    $("level-in").value = Math.min(1, levelIn * 4);
    $("level-out").value = Math.min(1, levelOut * 4);
    if (levelOut > 0.01) demo.audioReceivedMs += now - last;
    last = now;
  }, 50);
  meters = { timer };
}

function record(stream) {
  // MediaRecorder encodes off the main thread, so a busy page does not glitch the recording
  const parts = [];
  const recorder = new MediaRecorder(stream, { mimeType: "audio/webm;codecs=opus" });
  recorder.ondataavailable = (event) => parts.push(event.data);
  recorder.start(500);
  demo.recording = async () => {
    await new Promise((resolve) => { recorder.onstop = resolve; recorder.stop(); });
    const bytes = new Uint8Array(await new Blob(parts).arrayBuffer());
    let binary = "";
    for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return { mimeType: recorder.mimeType, data: btoa(binary) };
  };
}

// -- the page --

$("talk").addEventListener("click", () => (pc ? stop(null) : start()));
$("text-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("text").value.trim();
  if (!text || !channel || channel.readyState !== "open") return;
  channel.send(JSON.stringify({ type: "input_text", text }));
  $("text").value = "";
});

const noMicrophone = microphoneHelp();
waitUntilReady().then(() => {
  if (noMicrophone) return; // Start talking stays off; the notice says what to do
  $("talk").disabled = false;
  if (params.get("autostart") === "1") start();
});
