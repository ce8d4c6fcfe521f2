"""The browser demo end to end: `duplex serve` and headless Chromium (Debian's, driven by
playwright-core from tests/e2e/) share a network namespace that holds only loopback,
so nothing leaves the machine. Chromium's fake microphone plays a WAV of synthesized
speech; the page's `window.duplexDemo`, the audio it received and a screenshot come
back from tests/e2e/demo.mjs. Screenshots are kept in tests/artifacts/.

The page's accessibility is checked on the way: axe-core (from npm, tests/e2e) runs the
WCAG 2 A/AA rules (names and labels, ARIA, colour contrast) on the page as it opens,
while a caller's words are being heard and when the turn is over; and every addition to
a live region is recorded, so that each finished line is seen to be announced once and
the words streaming in are not announced at all.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest

from audio_io.resample import resample
from audio_io.wav import write_wav
from benchmarks.speech_set import wer
from tests.conftest import REPO, duplex_command, free_port, speech

E2E = REPO / "tests" / "e2e"
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
RATE = 48000

pytestmark = pytest.mark.slow


class Namespace:
    """A network namespace with only loopback up, and `duplex serve` running in it."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        self.pid = str(self.holder.pid)
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{self.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "unshare made no network namespace"
            time.sleep(0.01)  # until unshare has run: nsenter would enter ours
        self.run("ip", "link", "set", "lo", "up")
        deadline = time.monotonic() + 5
        while "127.0.0.1" not in self.run("ip", "-4", "addr", "show", "lo").stdout:
            assert time.monotonic() < deadline, "loopback has no address in the namespace"
            time.sleep(0.05)
        self.port = free_port()  # any port: the namespace's loopback is empty
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        self.grpc_port = free_port()
        command = duplex_command("serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port))
        self.server = subprocess.Popen(
            self.enter(*command), env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def enter(self, *command: str) -> list[str]:
        return ["nsenter", "-t", self.pid, "-n", *command]

    def run(
        self, *command: str, timeout: float = 60, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.enter(*command), capture_output=True, text=True, timeout=timeout, cwd=cwd, check=True
        )

    def get(self, path: str) -> str:
        """GET a URL of the server from inside the namespace."""
        script = (
            f"import urllib.request as u; print(u.urlopen('{self.url}{path}', timeout=5).read().decode())"
        )
        return self.run("python3", "-c", script, timeout=10).stdout

    def wait_ready(self, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.server.poll() is None, "duplex serve exited"
            try:
                if json.loads(self.get("/healthz"))["status"] == "ready":
                    return
            except subprocess.CalledProcessError:
                pass  # not listening yet, or 503 while the models load
            time.sleep(1)
        raise TimeoutError(f"duplex serve not ready in {within} s")

    def close(self) -> None:
        self.server.send_signal(signal.SIGTERM)
        try:
            self.server.wait(10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.holder.kill()
        self.holder.wait()
        self._log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Namespace]:
    for need, how in ((CHROMIUM, "Debian's chromium"), (E2E / "node_modules" / "playwright-core", "npm ci")):
        assert need.exists(), f"{need} is missing: `make test` installs it ({how})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["GLOO_SOCKET_IFNAME"] = "lo"  # vLLM's gloo group: the namespace has no other interface
    ns = Namespace(env, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        ns.wait_ready(within=300)
        yield ns
    finally:
        ns.close()


def fake_mic(path: Path, tts_engine, *parts: str | float) -> Path:
    """A WAV for Chromium's fake microphone: speech (str) and silences (seconds)."""
    audio = []
    for part in parts:
        if isinstance(part, str):
            audio.append(resample(speech(tts_engine, part), 16000, RATE))
        else:
            audio.append(np.zeros(round(part * RATE), np.int16))
    write_wav(path, np.concatenate(audio), RATE)
    return path


def browse(ns: Namespace, wav: Path, out: Path, *options: str, url: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    url = url or f"{ns.url}/?autostart=1&record=1&processing=0"
    ns.run("node", str(E2E / "demo.mjs"), url, str(wav), str(out), *options, timeout=240, cwd=E2E)
    result = json.loads((out / "result.json").read_text())
    assert result["ok"], result
    return result


def assert_accessible(result: dict) -> None:
    """No axe-core violation of the WCAG 2 A/AA rules in any of the page's states that
    were checked, with the rules that matter here among those that ran and passed."""
    assert result["axe"], "axe-core did not run"
    for moment, axe in result["axe"].items():
        assert axe["violations"] == [], (moment, axe["violations"])
        assert {"color-contrast", "aria-allowed-attr", "button-name"} <= set(axe["passes"]), moment
    if "partial" in result["axe"]:
        assert result["axe"]["partial"]["partial"], "no line was being heard while axe ran"
        assert "label" in result["axe"]["finished"]["passes"]  # the message box has its label


def assert_each_finished_line_announced_once(demo: dict) -> None:
    """The polite log (#lines) receives each finished line once, in order, and nothing
    else; the conversation list, which changes with every word, is not a live region;
    no other live region repeats itself."""
    assert not demo["conversationLive"]
    said = [a["text"] for a in demo["announcements"] if a["region"] == "lines"]
    finals = [f"You: {t['text']}" for t in demo["transcripts"] if t["final"]]
    replies = []
    for turn in demo["assistantTurns"]:
        if turn["status"] == "cancelled" and turn["heard"] is not None:  # what was heard of it
            replies.append(f"Assistant, cut off: {turn['heard']}" if turn["heard"] else "Assistant, cut off")
        elif turn["status"] == "completed" and turn["text"]:
            replies.append(f"Assistant: {turn['text']}")
        elif turn["status"] not in ("cancelled", "in_progress") and turn["text"]:
            replies.append(f"Assistant ({turn['status']}): {turn['text']}")
    assert [s for s in said if s.startswith("You: ")] == finals, said
    assert [s for s in said if s.startswith("Assistant")] == replies, said
    assert len(said) == len(finals) + len(replies), said  # no partial words, no repeats
    others: dict[str, list[str]] = {}
    for a in demo["announcements"]:
        if a["region"] != "lines":
            others.setdefault(a["region"], []).append(a["text"])
    assert others, "no other live region was recorded (the service badge is one)"
    for region, texts in others.items():
        assert all(a != b for a, b in zip(texts, texts[1:], strict=False)), (region, texts)


def received(result: dict) -> tuple[np.ndarray, int]:
    """The audio the page received (its WebM/Opus recording), as 48 kHz mono int16."""
    container = av.open(io.BytesIO(base64.b64decode(result["recording"]["data"])), mode="r")
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
    chunks = [
        out.to_ndarray().reshape(-1)
        for frame in container.decode(audio=0)
        for out in resampler.resample(frame)
    ]
    container.close()
    return np.concatenate(chunks).astype(np.int16), RATE


def voiced_segments(audio: np.ndarray, rate: int, gap_s: float = 0.4) -> list[tuple[int, int]]:
    """(start, end) sample spans of sound separated by at least ``gap_s`` of silence."""
    hop = rate // 100
    n = audio.size // hop
    loud = np.abs(audio[: n * hop].reshape(n, hop).astype(np.int32)).max(axis=1) > 300
    spans: list[tuple[int, int]] = []
    for i in np.flatnonzero(loud):
        if spans and i - spans[-1][1] <= gap_s * 100:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return [(a * hop, b * hop) for a, b in spans]


def test_a_spoken_question_in_the_browser_gets_a_spoken_reply(served, tts_engine, asr_engine, tmp_path):
    question = "What is the largest ocean on Earth?"  # its reply is plain English (no "Le Grand Paris")
    wav = fake_mic(tmp_path / "mic.wav", tts_engine, 3.0, question, 12.0)
    result = browse(served, wav, tmp_path / "out")
    demo = result["demo"]
    assert demo["connected"] and demo["state"] == "listening"
    finals = [t["text"] for t in demo["transcripts"] if t["final"]]
    assert finals and wer([(question, finals[0])]) <= 0.2, finals
    turn = demo["assistantTurns"][0]
    assert turn["status"] == "completed" and turn["text"]
    assert demo["audioReceivedMs"] >= 1000
    audio, rate = received(result)  # the page's output: only the reply (its phrases may have gaps)
    spans = voiced_segments(audio, rate)
    start, end = spans[0][0], spans[-1][1]
    heard = asr_engine.transcribe(resample(audio[max(0, start - rate // 10) : end + rate // 10], rate, 16000))
    assert wer([(turn["text"], heard)]) <= 0.3, (turn["text"], heard)
    (latency,) = demo["latencies"]
    assert latency["voice_to_voice_ms"] > 0 and "llm_first_token_ms" in latency
    assert_accessible(result)
    assert_each_finished_line_announced_once(demo)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "out" / "page.png", ARTIFACTS / "demo_turn.png")


def test_the_assistant_calls_the_pages_own_tool_and_speaks_its_result(served, tts_engine, tmp_path):
    """The page declares get_time on the data channel (?tool_choice=required: the call is
    not left to the bundled model's whim); the call shows in the conversation, the page
    answers it, and the reply that follows uses the time it gave."""
    wav = fake_mic(tmp_path / "mic.wav", tts_engine, 3.0, "What time is it now?", 16.0)
    url = f"{served.url}/?autostart=1&processing=0&tool_choice=required"
    result = browse(served, wav, tmp_path / "out", "--until-turns", "2", url=url)
    demo = result["demo"]
    (call,) = demo["toolCalls"]
    assert call["name"] == "get_time" and json.loads(call["arguments"]) == {}
    told = json.loads(call["output"])["time"]
    first, second = demo["assistantTurns"][:2]
    assert first["status"] == "completed" and first["text"] == ""  # the call alone: nothing spoken
    assert second["status"] == "completed" and second["text"]
    hour = told.split(":")[0]
    assert hour in second["text"], (told, second["text"])
    assert not demo["errors"]


def test_barge_in_in_the_browser_cuts_the_reply_to_what_was_heard(served, tts_engine, asr_engine, tmp_path):
    wav = fake_mic(
        tmp_path / "mic.wav",
        tts_engine,
        3.0,
        "Please tell me a long story about a brave little dragon.",
        3.5,  # the reply starts ~1.5-2 s after the question: this lands 1.5-2 s into it
        "Stop please. What is two plus two?",
        12.0,
    )
    result = browse(served, wav, tmp_path / "out", "--until-turns", "2")
    demo = result["demo"]
    cut, answer = demo["assistantTurns"][:2]
    assert cut["status"] == "cancelled" and cut["heard"] is not None, cut
    assert cut["text"].startswith(cut["heard"]) and len(cut["heard"]) < len(cut["text"])
    assert demo["cutShown"]  # the page struck the unheard part through
    (truncated,) = [e for e in demo["events"] if e["type"] == "conversation.item.truncated"]
    (heard,) = [e for e in demo["events"] if e["type"] == "duplex.item.heard"]  # the API's event has no text
    assert heard["item_id"] == truncated["item_id"] and heard["transcript"] == cut["heard"]
    audio, rate = received(result)
    first = voiced_segments(audio, rate, gap_s=1.5)[0]  # the cut reply (its phrase gaps are shorter)
    span_ms = (first[1] - first[0]) / rate * 1000
    # what the server says was played is what the page received: no more audio than
    # the page's span of it (which also holds any gaps between phrases), and the same words
    # (the span leaves out the reply's quiet start and end: 300 ms of slack)
    assert truncated["audio_end_ms"] <= span_ms + 300, (span_ms, truncated)
    clip = audio[max(0, first[0] - rate // 10) : first[1] + rate // 10]
    words = asr_engine.transcribe(resample(clip, rate, 16000)).split()
    said = cut["heard"].split()
    assert said, cut
    # Whisper may run on past a clip that ends mid-word ("...a brave story about a brave"):
    # the heard words must be how it begins
    assert wer([(" ".join(said), " ".join(words[: len(said)]))]) <= 0.4, (said, words)
    assert answer["status"] == "completed"
    assert_accessible(result)  # the struck-through words included
    assert_each_finished_line_announced_once(demo)  # the cut reply as heard
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "out" / "page.png", ARTIFACTS / "demo_barge_in.png")


def test_a_tab_closed_mid_reply_ends_its_session_and_the_server_goes_on(served, tts_engine, tmp_path):
    wav = fake_mic(tmp_path / "mic.wav", tts_engine, 3.0, "Please tell me a long story about a cat.", 10.0)
    result = browse(served, wav, tmp_path / "out", "--close-after-audio-ms", "500")
    assert result["demo"]["state"] == "speaking"
    deadline = time.monotonic() + 15
    while "duplex_sessions_active 0.0" not in served.get("/metrics"):
        assert time.monotonic() < deadline, "the session outlived its tab"
        time.sleep(0.5)
    assert served.server.poll() is None
    assert json.loads(served.get("/healthz"))["status"] == "ready"


def test_a_page_from_a_non_secure_origin_says_how_to_reach_the_microphone(served, tmp_path):
    """Opened by a name (not localhost, not https), the page is not a secure context: the
    browser hides the microphone (navigator.mediaDevices is undefined). The page says so,
    and how to open it instead; Chromium resolves the name to the namespace's loopback."""
    wav = tmp_path / "silence.wav"
    write_wav(wav, np.zeros(RATE, np.int16), RATE)
    url = f"http://duplex-demo.test:{served.port}/?autostart=1"
    result = browse(served, wav, tmp_path / "out", "--no-microphone", url=url)
    page = result["page"]
    assert not page["secure"] and page["mediaDevices"] == "undefined"
    assert page["helpVisible"] and page["talkDisabled"] and not page["connected"]
    assert page["talkDescription"] == "mic-help"  # the disabled button points at the reason
    help_text = " ".join(page["help"].split())
    assert f"opened from http://duplex-demo.test:{served.port}," in help_text, help_text
    assert "hides the microphone" in help_text and "HTTPS" in help_text
    assert f"ssh -L {served.port}:localhost:{served.port}" in help_text
    assert page["links"] == [f"http://localhost:{served.port}/?autostart=1"]
    assert_accessible(result)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "out" / "page.png", ARTIFACTS / "demo_no_microphone.png")
