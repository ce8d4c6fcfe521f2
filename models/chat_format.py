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
    <|im_start|>tool\\n{result}<|im_end|>\\n             a tool's result (then the header)

The pieces come from rendering messages with marker text and splitting around the
markers, so any template of this shape (ChatML and its relatives) works. Tests check
the assembly against `apply_chat_template` token for token.

Text from outside (the caller's words, a client's instructions, tools and their
results) goes through one function, `encode`: the template's control strings in it
(``<|im_end|>``, ``<|im_start|>system``) stay plain text, tokenized like any other
characters, so no text can close its turn or open another. Only the template's own
pieces are encoded with their control tokens (`_piece`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.tools import Tool, tools_text

_MARK = "\u2063MARK\u2063"  # invisible separator: will not merge with template text


@dataclass(frozen=True)
class ChatFormat:
    system_prefix: str
    system_suffix: str
    user_prefix: str
    user_suffix: str  # includes the assistant header that follows every user turn
    assistant_end: str  # after the reply's tokens
    tokenizer: Any
    header: str = ""  # the assistant header, which ends user_suffix
    tool_prefix: str | None = None  # a tool result's block; None: the template has no tool role
    tool_suffix: str = ""
    tools_branch: bool = False  # the template shows tools itself (`apply_chat_template(tools=)`)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        def render(messages: list[dict[str, str]], generation_prompt: bool, **kwargs: Any) -> str:
            text: str = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
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
        without_header = render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], False)
        header = prompt[len(without_header) :]
        assert user_suffix.endswith(header), "chat template: the user turn does not end with the header"
        tool_prefix, tool_suffix = None, ""
        try:
            with_result = render(
                [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U"},
                    {"role": "assistant", "content": "A"},
                    {"role": "tool", "content": _MARK},
                ],
                True,
            )
            tool_prefix, rest = with_result[len(with_reply.replace(_MARK, "A")) :].split(_MARK)
            assert rest.endswith(header)
            tool_suffix = rest[: len(rest) - len(header)]
        except Exception:  # the template has no tool role: tools cannot be declared
            tool_prefix = None
        probe = Tool("probe", "", {"type": "object", "properties": {}}).declaration()
        tools_branch = render([{"role": "system", "content": _MARK}], False, tools=[probe]) != system
        return cls(
            system_prefix,
            system_suffix,
            user_prefix,
            user_suffix,
            assistant_end,
            tokenizer,
            header,
            tool_prefix,
            tool_suffix,
            tools_branch,
        )

    def encode(self, text: str) -> list[int]:
        """Text from outside as token ids: the one way in for it. Control strings of the
        template in it stay plain text (``split_special_tokens``)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        return ids

    def _piece(self, template_text: str) -> list[int]:
        """The template's own text, with its control tokens."""
        ids: list[int] = self.tokenizer.encode(template_text, add_special_tokens=False)
        return ids

    def system(self, text: str, tools: tuple[Tool, ...] = ()) -> list[int]:
        """The system block: the instructions, then the tools (`tools_block`)."""
        body = self.encode(text) if text else []
        if tools:
            body += self.encode(self.tools_block(tools))
        return self._piece(self.system_prefix) + body + self._piece(self.system_suffix)

    def tools_block(self, tools: tuple[Tool, ...]) -> str:
        """What follows the instructions in the system turn to show the tools: the
        template's own rendering where it has a tools branch, else the Hermes block."""
        if self.tools_branch:
            rendered: str = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": _MARK}],
                tokenize=False,
                add_generation_prompt=False,
                tools=[tool.declaration() for tool in tools],
            )
            before, after = rendered.split(_MARK)
            if before == self.system_prefix and after.endswith(self.system_suffix):
                return after[: len(after) - len(self.system_suffix)]
        return tools_text(tools)

    def user_open(self) -> list[int]:
        return self._piece(self.user_prefix)

    def user_close(self) -> list[int]:
        """End of the user turn and the assistant header: what follows the user's words."""
        return self._piece(self.user_suffix)

    def assistant_close(self) -> list[int]:
        return self._piece(self.assistant_end)

    def assistant_header(self) -> list[int]:
        return self._piece(self.header)

    def tool_result(self, text: str) -> list[int]:
        """A tool's result as its own turn (the header follows the last of a round's)."""
        if self.tool_prefix is None:
            raise ValueError("this model's chat template has no tool role")
        return self._piece(self.tool_prefix) + self.encode(text) + self._piece(self.tool_suffix)
