"""Every program in examples/, run as a client developer would run it, against one real
`duplex serve` (with an auth token and a SIP line with digest auth) in a network
namespace that holds only loopback: headless Chromium may only run in one, so the
server and every client share it (`tests.test_demo_e2e.Namespace`). Questions are
synthesized by the bundled voice; each reply's audio is transcribed back."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from xml.etree import ElementTree

import numpy as np
import pytest

from audio_io.resample import resample
from audio_io.wav import read_wav, write_wav
from benchmarks.speech_set import wer
from tests.conftest import REPO, free_port, speech
from tests.test_demo_e2e import ARTIFACTS, CHROMIUM, E2E, Namespace

EXAMPLES = REPO / "examples"
QUESTION = "What is the largest ocean on Earth?"  # "the Pacific", with the default models
TOKEN = "example-token-0123"  # the server's auth_token: every example must present it
SIP_USER, SIP_PASSWORD = "caller", "example-sip-pass"
TWILIO_AUTH_TOKEN = "twilio-account-secret"


class Served(Namespace):
    sip_port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["GLOO_SOCKET_IFNAME"] = "lo"  # vLLM's gloo group: the namespace has no other interface
    env.update(
        DUPLEX_AUTH_TOKEN=TOKEN,
        DUPLEX_SIP_PORT=str(free_port()),  # any port: the namespace's loopback is empty
        DUPLEX_SIP_USERNAME=SIP_USER,
        DUPLEX_SIP_PASSWORD=SIP_PASSWORD,
    )
    ns = Served(env, tmp_path_factory.mktemp("serve") / "serve.log")
    ns.sip_port = int(env["DUPLEX_SIP_PORT"])
    try:
        ns.wait_ready(within=300)
        yield ns
    finally:
        ns.close()


def client_env(**extra: str) -> dict[str, str]:
    """A client's environment: the server's token, as the examples' READMEs say."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update({"PYTHONUNBUFFERED": "1", "DUPLEX_AUTH_TOKEN": TOKEN, **extra})
    return env


def run_in(
    ns: Namespace, *command: str, env: dict[str, str], timeout: float = 180, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run a program in the server's namespace, to its end."""
    return subprocess.run(
        ns.enter(*command), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def http_in(
    ns: Namespace, url: str, form: dict[str, str] | None = None, headers: dict[str, str] | None = None
):
    """GET (or POST a form to) ``url`` from inside the namespace: (status, body)."""
    script = """
import json, sys, urllib.error, urllib.parse, urllib.request
url, form, headers = json.loads(sys.stdin.read())
data = urllib.parse.urlencode(form).encode() if form is not None else None
try:
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""
    result = subprocess.run(
        ns.enter(sys.executable, "-c", script),
        input=json.dumps([url, form, headers or {}]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        return None, result.stderr
    status, body = json.loads(result.stdout)
    return status, body


class App:
    """An example's own server, running in the namespace until the test ends."""

    def __init__(self, ns: Namespace, log: Path, *command: str, env: dict[str, str], url: str) -> None:
        self._log = log.open("w")
        self.process = subprocess.Popen(
            ns.enter(*command), env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO
        )
        self.log = log
        deadline = time.monotonic() + 30
        while http_in(ns, url)[0] is None:  # not listening yet
            assert self.process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"{command} not listening: {log.read_text()}"
            time.sleep(0.3)

    def close(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        return self.log.read_text()


def question_wav(tts_engine, path: Path, rate: int, silence_s: float = 0.0) -> Path:
    """The question in the bundled voice at ``rate``, half a second of silence before
    it and ``silence_s`` after it."""
    voice = resample(speech(tts_engine, QUESTION), 16000, rate)
    audio = [np.zeros(rate // 2, np.int16), voice, np.zeros(int(silence_s * rate), np.int16)]
    write_wav(path, np.concatenate(audio), rate)
    return path


def said(stdout: str, prefix: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith(prefix)]
    return line.split(prefix, 1)[1].strip()


def heard(asr_engine, path: Path) -> str:
    """What the reply's audio says, by the ASR (after checking there is a reply)."""
    audio, rate = read_wav(path)
    assert audio.size / rate >= 1.0 and np.abs(audio.astype(np.int32)).max() > 1000, path
    return asr_engine.transcribe(resample(audio, rate, 16000))


@pytest.mark.slow
def test_grpc_client_example_asks_and_saves_the_spoken_reply(served, tts_engine, asr_engine, tmp_path):
    question = question_wav(tts_engine, tmp_path / "question.wav", 16000)
    reply = tmp_path / "reply.wav"
    command = [sys.executable, str(EXAMPLES / "grpc_client.py"), str(question), str(reply)]
    result = run_in(served, *command, "--target", f"127.0.0.1:{served.grpc_port}", env=client_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert wer([(QUESTION, said(result.stdout, "you said:"))]) <= 0.2, result.stdout
    answer = said(result.stdout, "duplex said:")
    assert "Pacific" in answer and wer([(answer, heard(asr_engine, reply))]) <= 0.3
    # without the server's token, the example says why it could not start
    refused = run_in(
        served,
        *command,
        "--target",
        f"127.0.0.1:{served.grpc_port}",
        env=client_env(DUPLEX_AUTH_TOKEN="wrong-token-00"),
    )
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_realtime_openai_example_prints_the_events_and_saves_the_reply(
    served, tts_engine, asr_engine, tmp_path
):
    question = question_wav(tts_engine, tmp_path / "question.wav", 24000)
    reply = tmp_path / "reply.wav"
    url = f"http://127.0.0.1:{served.port}/v1"
    command = [sys.executable, str(EXAMPLES / "realtime_openai.py"), str(question), str(reply), "--url", url]
    result = run_in(served, *command, env=client_env())
    assert result.returncode == 0, result.stdout + result.stderr
    types = [line for line in result.stdout.splitlines() if not line.startswith(("  ", "saved"))]
    assert types[0] == "session.created" and types[-1] == "response.done", types
    for kind in ("session.updated", "input_audio_buffer.speech_started", "response.created"):
        assert kind in types, kind
    assert wer([(QUESTION, said(result.stdout, "you said:"))]) <= 0.2, result.stdout
    answer = said(result.stdout, "duplex said:")
    assert said(result.stdout, "status:") == "completed"
    assert "Pacific" in answer and wer([(answer, heard(asr_engine, reply))]) <= 0.3


@pytest.mark.slow
def test_browser_example_page_talks_through_its_own_server(served, tts_engine, tmp_path):
    for need, how in ((CHROMIUM, "Debian's chromium"), (E2E / "node_modules" / "playwright-core", "npm ci")):
        assert need.exists(), f"{need} is missing: `make test` installs it ({how})"
    port = free_port()
    page_url = f"http://127.0.0.1:{port}/"
    command = [
        sys.executable,
        str(EXAMPLES / "browser" / "serve.py"),
        "--duplex",
        served.url,
        "--port",
        str(port),
    ]
    app = App(served, tmp_path / "app.log", *command, env=client_env(), url=page_url)
    try:
        status, page = http_in(served, page_url)
        assert status == 200 and TOKEN not in page  # the token stays on the app's server
        mic = question_wav(tts_engine, tmp_path / "mic.wav", 48000, silence_s=12.0)
        out = tmp_path / "out"
        out.mkdir()
        run_in(
            served,
            "node",
            str(E2E / "example_page.mjs"),
            page_url,
            str(mic),
            str(out),
            env=client_env(),
            cwd=E2E,
            timeout=240,
        )
        result = json.loads((out / "result.json").read_text())
    finally:
        app_log = app.close()
    assert result["ok"], (result, app_log)
    events = result["events"]
    (final,) = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert wer([(QUESTION, final["transcript"])]) <= 0.2
    reply = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert "Pacific" in reply
    assert result["lines"] == [f"you: {final['transcript']}", f"duplex: {reply}"], result["lines"]
    # the reply was heard: Chrome's playout measured at least the energy of a second of
    # speech at -20 dBFS (0.1 squared, times 1 s); a silent track measures about 0
    audio = result["audio"]
    assert audio["packetsReceived"] >= 50 and audio["totalAudioEnergy"] >= 0.01, audio
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(out / "page.png", ARTIFACTS / "example_page.png")


def example_module(name: str) -> ModuleType:
    """An example program as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_twilio_example_signs_as_twilio_documents():
    """The example checks X-Twilio-Signature by Twilio's algorithm: its function gives
    the signature of the example in Twilio's own validation guide (twilio-php)."""
    sign = example_module("twilio_app").twilio_signature
    form = {
        "CallSid": "CA1234567890ABCDE", "Caller": "+14158675309", "Digits": "1234",
        "From": "+14158675309", "To": "+18005551212",
    }  # fmt: skip
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    assert sign("12345", url, form) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert sign("12346", url, form) != "RSOYDt4T1cUTdK1PDd93/VVr8B8="


@pytest.mark.slow
def test_twilio_example_answers_the_webhook_with_a_stream_that_duplex_takes(
    served, tts_engine, asr_engine, tmp_path
):
    port = free_port()
    voice_url = f"http://127.0.0.1:{port}/voice"
    stream_url = f"ws://127.0.0.1:{served.port}/telephony/twilio"
    command = [
        sys.executable,
        str(EXAMPLES / "twilio_app.py"),
        "--stream-url",
        stream_url,
        "--public-url",
        voice_url,
        "--port",
        str(port),
    ]
    app = App(
        served,
        tmp_path / "app.log",
        *command,
        env=client_env(TWILIO_AUTH_TOKEN=TWILIO_AUTH_TOKEN),
        url=f"http://127.0.0.1:{port}/",
    )
    try:
        # what Twilio POSTs when a call comes in, signed with the account's auth token
        form = {
            "AccountSid": "AC0123", "ApiVersion": "2010-04-01", "CallSid": "CA0123", "CallStatus": "ringing",
            "Direction": "inbound", "From": "+15550100", "To": "+15550199",
        }  # fmt: skip
        signature = example_module("twilio_app").twilio_signature(TWILIO_AUTH_TOKEN, voice_url, form)
        signed = {"X-Twilio-Signature": signature}
        status, twiml = http_in(served, voice_url, form, signed)
        forged_status, forged = http_in(served, voice_url, form, {"X-Twilio-Signature": "Zm9yZ2Vk"})
        unsigned_status, _ = http_in(served, voice_url, form)
    finally:
        app_log = app.close()
    assert status == 200, (twiml, app_log)
    assert forged_status == unsigned_status == 403 and TOKEN not in forged
    assert "call CA0123 from +15550100" in app_log
    stream = ElementTree.fromstring(twiml).find("Connect/Stream")
    assert stream is not None and stream.get("url") == stream_url
    params = {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
    assert params == {"token": TOKEN}
    # Twilio's side of the call: the simulator streams a caller to the URL and with the
    # parameters of the TwiML, as Twilio would
    question = question_wav(tts_engine, tmp_path / "question.wav", 8000, silence_s=1.5)
    reply = tmp_path / "reply.wav"
    call = [
        str(Path(sys.executable).parent / "streamdouble"), "call", stream.get("url", ""),
        "--audio", str(question), "--out", str(reply), "--json",
        *[f"--param={name}={value}" for name, value in params.items()],
        "--response-timeout", "30", "--quiet-period", "2.5", "--max-drain", "40",
    ]  # fmt: skip
    result = run_in(served, *call, env=client_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["exit_code"] == 0
    assert "Pacific" in heard(asr_engine, reply)


@pytest.mark.slow
def test_sip_example_calls_with_baresip_and_saves_the_reply(served, tts_engine, asr_engine, tmp_path):
    question = question_wav(tts_engine, tmp_path / "question.wav", 8000)
    reply = tmp_path / "reply.wav"
    uri = f"sip:duplex@127.0.0.1:{served.sip_port}"
    env = client_env(SIP_USER=SIP_USER, SIP_PASSWORD=SIP_PASSWORD)
    result = run_in(served, str(EXAMPLES / "sip" / "call.sh"), str(question), uri, str(reply), "12", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "Call established" in result.stdout, result.stdout[-3000:]
    assert "Pacific" in heard(asr_engine, reply)
