// A third-party client of duplex.v1.Duplex.Converse: Node's @grpc/grpc-js with the
// proto loaded at run time (@grpc/proto-loader, keepCase). Streams raw PCM16 16 kHz mono
// in real time (then silence), half-closes after the first reply, and prints a JSON
// summary of what came back.
//
//   node converse.mjs HOST:PORT PCM_FILE PROTO_FILE
import { readFileSync } from "node:fs";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [target, pcmFile, protoFile] = process.argv.slice(2);
const definition = protoLoader.loadSync(protoFile, { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true });
const { duplex } = grpc.loadPackageDefinition(definition);
const client = new duplex.v1.Duplex(target, grpc.credentials.createInsecure());

const summary = { started: null, transcripts: [], text: "", audioBytes: 0, sequences: [], metrics: [], turns: [], errors: [], status: null };
const call = client.Converse();
call.write({ config: { input_format: { encoding: "PCM16", sample_rate: 16000 } } });

const pcm = Buffer.concat([readFileSync(pcmFile), Buffer.alloc(16000 * 2 * 1.5)]);
const chunk = 640; // 20 ms
let sent = 0;
let ended = false;
const start = Date.now();
function pump() {
  if (ended) return;
  const k = sent / chunk;
  const piece = sent < pcm.length ? pcm.subarray(sent, sent + chunk) : Buffer.alloc(chunk);
  call.write({ audio: { data: piece } });
  sent += chunk;
  setTimeout(pump, Math.max(0, start + (k + 1) * 20 - Date.now()));
}
pump();

call.on("data", (event) => {
  switch (event.event) {
    case "started": summary.started = event.started; break;
    case "audio": summary.audioBytes += event.audio.data.length; summary.sequences.push(event.audio.sequence); break;
    case "transcript": if (event.transcript.final) summary.transcripts.push(event.transcript.text); break;
    case "text": summary.text += event.text.delta; break;
    case "metrics": summary.metrics.push(event.metrics); break;
    case "error": summary.errors.push(event.error); break;
    case "turn":
      summary.turns.push(event.turn.kind);
      if (event.turn.kind === "RESPONSE_DONE" && !ended) { ended = true; call.end(); }
      break;
  }
});
call.on("status", (status) => { summary.status = { code: status.code, details: status.details }; });
call.on("end", () => {
  setTimeout(() => { console.log(JSON.stringify(summary)); client.close(); }, 50);
});
call.on("error", (error) => { summary.status = { code: error.code, details: error.details }; });
setTimeout(() => { summary.status = summary.status || { code: -1, details: "timeout" }; console.log(JSON.stringify(summary)); process.exit(1); }, 90000).unref();
