"""`Conversation`: one session's dialogue, kept as the exact token sequence of its KV.

Every turn's prompt is the previous prompt, the reply's generated token ids, and the
new user turn (see `models.chat_format`), so vLLM's prefix cache finds the earlier
turns' KV and only the new tokens are prefilled (to the cache's block granularity).

    [system][user 1][reply 1][user 2][reply 2] ... [user N]      prompt of turn N
    '--------------- cached by earlier turns ----'  '- new -'

While the caller speaks, `prefill` sends the committed words ahead as a one-token
request, so their KV is in the cache when the turn ends. After a barge-in,
`truncate` cuts the last reply to the text the caller heard: the history (and so the
next prompt) holds exactly that text, and the KV up to the cut is reused.

Long sessions: when a prompt would not leave room for a reply, the oldest turns are
dropped (the system prompt stays) until the history fills at most half the context,
so the one re-prefill this costs happens rarely.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from models.llm import LlmEngine, LlmError

MAX_USER_CHARS = 4000  # ~1,000 tokens: more than anyone says in one breath


@dataclass
class Turn:
    user_text: str
    user_tokens: list[int]
    reply_text: str = ""
    reply_tokens: list[int] = field(default_factory=list)


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_s: float | None = None

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

    def __init__(self, engine: LlmEngine, system_prompt: str | None = None) -> None:
        assert engine.chat_format is not None, "start the engine before making conversations"
        self.engine = engine
        self.format = engine.chat_format
        self.system_prompt = engine.config.system_prompt if system_prompt is None else system_prompt
        self._system = self.format.system(self.system_prompt)
        self._user_open = self.format.user_open()
        self._user_close = self.format.user_close()
        self._assistant_close = self.format.assistant_close()
        self._stop_ids = {engine.tokenizer.eos_token_id, *self._assistant_close[:1]}
        self.turns: list[Turn] = []
        self.session = f"conv{next(self._ids)}"
        self._requests = itertools.count()
        self._active: str | None = None
        self.last = TurnStats()
        self.dropped_turns = 0

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

    # -- turns --

    async def prefill(self, partial_text: str) -> TurnStats:
        """Put the KV of the user's words so far in the cache (one throwaway token)."""
        text = partial_text.strip()
        if not text:
            return TurnStats()
        tokens = self.format.encode(text)
        prompt = self._prompt(tokens, close=False)
        if len(prompt) + 1 > self.engine.config.max_model_len:
            return TurnStats()  # the final turn will make room
        stats = TurnStats(prompt_tokens=len(prompt))
        async for delta in self.engine.generate(
            f"{self.session}-p{next(self._requests)}", prompt, max_tokens=1
        ):
            stats.cached_tokens = delta.cached_tokens
        return stats

    async def reply(self, user_text: str | bytes) -> AsyncIterator[str]:
        """Add the user's turn and stream the reply's text deltas.

        The reply is recorded as it streams, so an interrupted reply is in the
        history as far as it got (until `truncate` cuts it to what was heard).
        """
        text = check_user_text(user_text)
        tokens = self.format.encode(text)
        self._make_room(tokens)
        prompt = self._prompt(tokens)
        turn = Turn(text, tokens)
        self.turns.append(turn)
        request_id = f"{self.session}-r{next(self._requests)}"
        self._active = request_id
        self.last = TurnStats(prompt_tokens=len(prompt))
        started = time.perf_counter()
        try:
            async for delta in self.engine.generate(request_id, prompt):
                if self.last.first_token_s is None:
                    self.last.first_token_s = time.perf_counter() - started
                    self.last.cached_tokens = delta.cached_tokens
                turn.reply_tokens += [t for t in delta.token_ids if t not in self._stop_ids]
                turn.reply_text += delta.text
                if delta.text:
                    yield delta.text
        except LlmError:
            self.turns.remove(turn)
            raise
        finally:
            self._active = None

    async def abort(self) -> None:
        """Stop the reply in progress (its stream ends); the conversation stays usable."""
        if self._active is not None:
            await self.engine.abort(self._active)

    def truncate(self, heard_text: str) -> None:
        """Cut the last reply to the text the caller heard (a prefix of what was generated)."""
        assert self.turns, "truncate without a reply"
        turn = self.turns[-1]
        heard = heard_text.rstrip()
        assert turn.reply_text.startswith(heard), "heard text is not a prefix of the reply"
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
