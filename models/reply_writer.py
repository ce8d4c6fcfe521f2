"""`ReplyWriter`: one reply as it streams, written into its turn.

The reply's text is split as it comes (`models.tools.CallReader`): the words go to the
turn's spoken text and tokens, a call's markup to its call tokens (kept apart, so that a
truncation to the heard words keeps the calls), and each call, once whole, to the turn's
calls and to whoever is told of calls, unless the same call was made already since the
user last spoke (``made``: a small model asked for a call may write it twice).
"""

from __future__ import annotations

from collections.abc import Callable

from models.llm_types import Delta
from models.tools import CallReader, ToolCall
from models.turn_record import Turn


class ReplyWriter:
    def __init__(
        self,
        turn: Turn,
        stop_ids: set[int],
        made: set[tuple[str, str]],
        on_call: Callable[[ToolCall], None] | None,
    ) -> None:
        self.turn = turn
        self._stop_ids = stop_ids
        self._made = made
        self._on_call = on_call
        self._reader = CallReader()
        self._kept = 0  # the call tokens up to the end of the last call made
        # it wrote a call made already: a model held to calls (`required`) goes on
        # repeating it until its tokens run out (20 s at the bundled model's pace), and the
        # answer waits for the reply's end: it ends here
        self.repeated = False

    def take(self, delta: Delta) -> str:
        """One delta into the turn; the text to speak."""
        turn, reader = self.turn, self._reader
        was_markup = reader.in_markup
        spoken, events = reader.feed(delta.text)
        ids = [t for t in delta.token_ids if t not in self._stop_ids]
        if was_markup or reader.in_markup:
            turn.call_tokens += ids
        else:
            turn.reply_tokens += ids
        for event in events:
            if not event.done:
                continue
            if event.call.key() in self._made:  # not made again, and out of the history
                turn.call_tokens = turn.call_tokens[: self._kept]
                self.repeated = True
                continue
            self._made.add(event.call.key())
            self._kept = len(turn.call_tokens)
            turn.calls.append(event.call)
            if self._on_call is not None:
                self._on_call(event.call)
        turn.reply_text += spoken
        return spoken

    def spoken(self, tokens: int) -> bool:
        """The reply has said ``tokens`` tokens of words, and is not inside a call."""
        return not self._reader.in_markup and len(self.turn.reply_tokens) >= tokens

    def finish(self) -> None:
        """The reply ended (or stopped): what it held back was no words, and a call cut
        off inside its markup was never made."""
        self._reader.finish()
        if self._reader.in_markup and not self.turn.calls:
            self.turn.call_tokens = []
