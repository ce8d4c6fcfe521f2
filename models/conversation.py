"""`Conversation`: one session's dialogue, kept as the exact token sequence of its KV.

The conversation keeps the token bookkeeping; its backend (`models.llm_backend`) owns
how the tokens reach a KV cache. In-process, the session's KV lives in one resumable
vLLM request (`models.kv_stream.KvStream`) that only ever grows: each turn sends just
what the KV lacks, so nothing said before is prefilled again, to the token. Remote
(`models.remote_llm`), each chunk is a request for the whole sequence, and the
server's prefix cache supplies the KV of what the session sent before, to its last
whole block:

    [system][user 1][reply 1][user 2][reply 2] ... [user N][header]   prompt of turn N
    '---------- in the stream's KV ---------------'  '---- chunk ----'

While the caller speaks, `prefill` appends the committed words as they come (a chunk
with one throwaway token), so at the end of the turn only the last words and the
assistant header remain. When the KV holds something the history no longer starts
with (ASR revised a prefilled word, `truncate` cut a reply after a barge-in, or an
aborted reply), the stream is closed and a new one sends the whole prompt: vLLM's
prefix cache then supplies the KV up to the last whole 32-token block before the
divergence, and only the rest is prefilled.

Tools (`models.tools`): a reply may end in calls (``turn.calls``; their markup's
tokens are kept apart from the spoken reply's, so a truncation to the heard words keeps
them); the client's results (`add_result`) open the next turn, as tool turns before
its user words if any, and that turn's reply follows on from them: only the results
and the header are prefilled.

    ... [reply 1: words <tool_call>...</tool_call>][result][result][header] reply 2

Long sessions: when a prompt would not leave room for a reply, the oldest turns are
dropped (the system prompt stays) until the history fills at most half the context,
so the one re-prefill this costs happens rarely, and while the caller speaks: the
first prefill of words that would not leave room makes it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from models.llm_backend import LlmBackend, TokenStream
from models.llm_types import Constraint, Delta, LlmError
from models.reply_writer import ReplyWriter
from models.tools import Tool, ToolCall, ToolChoice, ToolError, structural_tag
from models.turn_record import ToolResult, Turn

MAX_USER_CHARS = 4000  # ~1,000 tokens: more than anyone says in one breath
CALL_TOKENS = 256  # what a reply that may call a tool gets beyond the spoken reply's limit
# With tools, a reply says something (or calls): the bundled model, shown a result or held
# from calling, often ends at once, and an empty result left the caller in silence.
MIN_ANSWER_TOKENS = 2


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    # already in the stream's KV, or found in vLLM's prefix cache; until `settled`, the
    # tokens the session sent before (a remote server says with the request's last delta)
    cached_tokens: int = 0
    first_token_s: float | None = None
    settled: bool = False  # cached_tokens is the LLM's own figure
    end_of_turn: float | None = None  # a prefill's: P(the user's message ends after its words)
    result_tokens: int = 0  # tool results in the prompt (prefilled: the KV had the rest)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def check_user_text(text: str | bytes) -> str:
    """The user's words, or `LlmError` saying why they cannot be a turn."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LlmError(f"user text is not valid UTF-8: {e}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates from a lenient decoder upstream
        raise LlmError(f"user text is not valid UTF-8: {e}") from None
    text = text.strip()
    if not text:
        raise LlmError("user text is empty")
    if len(text) > MAX_USER_CHARS:
        raise LlmError(f"user text of {len(text)} characters exceeds {MAX_USER_CHARS}")
    return text


class Conversation:
    _ids = itertools.count()

    def __init__(self, engine: LlmBackend, system_prompt: str | None = None) -> None:
        assert engine.chat_format is not None, "start the engine before making conversations"
        self.engine = engine
        self.format = engine.chat_format
        self.tools: tuple[Tool, ...] = ()
        self._constraints: dict[ToolChoice, str | None] = {}  # a choice's structural tag, per tool set
        self.set_system_prompt(system_prompt)
        self._user_open = self.format.user_open()
        self._user_close = self.format.user_close()
        self._assistant_close = self.format.assistant_close()
        self._stop_ids = {engine.tokenizer.eos_token_id, *self._assistant_close[:1]}
        self.turns: list[Turn] = []
        self.session = f"conv{next(self._ids)}"
        self._requests = itertools.count()
        self._stream: TokenStream | None = None
        self._lock = asyncio.Lock()  # one chunk at a time on the stream
        self._prefill_wanted = 0  # the latest prefill call; older ones give way
        self._replying = False
        self.last = TurnStats()
        self.dropped_turns = 0
        self._scored: tuple[list[int], float] | None = None  # (prefix, P(user's turn ends after it))
        self.pending: list[ToolResult] = []  # results for the next turn

    def set_system_prompt(self, system_prompt: str | None) -> None:
        """New instructions from the next turn on (the KV is re-prefilled once: the
        history no longer starts with what it holds)."""
        self.system_prompt = self.engine.config.system_prompt if system_prompt is None else system_prompt
        self.system = self.format.system(self.system_prompt, self.tools)  # its tokens (with the tools)

    def set_tools(self, tools: tuple[Tool, ...]) -> None:
        """The tools the model is shown from the next turn on (in the system block: a
        change re-prefills the KV once, like new instructions)."""
        if tools and self.format.tool_prefix is None:
            raise ToolError("this model's chat template has no tool role: it cannot take tools")
        system = self.format.system(self.system_prompt, tools)
        config = self.engine.config  # the system block may take half of what a turn leaves
        room = (config.max_model_len - config.max_tokens - CALL_TOKENS) // 2
        if tools and len(system) > room:
            raise ToolError(
                f"the instructions and tools are {len(system)} tokens, more than the {room} "
                "this model's context leaves them"
            )
        self.tools = tools
        self.system = system
        self._constraints.clear()

    def constraint_for(self, choice: ToolChoice) -> str | None:
        """The structural tag of replies under ``choice``, made once per tool set."""
        if choice not in self._constraints:
            self._constraints[choice] = structural_tag(self.tools, choice)
        return self._constraints[choice]

    # -- the token sequence --

    def _question(self, turn: Turn) -> list[int]:
        """What opens a turn: its tool results, then the user's words and the header."""
        tokens = [t for result in turn.results for t in result.tokens]
        if turn.user_tokens or not turn.results:
            return tokens + self._user_open + turn.user_tokens + self._user_close
        return tokens + self.format.assistant_header()

    def history_tokens(self) -> list[int]:
        tokens = list(self.system)
        for turn in self.turns:
            tokens += self._question(turn)
            tokens += turn.reply_tokens + turn.call_tokens + self._assistant_close
        return tokens

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}]
        for turn in self.turns:
            out += [{"role": "tool", "tool_call_id": r.call_id, "content": r.text} for r in turn.results]
            if turn.user_tokens or not turn.results:
                out.append({"role": "user", "content": turn.user_text})
            reply: dict[str, Any] = {"role": "assistant", "content": turn.reply_text}
            if turn.calls:
                reply["tool_calls"] = [
                    {"id": c.call_id, "type": "function", "function": c.function()} for c in turn.calls
                ]
            out.append(reply)
        return out

    def prompt_for(self, user_text: str) -> list[int]:
        """The prompt a turn with this text would send (nothing is recorded)."""
        return self._prompt(self.format.encode(check_user_text(user_text)))

    def _prompt(self, user_tokens: list[int], close: bool = True) -> list[int]:
        opening = self._question(Turn("", user_tokens, results=self.pending))
        if not close and (user_tokens or not self.pending):
            opening = opening[: len(opening) - len(self._user_close)]
        return self.history_tokens() + opening

    # -- tools --

    def call(self, call_id: str) -> ToolCall | None:
        return next((c for turn in self.turns for c in turn.calls if c.call_id == call_id), None)

    def answered(self, call_id: str) -> bool:
        return any(r.call_id == call_id for turn in self.turns for r in turn.results) or any(
            r.call_id == call_id for r in self.pending
        )

    def add_result(self, call_id: str, output: str) -> None:
        """The client's result for one of the model's calls: it opens the next turn.
        `ToolError` (``invalid_call_id``) for a call never made or already answered."""
        if self.call(call_id) is None:
            raise ToolError(f"no call {call_id!r} in this conversation", "invalid_call_id")
        if self.answered(call_id):
            raise ToolError(f"call {call_id!r} has its result already", "invalid_call_id")
        self.pending.append(ToolResult(call_id, output, self.format.tool_result(output)))

    def _user_turn(self) -> list[Turn]:
        """The turns since the user last spoke: tool rounds of one question."""
        since = next((i for i in range(len(self.turns) - 1, -1, -1) if self.turns[i].user_tokens), 0)
        return self.turns[since:]

    def outstanding(self) -> list[ToolCall]:
        """Every call still without a result (a caller who cut in may have left one)."""
        return [c for t in self.turns for c in t.calls if not self.answered(c.call_id)]

    def unanswered(self) -> list[ToolCall]:
        """The last reply's calls still waiting for a result."""
        last = self.turns[-1].calls if self.turns else []
        return [c for c in last if not self.answered(c.call_id)]

    def _make_room(self, user_tokens: list[int]) -> None:
        limit = self.engine.config.max_model_len - self.engine.config.max_tokens
        needed = len(self._prompt(user_tokens))
        if needed <= limit:
            return
        while self.turns and needed > limit // 2:
            dropped = self.turns.pop(0)
            needed -= len(self._question(dropped)) + len(dropped.reply_tokens) + len(dropped.call_tokens)
            needed -= len(self._assistant_close)
            self.dropped_turns += 1
        if needed > limit:
            raise LlmError(f"this turn alone needs {needed} tokens, more than the {limit} available")

    # -- the stream --

    def _stream_for(self, target: list[int]) -> tuple[TokenStream, list[int]]:
        """The stream to extend towards `target`, and what its KV still lacks of it."""
        stream = self._stream
        if stream is not None and stream.alive:
            held = stream.tokens
            if len(held) <= len(target) and target[: len(held)] == held:
                return stream, target[len(held) :]
            stream.close()  # the KV holds what the history no longer says
        request_id = f"{self.session}-s{next(self._requests)}"
        self._stream = stream = self.engine.open_stream(request_id, self.session)
        return stream, list(target)

    async def _run(
        self,
        target: list[int],
        stats: TurnStats,
        max_tokens: int,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Bring the stream's KV to `target` and stream what is sampled after it."""
        stream, chunk = self._stream_for(target)
        stats.prompt_tokens = len(target)
        stats.cached_tokens = len(target) - len(chunk)
        stats.settled = stream.resumes or not chunk  # else a new request: the server will say
        if not chunk:
            return
        started = time.perf_counter()
        run = stream.run(chunk, max_tokens, logprobs_of=logprobs_of, constraint=constraint)
        async with aclosing(run) as deltas:
            async for delta in deltas:  # (closed with this generator: a chunk stopped early ends at once)
                if stats.first_token_s is None:
                    stats.first_token_s = time.perf_counter() - started
                if not stats.settled and delta.cached_tokens is not None:
                    stats.cached_tokens = delta.cached_tokens  # what the prefix cache held
                    stats.settled = True
                yield delta

    def close(self) -> None:
        """The session is over: its KV goes back to vLLM's prefix cache."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    # -- turns --

    async def prefill(self, partial_text: str, latest: bool = True) -> TurnStats:
        """Put the KV of the user's words so far in the stream (one throwaway token).

        Calls that arrive while one is running coalesce: only the latest words are sent
        (``latest=False``: this call's words are sent even if newer ones came meanwhile).
        The pass also yields how likely the turn ends after the words (`end_of_turn`).
        """
        text = partial_text.strip()
        if not text:
            return TurnStats()
        self._prefill_wanted += 1
        mine = self._prefill_wanted
        async with self._lock:
            if latest and mine != self._prefill_wanted:
                return TurnStats()  # newer words (or the turn's end) came while waiting
            tokens = self.format.encode(text)
            try:  # room made now is re-prefilled while the caller speaks, not after
                self._make_room(tokens)
            except LlmError:
                return TurnStats()  # the words alone are too long: the turn will say so
            target = self._prompt(tokens, close=False)
            stats = TurnStats()
            close = self._user_close[0]
            async for delta in self._run(target, stats, max_tokens=1, logprobs_of=[close]):
                if delta.logprobs is not None and close in delta.logprobs:
                    self._scored = (target, math.exp(delta.logprobs[close]))
            scored = self._scored  # this pass's, or the one whose KV held the words already
            stats.end_of_turn = scored[1] if scored is not None and scored[0] == target else None
            return stats

    async def end_of_turn(self, words: str) -> float | None:
        """How likely the user's turn is over after these words: the probability the LLM
        gives the chat format's end of the user's message right after them. It comes from
        the pass that prefills the words (this one, or an earlier one whose KV holds them
        already), so it costs no pass of its own. None if the LLM could not say (it is
        out, or the words do not fit in the context)."""
        return (await self.prefill(words, latest=False)).end_of_turn

    async def reply(
        self,
        user_text: str | bytes,
        turn_id: str = "",
        choice: ToolChoice | None = None,
        on_call: Callable[[ToolCall], None] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Add the user's turn (and the tool results waiting, if any: then the text may
        be empty) and stream the reply's spoken text deltas.

        With tools declared the reply is held to ``choice`` (`models.tools`); each call
        is told to ``on_call`` once written whole (a call the same as one made earlier
        since the user last spoke is not made again), and none appears in the text.
        The turn is recorded, under ``turn_id``, before the first token is asked for,
        and the reply as it streams, so an interrupted reply is in the history as far
        as it got (until `truncate` cuts it to what was heard). Whoever stops a reply
        names it by ``turn_id`` (`retract`, `truncate`): whether it got as far as being
        recorded, or a first token, is the conversation's business.
        """
        if self.pending and not (user_text.strip() if isinstance(user_text, str) else user_text.strip()):
            text, tokens = "", []
        else:
            text = check_user_text(user_text)
            tokens = self.format.encode(text)
        self._prefill_wanted += 1  # prefills still waiting are for this turn's words: drop them
        async with self._lock:
            self._make_room(tokens)
            prompt = self._prompt(tokens)
            turn = Turn(text, tokens, turn_id, results=self.pending)
            self.pending = []
            self.turns.append(turn)
            self.last = TurnStats(result_tokens=sum(len(r.tokens) for r in turn.results))
            self._replying = True
            choice = choice or ToolChoice()
            if turn.results and choice.mode in ("required", "named"):
                choice = ToolChoice()  # a reply to results may speak: a forced call would loop
            tag = self.constraint_for(choice)
            least = MIN_ANSWER_TOKENS if self.tools or turn.results else 0
            words = self.engine.config.max_tokens  # what a reply may say; a call gets more room
            limit = words + (CALL_TOKENS if tag is not None and choice.mode != "none" else 0)
            # not made again: a call of this question's, or one still waiting for its result
            made = {c.key() for c in [*(c for t in self._user_turn() for c in t.calls), *self.outstanding()]}
            writer = ReplyWriter(turn, self._stop_ids, made, on_call)
            try:
                run = self._run(prompt, self.last, limit, constraint=Constraint(tag, least))
                async with aclosing(run) as deltas:
                    async for delta in deltas:
                        spoken = writer.take(delta)
                        if spoken:
                            yield spoken
                        if limit > words and writer.spoken(words):
                            break  # the spoken reply's bound, whatever room a call was given
                        if writer.repeated:
                            break
            except LlmError:
                self.turns.remove(turn)
                self.pending = turn.results + self.pending
                raise
            finally:
                self._replying = False
                writer.finish()

    async def abort(self) -> None:
        """Stop the reply in progress (its stream ends); the conversation stays usable."""
        if self._replying and self._stream is not None:
            await self.engine.abort(self._stream.request_id)

    def last_turn(self, turn_id: str) -> Turn | None:
        """The last turn, if the reply ``turn_id`` began it (earlier turns are settled:
        changing one would re-prefill everything after it)."""
        return self.turns[-1] if self.turns and self.turns[-1].id == turn_id else None

    def retract(self, turn_id: str) -> bool:
        """Forget the turn the reply ``turn_id`` began, question and reply (a reply begun
        speculatively, at a pause the caller then talked through), if it was recorded;
        the KV follows at the next turn. Whether it was."""
        turn = self.last_turn(turn_id)
        if turn is None:
            return False
        self.turns.pop()
        self.pending = turn.results + self.pending  # they wait for the next turn again
        return True

    def truncate(self, turn_id: str, heard_text: str) -> bool:
        """Cut the reply ``turn_id`` to the text the caller heard, if it is the last turn
        and the text a prefix of it (a reply is cut shorter, never lengthened). Whether
        it was cut."""
        turn = self.last_turn(turn_id)
        heard = heard_text.rstrip()
        if turn is None or not turn.reply_text.startswith(heard):
            return False
        # keep the generated tokens that fit inside the heard text, so their KV is reused
        keep = 0
        tokenizer = self.engine.tokenizer
        while keep < len(turn.reply_tokens) and heard.startswith(
            tokenizer.decode(turn.reply_tokens[: keep + 1], skip_special_tokens=True)
        ):
            keep += 1
        kept_text = tokenizer.decode(turn.reply_tokens[:keep], skip_special_tokens=True)
        turn.reply_tokens = turn.reply_tokens[:keep] + self.format.encode(heard[len(kept_text) :])
        turn.reply_text = heard
        return True

    def forget(self, turn_id: str, user_text: str | None = None, reply: bool = False) -> bool:
        """Take a client's deleted item out of the turn ``turn_id``: one of the user
        messages it answered (``user_text``, as it was given: a turn's question is its
        messages joined by newlines) and/or its reply. A turn left with neither goes;
        one left with one keeps the other, beside an empty message. Earlier turns may
        change too (a client deletes what it likes): the KV follows at the next turn,
        as the history no longer starts with what the stream holds. Whether anything
        was taken out."""
        turn = next((t for t in self.turns if t.id == turn_id), None)
        if turn is None or (self._replying and turn is self.turns[-1]):
            return False  # dropped to make room, never recorded, or still being generated
        changed = False
        if user_text is not None:
            lines, gone = turn.user_text.split("\n"), user_text.split("\n")
            at = next((i for i in range(len(lines)) if lines[i : i + len(gone)] == gone), None)
            if at is not None:
                turn.user_text = "\n".join(lines[:at] + lines[at + len(gone) :]).strip()
                turn.user_tokens = self.format.encode(turn.user_text) if turn.user_text else []
                changed = True
        if reply and (turn.reply_text or turn.reply_tokens):
            turn.reply_text, turn.reply_tokens = "", []
            changed = True
        if not turn.user_text and not turn.reply_tokens:
            self.turns.remove(turn)
        return changed
