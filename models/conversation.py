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
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from models.llm_backend import LlmBackend, TokenStream
from models.llm_types import Delta, LlmError

MAX_USER_CHARS = 4000  # ~1,000 tokens: more than anyone says in one breath


@dataclass
class Turn:
    user_text: str
    user_tokens: list[int]
    id: str = ""  # the caller's name for the reply that began this turn (a response id)
    reply_text: str = ""
    reply_tokens: list[int] = field(default_factory=list)


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    # already in the stream's KV, or found in vLLM's prefix cache; until `settled`, the
    # tokens the session sent before (a remote server says with the request's last delta)
    cached_tokens: int = 0
    first_token_s: float | None = None
    settled: bool = False  # cached_tokens is the LLM's own figure
    end_of_turn: float | None = None  # a prefill's: P(the user's message ends after its words)

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

    def set_system_prompt(self, system_prompt: str | None) -> None:
        """New instructions from the next turn on (the KV is re-prefilled once: the
        history no longer starts with what it holds)."""
        self.system_prompt = self.engine.config.system_prompt if system_prompt is None else system_prompt
        self._system = self.format.system(self.system_prompt)

    # -- the token sequence --

    def history_tokens(self) -> list[int]:
        tokens = list(self._system)
        for turn in self.turns:
            tokens += self._user_open + turn.user_tokens + self._user_close
            tokens += turn.reply_tokens + self._assistant_close
        return tokens

    def messages(self) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system_prompt}]
        for turn in self.turns:
            out += [
                {"role": "user", "content": turn.user_text},
                {"role": "assistant", "content": turn.reply_text},
            ]
        return out

    def prompt_for(self, user_text: str) -> list[int]:
        """The prompt a turn with this text would send (nothing is recorded)."""
        return self._prompt(self.format.encode(check_user_text(user_text)))

    def _prompt(self, user_tokens: list[int], close: bool = True) -> list[int]:
        return self.history_tokens() + self._user_open + user_tokens + (self._user_close if close else [])

    def _make_room(self, user_tokens: list[int]) -> None:
        limit = self.engine.config.max_model_len - self.engine.config.max_tokens
        needed = len(self._prompt(user_tokens))
        if needed <= limit:
            return
        framing = len(self._user_open) + len(self._user_close) + len(self._assistant_close)
        while self.turns and needed > limit // 2:
            dropped = self.turns.pop(0)
            needed -= framing + len(dropped.user_tokens) + len(dropped.reply_tokens)
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
        self, target: list[int], stats: TurnStats, max_tokens: int, logprobs_of: list[int] | None = None
    ) -> AsyncIterator[Delta]:
        """Bring the stream's KV to `target` and stream what is sampled after it."""
        stream, chunk = self._stream_for(target)
        stats.prompt_tokens = len(target)
        stats.cached_tokens = len(target) - len(chunk)
        stats.settled = stream.resumes or not chunk  # else a new request: the server will say
        if not chunk:
            return
        started = time.perf_counter()
        async for delta in stream.run(chunk, max_tokens, logprobs_of=logprobs_of):
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

    async def reply(self, user_text: str | bytes, turn_id: str = "") -> AsyncGenerator[str, None]:
        """Add the user's turn and stream the reply's text deltas.

        The turn is recorded, under ``turn_id``, before the first token is asked for,
        and the reply as it streams, so an interrupted reply is in the history as far
        as it got (until `truncate` cuts it to what was heard). Whoever stops a reply
        names it by ``turn_id`` (`retract`, `truncate`): whether it got as far as being
        recorded, or a first token, is the conversation's business.
        """
        text = check_user_text(user_text)
        tokens = self.format.encode(text)
        self._prefill_wanted += 1  # prefills still waiting are for this turn's words: drop them
        async with self._lock:
            self._make_room(tokens)
            prompt = self._prompt(tokens)
            turn = Turn(text, tokens, turn_id)
            self.turns.append(turn)
            self.last = TurnStats()
            self._replying = True
            try:
                async for delta in self._run(prompt, self.last, self.engine.config.max_tokens):
                    turn.reply_tokens += [t for t in delta.token_ids if t not in self._stop_ids]
                    turn.reply_text += delta.text
                    if delta.text:
                        yield delta.text
            except LlmError:
                self.turns.remove(turn)
                raise
            finally:
                self._replying = False

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
        if self.last_turn(turn_id) is None:
            return False
        self.turns.pop()
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
