"""The AR stage with real vLLM on CPU and the default model (one engine per test session)."""

import asyncio
import contextlib
import os
import time

import pytest
import pytest_asyncio

from models.conversation import MAX_USER_CHARS, Conversation, Turn
from models.kv_stream import KvStream
from models.llm_types import LlmError

# the engine's bookkeeping: no pace, so beside the paced tests in make test (tests/lanes.py)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session"), pytest.mark.background]

BLOCK = 32  # the CPU KV cache's block: prefix reuse is this granular
OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
ENVIRONMENT_AT_IMPORT = {name: os.environ.get(name) for name in OMP_VARIABLES}  # before any engine starts


async def say(conversation: Conversation, text: str | bytes, turn_id: str = "") -> str:
    return "".join([delta async for delta in conversation.reply(text, turn_id)])


def template_tokens(conversation: Conversation, generation_prompt: bool = False) -> list[int]:
    ids = conversation.engine.tokenizer.apply_chat_template(
        conversation.messages(), tokenize=True, add_generation_prompt=generation_prompt
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


async def test_a_reply_streams_and_is_correct(llm_engine):
    conversation = Conversation(llm_engine)
    deltas = [d async for d in conversation.reply("What is the capital of France?")]
    assert len(deltas) > 1 and "Paris" in "".join(deltas)
    assert conversation.last.first_token_s is not None


async def test_the_warm_up_at_start_leaves_nothing_on_the_engines_books(llm_engine):
    # start ran one throwaway stream (the first caller must not pay vLLM's first-request
    # cost): it holds no KV and is not a stream to cancel
    for _ in range(100):
        if "warm-up" not in llm_engine._streams:
            break
        await asyncio.sleep(0.05)
    assert "warm-up" not in llm_engine._streams and "warm-up" not in llm_engine._budget


async def prefilled_by_vllm(engine, turn):
    """Run `turn` and return how many prompt tokens vLLM computed for it (its own figures)."""
    before = engine.counters.prefill_tokens
    await turn
    return engine.counters.prefill_tokens - before


async def test_later_turns_prefill_only_their_new_tokens(llm_engine):
    conversation = Conversation(llm_engine)
    close = len(conversation.format.assistant_close())
    questions = [
        "Hi!",
        "What is the capital of France?",
        "And Spain?",
        "What about Italy?",
        "Thanks.",
        "Name a color.",
        "Another one?",
        "What is two plus two?",
        "Say yes.",
        "Goodbye!",
    ]
    for n, question in enumerate(questions):
        history = len(conversation.history_tokens())
        prefilled = await prefilled_by_vllm(llm_engine, say(conversation, question))
        stats = conversation.last
        assert prefilled == stats.prefilled_tokens, (n, prefilled, stats)
        if n == 0:
            assert prefilled == stats.prompt_tokens - stats.cached_tokens
        else:
            # the new user turn, plus the previous reply's end marker: sampled, never fed back
            new_tokens = stats.prompt_tokens - history
            assert prefilled <= new_tokens + close + 1, (n, prefilled, new_tokens)
            assert stats.cached_tokens >= history - close - 1


WORDS_40 = (
    "I am planning a trip to Italy next summer with my whole family and we would love to see Rome "
    "and the old town of Florence, but my mother cannot walk very far, so could you suggest a calm "
    "route with short days and"
)


async def test_incremental_prefill_leaves_only_the_tail(llm_engine):
    ending = " good hotels near the train stations?"
    without = Conversation(llm_engine)
    await say(without, "Hello there.")
    await say(without, WORDS_40 + ending)
    conversation = Conversation(llm_engine)
    await say(conversation, "Hello there.")
    partial = ""
    for word in WORDS_40.split():  # committed words arriving while the caller speaks
        partial = f"{partial} {word}".strip()
        await conversation.prefill(partial)
    prefilled = await prefilled_by_vllm(llm_engine, say(conversation, WORDS_40 + ending))
    tail = len(conversation.format.encode(ending)) + len(conversation.format.user_close())
    assert prefilled == tail == conversation.last.prefilled_tokens
    assert prefilled <= 16
    assert without.last.prefilled_tokens > 60
    assert conversation.turns[-1].reply_text == without.turns[-1].reply_text


async def test_prefills_arriving_faster_than_they_run_coalesce(llm_engine):
    conversation = Conversation(llm_engine)
    words = WORDS_40.split()
    partials = [" ".join(words[: n + 1]) for n in range(len(words))]
    before = llm_engine.counters.prefill_tokens
    results = await asyncio.gather(*(conversation.prefill(p) for p in partials))
    sent = [r for r in results if r.prompt_tokens]
    assert 1 <= len(sent) <= 2  # the first, and the latest words that waited behind it
    assert sent[-1].prompt_tokens == len(
        conversation._prompt(conversation.format.encode(WORDS_40), close=False)
    )
    assert llm_engine.counters.prefill_tokens - before == sent[-1].prompt_tokens - sent[0].cached_tokens
    fresh = Conversation(llm_engine)
    assert await say(conversation, WORDS_40 + "?") == await say(fresh, WORDS_40 + "?")


async def test_a_revised_prefill_gives_the_same_reply_as_a_fresh_request(llm_engine):
    revised = Conversation(llm_engine)
    await revised.prefill("Please book a tape for")
    reply_revised = await say(revised, "Please book a table for two tonight.")
    fresh = Conversation(llm_engine)
    assert reply_revised == await say(fresh, "Please book a table for two tonight.")
    assert revised.history_tokens() == fresh.history_tokens()
    # rolled back to the last whole KV block before the revised word, not to the start
    assert revised.last.cached_tokens >= fresh.last.cached_tokens - BLOCK


@pytest.mark.paced  # it times the abort: 10 ms
async def test_abort_stops_the_stream_at_once_and_the_conversation_goes_on(llm_engine):
    conversation = Conversation(llm_engine)
    received = 0
    stopped_after: float | None = None
    aborted_at = 0.0
    async for _ in conversation.reply("Tell me a very long story about a dragon who bakes bread."):
        received += 1
        if received == 3:
            aborted_at = time.perf_counter()
            await conversation.abort()
    stopped_after = time.perf_counter() - aborted_at
    assert received <= 4  # at most the delta already in flight
    assert stopped_after < 0.010
    assert "Paris" in await say(conversation, "What is the capital of France?")


async def test_truncation_makes_the_next_prompt_exactly_the_cut_history(llm_engine):
    conversation = Conversation(llm_engine)
    reply = await say(conversation, "Tell me about the weather in Paris in spring.", "r1")
    heard = reply[: len(reply) // 2]
    before = conversation.history_tokens()
    assert not conversation.truncate("r0", heard)  # not the reply that is the last turn
    assert conversation.history_tokens() == before
    assert conversation.truncate("r1", heard)
    assert not conversation.truncate("r1", reply)  # a cut reply is never lengthened again
    after = conversation.history_tokens()
    common = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert conversation.turns[-1].reply_text == heard.rstrip()
    assert conversation.history_tokens() == template_tokens(conversation)  # token for token
    await say(conversation, "Go on.")
    assert conversation.last.prompt_tokens == len(template_tokens(conversation)) - len(
        conversation.turns[-1].reply_tokens
    ) - len(conversation.format.assistant_close())
    assert conversation.messages()[2]["content"] == heard.rstrip()
    # the KV up to the cut is reused (to the cache's block granularity)
    assert conversation.last.cached_tokens >= common - BLOCK + 1, (conversation.last, common)


async def test_a_reply_dropped_before_its_first_token_leaves_no_trace(llm_engine, monkeypatch):
    """A reply stopped between its turn being recorded and its first token (a speculative
    reply the caller talked through): retracted by its id, the history is as if it never
    began, and the next turn's prompt is exactly a fresh conversation's."""
    conversation = Conversation(llm_engine)
    await say(conversation, "Hello, my name is Ana.", "r1")
    history = conversation.history_tokens()
    reached = asyncio.Event()
    real_run = KvStream.run

    async def held(stream, chunk, max_tokens, ignore_eos=False, logprobs_of=None, constraint=None):
        reached.set()
        await asyncio.Event().wait()  # no token ever comes: the reply is dropped here
        async for delta in real_run(stream, chunk, max_tokens, ignore_eos, logprobs_of, constraint):
            yield delta  # pragma: no cover

    monkeypatch.setattr(KvStream, "run", held)
    task = asyncio.create_task(say(conversation, "What is the capital", "r2"))
    await reached.wait()
    assert conversation.last_turn("r2") is not None  # recorded, and no token yet
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    monkeypatch.undo()
    assert not conversation.retract("r1")  # only the last turn, by its own id
    assert conversation.retract("r2")
    assert not conversation.retract("r2")
    assert conversation.history_tokens() == history
    fresh = Conversation(llm_engine)
    await say(fresh, "Hello, my name is Ana.")
    assert conversation.prompt_for("Paris?") == fresh.prompt_for("Paris?")
    assert "Paris" in await say(conversation, "What is the capital of France?", "r3")
    assert [m["role"] for m in conversation.messages()] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert conversation.history_tokens() == template_tokens(conversation)  # token for token


async def test_concurrent_sessions_never_see_each_others_text(llm_engine):
    questions = ["What is the capital of France?", "What is the capital of Japan?"]
    alone = [await say(Conversation(llm_engine), q) for q in questions]
    together = await asyncio.gather(*(say(Conversation(llm_engine), q) for q in questions))
    assert together == alone
    assert "Paris" in together[0] and "Tokyo" in together[1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("x" * 20_000, "exceeds"),
        (b"caf\xc3 au lait", "not valid UTF-8"),
        ("broken \udce9 surrogate", "not valid UTF-8"),
    ],
)
async def test_bad_user_text_is_a_clear_error_for_that_session_only(llm_engine, text, message):
    conversation = Conversation(llm_engine)
    with pytest.raises(LlmError, match=message):
        await say(conversation, text)
    assert conversation.turns == []
    assert "Paris" in await say(conversation, "What is the capital of France?")


async def test_a_turn_too_big_for_the_context_is_refused_and_others_carry_on(llm_engine):
    conversation = Conversation(llm_engine)
    huge = " ".join(["lorem ipsum dolor sit amet"] * (MAX_USER_CHARS // 27))
    conversation.system_prompt = huge  # a system prompt alone filling the context
    conversation.system = conversation.format.system(huge * 2)
    with pytest.raises(LlmError, match="tokens"):
        await say(conversation, "Hello?")
    assert "Paris" in await say(Conversation(llm_engine), "What is the capital of France?")


async def test_long_sessions_drop_the_oldest_turns(llm_engine):
    conversation = Conversation(llm_engine)
    filler = "Please remember this sentence about nothing in particular, it is only here to take room. " * 8
    for i in range(12):
        await say(conversation, f"{filler} Turn {i}.")
        limit = llm_engine.config.max_model_len
        assert len(conversation.history_tokens()) < limit
    assert conversation.dropped_turns > 0
    assert conversation.messages()[0]["role"] == "system"
    assert conversation.history_tokens() == template_tokens(conversation)


async def test_a_full_context_is_made_room_for_while_the_caller_speaks(llm_engine):
    """The one re-prefill that dropping the oldest turns costs happens on the words
    prefilled while the caller speaks; the reply at the end of the turn sends only its
    tail. (Before: prefills stopped when the context was full and the reply re-prefilled
    the shortened history after the caller had finished.)"""
    conversation = Conversation(llm_engine)
    config = llm_engine.config
    said, answered = "Please remember that the blue box is on the shelf.", "I will remember the blue box."
    while len(conversation.history_tokens()) < config.max_model_len - config.max_tokens - 8:
        conversation.turns.append(
            Turn(said, conversation.format.encode(said), "", answered, conversation.format.encode(answered))
        )
    stats = await conversation.prefill("Where is the blue")
    assert conversation.dropped_turns > 0
    assert len(conversation.history_tokens()) <= (config.max_model_len - config.max_tokens) // 2
    assert stats.prefilled_tokens > len(conversation.history_tokens()) - BLOCK  # the shortened history, now
    reply = await say(conversation, "Where is the blue box?")
    assert reply.strip()
    assert conversation.last.prefilled_tokens < BLOCK  # the last word, the turn's end and the header
    assert conversation.history_tokens() == template_tokens(conversation)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_engine(llm_engine):
    """A second engine whose KV cache holds only 1,280 tokens: memory pressure on demand.
    Eager: its shapes (a 1,024-token context) are not the session engine's, so compiled it
    would pay a cold compile of its own, for a test of the KV's bookkeeping."""
    from models.llm import LlmConfig, LlmEngine

    engine = LlmEngine(
        LlmConfig(
            model=llm_engine.config.model, max_model_len=1024, max_tokens=24, kv_blocks=40, enforce_eager=True
        )
    )
    await engine.start()
    yield engine
    engine.shutdown()


async def test_idle_sessions_lose_their_kv_first_and_still_work(small_engine):
    filler = "Here is some background that takes room in the cache and means nothing at all. " * 18
    conversations = [Conversation(small_engine) for _ in range(4)]
    for i, conversation in enumerate(conversations):  # 4 x ~380 tokens > 1,280 in the cache
        await say(conversation, f"Session {i}. {filler} Say hello.")  # no shared prefix
    oldest, newest = conversations[0], conversations[-1]
    assert oldest._stream is not None and not oldest._stream.alive  # closed to make room
    assert newest._stream is not None and newest._stream.alive
    history_newest = len(newest.history_tokens())
    await say(newest, "Thanks.")
    assert newest.last.cached_tokens >= history_newest - BLOCK + 1  # recent: still cached
    history_oldest = len(oldest.history_tokens())
    reply = await say(oldest, "What is the capital of France?")
    assert oldest.last.cached_tokens < history_oldest - BLOCK  # idle: evicted, re-prefilled
    assert "Paris" in reply


async def test_a_kv_budget_too_small_for_one_turn_is_refused_and_others_carry_on(llm_engine):
    from models.llm import LlmConfig, LlmEngine

    # vLLM itself refuses (after loading the model) a KV cache that cannot hold one
    # request at the full context; the engine says so at once, naming the settings
    tiny = LlmEngine(LlmConfig(model=llm_engine.config.model, max_model_len=2048, kv_cache_gib=0.02))
    # 0.04 GiB for a bf16 KV cache (quantized weights), 0.09 for float32
    with pytest.raises(LlmError, match=r"llm_kv_cache_gib to at least 0\.0[49]"):
        await tiny.start()
    assert not tiny.started
    over = LlmEngine(LlmConfig(model=llm_engine.config.model, max_model_len=2048, kv_blocks=40))
    with pytest.raises(LlmError, match="holds 1280 tokens"):
        await over.start()
    assert "Paris" in await say(Conversation(llm_engine), "What is the capital of France?")


async def test_the_model_runs_in_the_engine_core_bound_as_vllm_binds_a_worker(llm_engine):
    """One process, vLLM's engine core, holds the model (no worker process), on the CPUs
    vLLM's own binding gives a worker; the environment it was started with is restored."""
    import psutil
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    names = {p.pid: p.name() for p in psutil.Process().children(recursive=True)}
    cores = [pid for pid, name in names.items() if name.startswith("VLLM::EngineCor")]
    assert cores, names  # this session's engine, and any other test's still running
    assert not [name for name in names.values() if "Worker" in name], names
    binding = OMPProcessManager(llm_engine._engine.vllm_config).cpu_lists[0]
    assert all(os.sched_getaffinity(core) == set(binding) for core in cores)
    assert {name: os.environ.get(name) for name in OMP_VARIABLES} == ENVIRONMENT_AT_IMPORT
