"""The token layout of a chat, built turn by turn so that the KV cache can be reused.

A conversation's prompt must be a token-for-token extension of the previous turn's
prompt and reply, or vLLM cannot reuse the cached KV. Rendering the whole history
with the chat template at every turn does not guarantee that (a reply re-tokenized
from its text may split differently from the tokens the model generated), so the
prompt is assembled here from fixed pieces cut out of the model's own chat template,
with the reply's generated token ids kept as they were:

    <|im_start|>system\\n{system}<|im_end|>\\n          system block
    <|im_start|>user\\n{text}<|im_end|>\\n               user block
    <|im_start|>assistant\\n                            assistant header
    {generated ids}<|im_end|>\\n                        reply and assistant end

The pieces come from rendering messages with marker text and splitting around the
markers, so any template of this shape (ChatML and its relatives) works. Tests check
the assembly against `apply_chat_template` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MARK = "\u2063MARK\u2063"  # invisible separator: will not merge with template text


@dataclass(frozen=True)
class ChatFormat:
    system_prefix: str
    system_suffix: str
    user_prefix: str
    user_suffix: str  # includes the assistant header that follows every user turn
    assistant_end: str  # after the reply's tokens
    tokenizer: Any

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
            text: str = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            return text

        system = render([{"role": "system", "content": _MARK}], False)
        one_turn = render([{"role": "system", "content": "S"}, {"role": "user", "content": _MARK}], True)
        head = render([{"role": "system", "content": "S"}], False)
        assert one_turn.startswith(head), "chat template: a user turn does not extend the system block"
        with_reply = render(
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": _MARK},
            ],
            False,
        )
        prompt = render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], True)
        assert with_reply.startswith(prompt), "chat template: the reply does not extend the generation prompt"
        system_prefix, system_suffix = system.split(_MARK)
        user_prefix, user_suffix = one_turn[len(head) :].split(_MARK)
        reply_prefix, assistant_end = with_reply[len(prompt) :].split(_MARK)
        assert reply_prefix == "", f"chat template puts {reply_prefix!r} between header and reply"
        return cls(system_prefix, system_suffix, user_prefix, user_suffix, assistant_end, tokenizer)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def system(self, text: str) -> list[int]:
        return self.encode(self.system_prefix + text + self.system_suffix)

    def user_open(self) -> list[int]:
        return self.encode(self.user_prefix)

    def user_close(self) -> list[int]:
        """End of the user turn and the assistant header: what follows the user's words."""
        return self.encode(self.user_suffix)

    def assistant_close(self) -> list[int]:
        return self.encode(self.assistant_end)
