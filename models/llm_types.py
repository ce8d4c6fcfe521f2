"""What the LLM modules hand each other and their callers: errors, deltas, counters.

Its own module so that imports point one way: `models.kv_stream` and
`models.llm_stats` need these types but not the engine, and `models.llm` imports them.
Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LlmError(Exception):
    """A request this session made cannot be served; other sessions are unaffected."""


class LlmUnavailable(LlmError):
    """The LLM engine is out (its process died, or it is restarting): no request can be
    served until the service has it back."""


@dataclass(frozen=True)
class Delta:
    """A piece of a reply: new token ids and their text, with the request's cache figures."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    # prompt tokens whose KV vLLM found in its prefix cache; None: not known yet (a remote
    # server says it with the request's last delta)
    cached_tokens: int | None
    # log-probabilities of the tokens a request asked about (``logprobs_of``), at the
    # first position this delta sampled (a prefill samples one token: what comes next)
    logprobs: dict[int, float] | None = None


@dataclass
class EngineCounters:
    """vLLM's per-step figures, summed over the engine's life."""

    prefill_tokens: int = 0  # prompt tokens computed: neither in a stream's KV nor in the prefix cache
    decode_tokens: int = 0
    steps: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use at the last step

    def record(self, scheduler_stats: Any) -> None:
        details = scheduler_stats.iteration_details
        if details is not None:
            self.prefill_tokens += details.num_ctx_tokens
            self.decode_tokens += details.num_generation_tokens
            self.steps += 1
        self.kv_usage = scheduler_stats.kv_cache_usage


@dataclass(frozen=True)
class Constraint:
    """What a reply's sampled tokens are held to: a structural tag (`models.tools`), and
    how many tokens come before a stop may end it (an answer that must say something)."""

    structural_tag: str | None = None
    min_tokens: int = 0
