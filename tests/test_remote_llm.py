"""The AR stage as a network service (`models.remote_llm`): real processes on 127.0.0.1.

One LLM service for the module: ``duplex serve-llm --replicas 2`` (two vLLM OpenAI
servers behind vLLM's router, consistent hashing on ``X-Session-ID``). The front
ends are real ``duplex serve`` processes with ``--llm-url``, one of them reaching the
service through a `TcpLink` the tests cut and restore. What the service computed is
read from each replica's own ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from audio_io._proto import duplex_pb2 as pb
from benchmarks.ar import AR_KEYS, QUESTIONS, WORDS_40
from benchmarks.quality import PROMPTS, greedy_replies
from duplex.grpc_client import DuplexClient
from models.conversation import Conversation
from models.llm import LlmConfig
from models.llm_types import Delta, LlmUnavailable
from models.remote_llm import RemoteLlm
from models.tools import ToolCall, ToolChoice, ToolLimits, parse_tools
from tests.conftest import duplex_command, free_port
from tests.tcp_link import TcpLink
from tests.test_faults_served import offline_env
from tests.test_serve import Server, get_health
from tests.test_sessions import samples
from tests.weather_tool import WEATHER

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

BLOCK = 32  # the replicas' KV block, in tokens (`duplex serve-llm` on the CPU)
CONTEXT = 2048  # as the in-process engine of the test session (tests/conftest.py)
RUNNING, GENERATED = "vllm:num_requests_running", "vllm:generation_tokens_total"  # replicas' metrics


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65536 and all(_free(base + i) for i in range(1, n)):
            return base
    raise AssertionError(f"no run of {n} free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LlmService:
    """``duplex serve-llm --replicas 2``: the router on `port`, replicas on the next two."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_run(4)  # router, two replicas, the router's metrics
        self.log_path = log_path
        self.proc = subprocess.Popen(
            duplex_command(
                "serve-llm",
                "--port",
                str(self.port),
                "--replicas",
                "2",
                "--llm-max-context",
                str(CONTEXT),
                "--llm-execution",
                "compiled",
            ),
            env=offline_env(),
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            # a group of its own (the tests kill replicas, and the group at the end), in
            # this process's session: started in a session of its own (autogroup), a
            # replica generating held this process up for 0.8-17 s at a time (2 cores)
            process_group=0,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + i}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    async def wait_ready(self, within: float) -> None:
        """Until the router says every replica is healthy."""
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.log()
                try:
                    async with http.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(1)
        raise AssertionError(f"the LLM service was not ready in {within:g} s:\n{self.log()}")

    def replica_processes(self, i: int) -> list[psutil.Process]:
        """Replica ``i``'s server and every process it started."""
        port = str(self.port + 1 + i)
        for child in psutil.Process(self.proc.pid).children():
            cmdline = child.cmdline()
            if (
                "vllm.entrypoints.openai.api_server" in cmdline
                and cmdline[cmdline.index("--port") + 1] == port
            ):
                return [child, *child.children(recursive=True)]
        raise AssertionError(f"no replica on port {port}")

    def kill_replica(self, i: int) -> None:
        for process in self.replica_processes(i):
            process.kill()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.proc.wait()


async def counters(url: str) -> dict[str, float]:
    """A vLLM server's Prometheus counters and gauges, summed over their labels."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def computed(service: LlmService, replicas: tuple[int, ...] = (0, 1)) -> dict[int, tuple[float, float]]:
    """Per replica: prompt tokens asked for, and those found in its prefix cache."""
    out = {}
    for i in replicas:
        c = await counters(service.replica_url(i))
        out[i] = (c.get("vllm:prompt_tokens_total", 0.0), c.get("vllm:prompt_tokens_cached_total", 0.0))
    return out


async def settled(
    service: LlmService, before: dict[int, tuple[float, float]], prompt: int
) -> dict[int, tuple[float, float]]:
    """The replicas' growth since ``before``, once it counts a request of ``prompt``
    tokens (the stat logger records a step after its outputs went out)."""
    deadline = time.monotonic() + 3
    while True:
        now = await computed(service, tuple(before))
        grown = {i: (now[i][0] - before[i][0], now[i][1] - before[i][1]) for i in before}
        if sum(g[0] for g in grown.values()) >= prompt or time.monotonic() > deadline:
            return grown
        await asyncio.sleep(0.05)


# -- fixtures --


@pytest.fixture(scope="module")
def model_dir() -> str:
    from duplex.config import Config
    from models.cache import default_cache_dir
    from models.prepare import ModelChoice, prepare

    config = Config()
    (llm,) = prepare(
        [ModelChoice("llm", config.llm, config.llm_quantization)], default_cache_dir(), progress=False
    )
    return llm.path


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LlmService]:
    service = LlmService(tmp_path_factory.mktemp("llm") / "serve-llm.log")
    try:
        await service.wait_ready(600)  # a first start compiles the graph (~2 min)
        yield service
    finally:
        service.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def remote(service: LlmService, model_dir: str) -> AsyncIterator[RemoteLlm]:
    backend = RemoteLlm(service.url, LlmConfig(model=model_dir, max_model_len=CONTEXT, max_tokens=48))
    await backend.start()
    yield backend
    await backend.aclose()


class RunToLimit(RemoteLlm):
    """The real backend, whose replies run to their ``max_tokens`` whatever the model
    says (``ignore_eos``) while ``on``: a greedy reply's length differs between CPUs (a
    "very long story" ended after 30 tokens on one with AMX), and a test that stops or
    kills a reply midway needs one still running when it acts."""

    on = False

    def complete(  # type: ignore[override]
        self,
        request_id: str,
        session_key: str,
        prompt: list[int],
        max_tokens: int,
        ignore_eos: bool,
        **kw: Any,
    ) -> AsyncIterator[Delta]:
        to_limit = self.on and max_tokens > 1  # (a prefill asks for one token)
        return super().complete(request_id, session_key, prompt, max_tokens, ignore_eos or to_limit, **kw)


async def per_replica(service: LlmService, name: str) -> list[float]:
    """One of the replicas' counters or gauges, per replica (recorded step by step)."""
    return [(await counters(service.replica_url(i)))[name] for i in range(2)]


async def replied(conversation: Conversation, text: str) -> str:
    return "".join([delta async for delta in conversation.reply(text)])


# -- the remote backend against the service --


async def test_a_session_prefills_only_its_new_tokens_turn_after_turn(service, remote):
    """Turn N prefills at most what the service has not seen of it plus one KV block,
    by the request's own ``cached_tokens`` and by the replicas' counters alike."""
    conversation = Conversation(remote)
    close = len(conversation.format.assistant_close())
    for turn, question in enumerate(QUESTIONS[:5], 1):
        history = len(conversation.history_tokens())
        before = await computed(service)
        assert (await replied(conversation, question)).strip()
        stats = conversation.last
        # new to the service: the previous reply's closing tokens (its last one was
        # sampled, never fed back) and this turn's user block
        new = stats.prompt_tokens - history + (close if turn > 1 else history)
        assert stats.prefilled_tokens <= new + BLOCK, (turn, stats, new)
        grown = await settled(service, before, stats.prompt_tokens)
        asked = sum(g[0] for g in grown.values())
        found = sum(g[1] for g in grown.values())
        assert asked == stats.prompt_tokens, (turn, grown, stats)
        assert asked - found == stats.prefilled_tokens, (turn, grown, stats)
    assert turn == 5 and len(conversation.turns) == 5
    conversation.close()


async def test_words_prefilled_while_the_caller_speaks_leave_only_the_last_words(remote):
    conversation = Conversation(remote)
    assert (await replied(conversation, "Hello there, this is a call about a trip.")).strip()
    words = WORDS_40.split()
    for n in range(1, len(words)):
        await conversation.prefill(" ".join(words[:n]))
    last_prefill = (
        conversation.history_tokens()
        + conversation.format.user_open()
        + conversation.format.encode(" ".join(words[:-1]))
    )
    assert (await replied(conversation, WORDS_40)).strip()
    stats = conversation.last
    # the last word, the end of the user turn and the assistant header, and the block
    # the last prefill's end fell in
    assert stats.prefilled_tokens <= stats.prompt_tokens - len(last_prefill) + BLOCK, stats
    # fewer than the caller's words: a turn prefilled whole computes all of them and more
    # (how many fewer depends on where the previous reply's end put the block boundaries)
    assert stats.prefilled_tokens < len(conversation.format.encode(WORDS_40)), stats
    conversation.close()


async def test_a_barge_in_closes_the_stream_and_the_server_stops_the_request(service, remote):
    """Judged by the replicas' counters, not by when they are read: on a 2-core machine
    (Intel Xeon family 6 model 207, AMX) this test's process was held up for seconds at
    a time while a replica generated (the service then ran in a session of its own,
    `LlmService`), and a look at the replicas after the reply's first token came after
    the whole 1,000-token request had run (CI, and 3 runs of 4 here)."""
    limit = CONTEXT - 200  # run to its limit, ~30 s of generation here
    long = RunToLimit(service.url, replace(remote.config, max_tokens=limit))
    long.on = True
    await long.start()
    conversation = Conversation(long)
    before = await per_replica(service, GENERATED)
    reply = conversation.reply(
        "Tell me a very long story about a dragon who learns to fly, with many details."
    )
    try:
        async for _ in reply:
            break
        await conversation.abort()  # what a barge-in does (`duplex.reply`)
        deadline = time.monotonic() + 60
        while sum(await per_replica(service, RUNNING)) > 0:
            assert time.monotonic() < deadline, "the server still runs the request a minute on"
            await asyncio.sleep(0.05)
        after = await per_replica(service, GENERATED)
        await asyncio.sleep(0.3)
        assert await per_replica(service, GENERATED) == after  # nothing generated once the gauges fell
    finally:
        await reply.aclose()
        await long.aclose()
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert 0 < max(grown) < limit / 2, grown  # the replica that ran it stopped early
    assert conversation.turns[-1].reply_text  # kept as far as it got, for truncation


async def test_greedy_replies_equal_the_in_process_engines(remote, llm_engine):
    prompts = PROMPTS[:6]
    assert await greedy_replies(remote, prompts) == await greedy_replies(llm_engine, prompts)


async def test_the_end_of_turn_score_is_the_in_process_engines(remote, llm_engine):
    """The LLM's P(the user's turn is over) after the words so far, which ends a turn
    by meaning, comes through the service as in-process: the same figures (bf16 on
    both), from the pass that prefills the words (asked again, no new request)."""
    texts = ["What is the capital of France?", "I'd like to book a table for", "My number is 415-267-89"]
    scores = {}
    for name, backend in (("remote", remote), ("in-process", llm_engine)):
        conversation = Conversation(backend)
        try:
            scores[name] = [await conversation.end_of_turn(t) for t in texts]
            steps = backend.counters.steps
            assert await conversation.end_of_turn(texts[-1]) == scores[name][-1]
            assert backend.counters.steps == steps  # from the pass that prefilled them
        finally:
            conversation.close()
    assert all(s is not None for s in scores["remote"] + scores["in-process"]), scores
    remote_scores = [float(s or 0) for s in scores["remote"]]
    assert remote_scores == pytest.approx(scores["in-process"], abs=0.02), scores
    assert remote_scores[0] > 0.2 > max(remote_scores[1:]), scores


async def test_a_call_is_held_to_its_schema_in_the_service_and_its_result_prefills_a_block_at_most(remote):
    """Through the service, the constraint is applied there (``structured_outputs`` of
    the completion request): on a later chunk of the session, a required call of
    get_weather with valid arguments; the reply after its result prefills the result,
    its framing and at most one KV block more (the server's prefix cache is block-granular)."""
    conversation = Conversation(remote)
    conversation.set_tools(parse_tools([WEATHER], ToolLimits()))
    await conversation.prefill("What is the weather")  # the session's first chunk: no constraint
    calls: list[ToolCall] = []
    question = conversation.reply("What is the weather in Paris?", "r1", ToolChoice("required"), calls.append)
    assert "".join([d async for d in question]) == ""
    assert calls and all(c.name == "get_weather" and set(c.parsed()) == {"city"} for c in calls)
    for call in calls:
        conversation.add_result(call.call_id, json.dumps({"temp_c": 21, "sky": "sunny"}))
    results = sum(len(r.tokens) for r in conversation.pending)
    framing = len(conversation.format.assistant_close()) + len(conversation.format.assistant_header())
    answer = "".join([d async for d in conversation.reply("", "r2", ToolChoice("none"))])
    assert conversation.last.settled
    assert results + framing <= conversation.last.prefilled_tokens <= results + framing + 32, (
        conversation.last
    )
    assert "21" in answer
    conversation.close()


async def test_sessions_stay_on_their_replica(service, remote):
    """Each session's turns all go to one replica (by whose counters grew), where its
    KV is found again; sessions are spread over both."""
    homes: list[int] = []
    for s in range(8):
        conversation = Conversation(remote)
        served_by = set()
        previous = 0
        for question in QUESTIONS[s : s + 3]:
            before = await computed(service)
            await replied(conversation, question)
            stats = conversation.last
            grown = await settled(service, before, stats.prompt_tokens)
            served_by |= {i for i, (asked, _) in grown.items() if asked}
            # the earlier turns' whole blocks were found where they were left
            assert stats.cached_tokens >= previous // BLOCK * BLOCK, (s, stats, previous)
            previous = stats.prompt_tokens
        conversation.close()
        assert len(served_by) == 1, (s, served_by)
        homes.append(served_by.pop())
        if s >= 3 and len(set(homes)) == 2:
            break
    assert set(homes) == {0, 1}, homes


# -- front ends: `duplex serve --llm-url` --


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def link(service: LlmService) -> AsyncIterator[TcpLink]:
    """The way from front end A to the service; down until a test brings it up."""
    link = TcpLink(free_port(), service.port)
    yield link
    await link.down()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def front_ends(service: LlmService, link: TcpLink) -> AsyncIterator[tuple[Server, Server]]:
    a = Server(offline_env(), "--llm-url", f"http://127.0.0.1:{link.port}")
    b = Server(offline_env(), "--llm-url", service.url)
    try:
        yield a, b
        for server in (a, b):  # SIGTERM: exit 0 within 5 s, nothing left behind
            server.stop_cleanly()
    finally:
        for server in (a, b):
            server.output()


async def health(server: Server) -> tuple[int, dict[str, Any]]:
    return await asyncio.to_thread(get_health, server.port)


async def until_health(server: Server, status: int, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        assert server.proc.poll() is None, server.output()
        got, body = await health(server)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"not {status} within {within:g} s: {got} {body}"
        await asyncio.sleep(0.25)


async def turn(conversation: Any, text: str) -> tuple[pb.Metrics | None, pb.Error | None]:
    """A text turn: its reply's metrics, or the error it got instead."""
    await conversation.say(text)
    metrics = error = None
    async with asyncio.timeout(120):
        async for event in conversation:
            kind = event.WhichOneof("event")
            if kind == "metrics":
                metrics = event.metrics
            elif kind == "error":
                error = event.error
            elif kind == "turn" and event.turn.kind == pb.TurnEvent.RESPONSE_DONE:
                return metrics, error
    raise AssertionError("the conversation ended")


async def test_a_front_end_is_not_ready_until_the_llm_service_answers(front_ends, link):
    a, _ = front_ends
    await asyncio.to_thread(a.wait_listening, 120)
    deadline = time.monotonic() + 180
    while True:  # VAD, ASR and TTS load; then it waits for the LLM service
        status, body = await health(a)
        assert status == 503, body
        if (body.get("startup", {}).get("phase") or {}).get("name") == "llm_service":
            break
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.25)
    await asyncio.sleep(2)
    status, body = await health(a)
    assert status == 503 and body["status"] == "starting", body
    await link.up()
    body = await until_health(a, 200, 30)
    assert body["components"]["llm"]["state"] == "ready", body


async def test_two_front_ends_hold_conversations_on_one_llm_service(front_ends, link):
    """Both at once, each session's KV found again at its second turn."""
    a, b = front_ends
    await until_health(a, 200, 120)
    await until_health(b, 200, 300)

    async def converse(server: Server) -> list[pb.Metrics]:
        async with DuplexClient(f"127.0.0.1:{server.grpc_port}") as client:
            conversation = await client.converse()
            out = []
            for question in ("What is the capital of France?", "And of Spain?"):
                metrics, error = await turn(conversation, question)
                assert error is None and metrics is not None, error
                out.append(metrics)
            await conversation.close()
            return out

    conversations = await asyncio.gather(converse(a), converse(b))
    assert len(conversations) == 2 and all(len(c) == 2 for c in conversations)
    for first, second in conversations:
        assert second.prompt_tokens > first.prompt_tokens
        assert second.cached_tokens >= first.prompt_tokens - BLOCK, (first, second)
    for server in (a, b):  # and each front end's /metrics counts them
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
            tokens = samples(await r.text(), "duplex_llm_prompt_tokens")
        assert tokens[("duplex_llm_prompt_tokens_total", "cached")] >= BLOCK, tokens
        assert tokens[("duplex_llm_prompt_tokens_total", "prefilled")] > 0, tokens


async def test_the_llm_service_down_mid_session(front_ends, link):
    """Health says so, a turn meanwhile gets llm_unavailable, the session lives on, and
    both recover by themselves when the service is back."""
    a, _ = front_ends
    await until_health(a, 200, 120)
    async with DuplexClient(f"127.0.0.1:{a.grpc_port}") as client:
        conversation = await client.converse()
        metrics, error = await turn(conversation, "Hello!")
        assert metrics is not None and error is None
        await link.down()
        body = await until_health(a, 503, 5)
        assert body["components"]["llm"]["state"] == "unreachable", body
        metrics, error = await turn(conversation, "Are you there?")
        assert error is not None and error.code == "llm_unavailable", (metrics, error)
        await link.up()
        await until_health(a, 200, 5)
        metrics, error = await turn(conversation, "What is two plus two?")
        assert error is None and metrics is not None, error
        await conversation.close()


async def test_a_tokenizer_that_differs_from_the_services_is_refused_at_start(service, model_dir, tmp_path):
    """A local model whose tokenizer gives other ids: the front end exits 1 naming both."""
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(Path(model_dir) / name, other / name)
    assert (other / "config.json").is_file()  # the copy happened; tokenizer.json is read next
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["Hello"], vocab["Ġit"] = vocab["Ġit"], vocab["Hello"]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    server = Server(offline_env(), "--llm-url", service.url, "--llm", str(other))
    try:
        await asyncio.to_thread(server.proc.wait, 300)
    finally:
        output = server.output()
    assert server.proc.returncode == 1, output
    assert "whose tokenizer differs from the local model" in output, output
    assert str(other) in output and service.url in output, output


async def test_bench_ar_over_the_llm_service_prints_what_the_in_process_one_does(service):
    bench = await asyncio.create_subprocess_exec(
        *duplex_command("bench", "ar", "--quick", "--sessions", "1", "--llm-url", service.url),
        env=offline_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(bench.communicate(), 600)
    assert bench.returncode == 0, err.decode(errors="replace")[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert set(result) == set(AR_KEYS) and result["backend"] == service.url, result
    assert len(result["ttft_ms_by_turn"]["prefix_on"]) == len(QUESTIONS)
    assert result["eot_prefill_tokens"]["incremental"] < result["eot_prefill_tokens"]["full"], result


async def test_the_next_turn_survives_a_replica_killed_mid_reply(service, remote, front_ends):
    """The replica holding a session dies during a reply: that reply fails with a typed
    error, the next turn is answered by the other replica after one full prefill, and
    the turn after it finds its KV there; a front end before the router stays ready, and
    the replica is started again."""
    _, b = front_ends
    await until_health(b, 200, 300)  # started: not loading its models beside the replicas
    # 400 tokens were once all decoded before the kill landed (the whole story came): 1,500 fit too
    long = RunToLimit(service.url, replace(remote.config, max_tokens=1500))
    await long.start()
    try:
        await survive_a_replica_killed(service, Conversation(long))
    finally:
        await long.aclose()
    for _ in range(8):  # its probes (every second) go through the router to the survivor
        status, body = await health(b)
        assert status == 200, body
        await asyncio.sleep(0.5)
    await service.wait_ready(300)  # `serve-llm --replicas` started it again
    assert service.replica_processes(0) and service.replica_processes(1)


async def survive_a_replica_killed(service: LlmService, conversation: Conversation) -> None:
    # words of its own: no other session's KV (greedy replies repeat) is in a prefix cache
    await replied(conversation, f"Hi there, I am caller {uuid.uuid4().hex[:8]}.")
    before = await computed(service)
    await replied(conversation, "What is the capital of France?")
    grown = await settled(service, before, conversation.last.prompt_tokens)
    home = next(i for i, (asked, _) in grown.items() if asked)
    assert isinstance(conversation.engine, RunToLimit)
    conversation.engine.on = True
    reply = conversation.reply("Tell me a very long story about a dragon.")
    other = 1 - home
    try:
        async for _ in reply:
            break
        # killed at once, before anything else: once the whole 1,500-token reply came
        # before the kill landed, which followed a look at both replicas' metrics
        service.kill_replica(home)
        elsewhere = (await counters(service.replica_url(other)))[RUNNING]
        assert elsewhere == 0, (home, elsewhere)  # the session stayed on its replica (it fails below)
        after: list[str] = []
        try:
            async for delta in reply:
                after.append(delta)
        except LlmUnavailable:
            pass
        else:
            raise AssertionError(f"the reply went on after replica {home} died: {grown} {''.join(after)!r}")
    finally:
        await reply.aclose()
        conversation.engine.on = False
    before = await computed(service, (other,))  # the killed one answers nothing (restarting)
    assert (await replied(conversation, "And what is the capital of Spain?")).strip()
    stats = conversation.last
    grown = await settled(service, before, stats.prompt_tokens)
    assert grown[other][0] == stats.prompt_tokens, grown
    system = len(conversation.format.system(conversation.system_prompt))
    assert stats.prefilled_tokens >= stats.prompt_tokens - system - BLOCK, (
        stats
    )  # all again but the system prompt
    assert (await replied(conversation, "Thank you!")).strip()
    assert conversation.last.cached_tokens >= stats.prompt_tokens - BLOCK, conversation.last
