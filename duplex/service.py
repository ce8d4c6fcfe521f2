"""`Service`: the listeners, model preparation and the shutdown path of `duplex serve`.

Start-up order: the configured model paths are checked synchronously (a bad path
fails before any port opens), then the HTTP and gRPC listeners start (``/livez``
answers 200 from then on) and answer ``/healthz`` and ``/readyz`` with 503, then
models are prepared in a child process (a GGUF LLM is converted there once; the
server process never imports transformers), and each component turns ready.
SIGINT/SIGTERM set the stop event; `stop` then ends the preparation child and both
listeners within ``shutdown_timeout_s``.

Once prepared, the engines are loaded in this process (the LLM's vLLM engine core in
its own child), and each component turns ready as its engine is up; transports open
sessions through `Sessions`, which refuses them until then. `EngineWatch` then keeps
the engines running (a dead one is restarted; health says so meanwhile). Shutdown
refuses new sessions first, tells every live session why it ends and closes it, then
stops the engines.

Each phase of the start-up (`duplex.startup.PHASES`) is logged with its elapsed time
as it ends and shown in ``/healthz`` as it happens; on a terminal a progress bar
follows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from aiohttp import web

from audio_io.webrtc import set_host_addresses
from duplex.config import Config
from duplex.engine_watch import EngineWatch
from duplex.engines import Engines
from duplex.events import SessionError
from duplex.health import ComponentState, Readiness
from duplex.http_app import build_http_app
from duplex.logs import json_output
from duplex.metrics import LoopLag, set_build_info
from duplex.sessions import Sessions
from duplex.startup import Startup, wants_progress
from duplex.transports.grpc_server import GrpcListener
from duplex.transports.realtime_route import RealtimeEndpoint
from duplex.transports.sip import SipListener
from duplex.transports.twilio import TwilioEndpoint
from duplex.transports.webrtc import WebRtcEndpoint
from models.prepare import STAGES, ModelChoice, check_models

log = logging.getLogger("duplex.service")

# Readiness components, by the stage whose model each one needs.
COMPONENTS = {"vad": "vad", "asr": "asr", "voice": "tts", "llm": "llm"}


def model_choices(config: Config) -> list[ModelChoice]:
    return [
        ModelChoice(stage, getattr(config, stage), config.llm_weights() if stage == "llm" else "none")
        for stage in STAGES
    ]


class PrepareFailed(Exception):
    pass


class Service:
    def __init__(self, config: Config, cache_dir: Path) -> None:
        self.config = config
        self.cache_dir = cache_dir
        self.startup = Startup(progress=wants_progress(config.log_format, sys.stderr))
        self.readiness = Readiness(list(COMPONENTS.values()), self.startup)
        self.stopped = asyncio.Event()
        self.exit_code = 0
        self.sessions = Sessions(config.max_sessions, config.session_idle_timeout_s, config.max_session_s)
        self.webrtc = WebRtcEndpoint(config, self.sessions)
        self.twilio = TwilioEndpoint(config, self.sessions)
        self.realtime = RealtimeEndpoint(config, self.sessions)
        self.engines: Engines | None = None
        self._loop_lag = LoopLag(period=0.05, keep=False)
        self._runner: web.AppRunner | None = None
        self._grpc: GrpcListener | None = None
        self._sip: SipListener | None = None
        self._prepare_task: asyncio.Task[None] | None = None
        self._engine_watch: asyncio.Task[None] | None = None
        self._child: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        check_models(model_choices(self.config))  # fail fast, before binding
        set_build_info()
        app = build_http_app(self.config, self.readiness)
        set_host_addresses(self.config.webrtc_hosts)
        self.webrtc.routes(app)
        self.twilio.routes(app)
        self.realtime.routes(app)
        self._runner = web.AppRunner(
            app,
            shutdown_timeout=self.config.shutdown_timeout_s / 2,
            handle_signals=False,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self._grpc = GrpcListener(self.config, self.sessions)
        await self._grpc.start()
        if self.config.sip_port is not None:
            self._sip = SipListener(self.config, self.sessions)
            await self._sip.start()
        grpc_listener = self._grpc

        def on_ready_change(ready: bool) -> None:
            task = asyncio.get_running_loop().create_task(grpc_listener.set_serving(ready))
            task.add_done_callback(_log_task_error)

        self.readiness.on_change(on_ready_change)
        warning = self.config.unauthenticated_warning()
        if warning is not None:
            log.warning(warning)
        log.info(
            "listening",
            extra={
                "fields": {
                    "http": f"http://{self.config.host_for_url}:{self.config.port}",
                    "grpc": f"{self.config.host_for_url}:{self._grpc.port}",
                }
            },
        )
        self._prepare_task = asyncio.create_task(self._prepare(), name="prepare-models")
        self._loop_lag.start()

    async def _prepare(self) -> None:
        args = [
            sys.executable,
            "-m",
            "duplex",
            "prepare",
            "--json",
            "--no-progress",
            "--cache-dir",
            str(self.cache_dir),
        ]
        for choice in model_choices(self.config):
            if choice.value is not None:
                args += [f"--{choice.stage}", choice.value]
        args += ["--llm-quantization", self.config.llm_weights()]
        self.startup.begin("prepare")
        self._child = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        stdout, stderr = await self._child.communicate()
        code = self._child.returncode
        self._child = None
        if code != 0:
            lines = stderr.decode(errors="replace").strip().splitlines()
            return self._prepare_failed(lines[-1] if lines else f"exit status {code}")
        try:
            prepared = json.loads(stdout)
            ready = [(COMPONENTS[item["stage"]], item) for item in prepared]
        except (ValueError, KeyError, TypeError) as e:
            return self._prepare_failed(f"unreadable result from duplex prepare: {e}")
        self.startup.end(_prepared_detail(prepared))
        # the public /healthz names each model, never where it lives on this machine
        details = {component: Path(item["path"]).name for component, item in ready}
        for _, item in ready:
            log.info("model prepared", extra={"fields": item})

        def loaded(component: str) -> None:
            self.readiness.set(component, ComponentState.READY, details.get(component, ""))
            log.info("engine ready", extra={"fields": {"component": component}})

        try:
            self.engines = await Engines.start(
                self.config, self.cache_dir, loaded=loaded, startup=self.startup
            )
        except Exception as e:  # a model that prepared but does not load
            log.exception("loading the models failed")
            return self._prepare_failed(f"loading the models failed: {e}")
        self.startup.finish()
        self.sessions.attach(self.engines)
        watch = EngineWatch(self.engines, self.readiness, self.sessions, self._give_up)
        self._engine_watch = asyncio.create_task(watch.run(), name="engine-watch")

    def _give_up(self, reason: str) -> None:
        """An engine cannot be kept running: exit non-zero, for a supervisor to act on."""
        log.error("stopping: %s", reason)
        self.exit_code = 1
        self.stopped.set()

    def _prepare_failed(self, message: str) -> None:
        self.startup.end("failed")
        self.startup.finish()
        for component in COMPONENTS.values():  # the reason (paths and all) goes to the log only
            self.readiness.set(component, ComponentState.FAILED, "model preparation failed (see the log)")
        log.error("model preparation failed: %s", message)
        self.exit_code = 1
        self.stopped.set()

    async def stop(self) -> None:
        """Stop everything within ``shutdown_timeout_s``; safe to call twice."""
        timeout = self.config.shutdown_timeout_s
        self.readiness.shut_down()  # /readyz 503 from now on
        self.startup.close()
        self.sessions.set_unavailable(SessionError("shutting_down", "the server is shutting down"))
        await self._loop_lag.stop()
        if self._prepare_task is not None and not self._prepare_task.done():
            self._prepare_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prepare_task
        await self._end_child(timeout / 4)
        if self._engine_watch is not None:  # no restarts while the engines stop
            self._engine_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_watch
        await self.webrtc.close_all()
        if self._sip is not None:
            sip_listener, self._sip = self._sip, None
            await sip_listener.stop()  # BYE to every caller
        await self.sessions.close_all(SessionError("shutting_down", "the server is shutting down"))
        # With the sessions closed, the engines and the listeners stop together: one
        # after the other, each one's worst case (the ASR's 1 s for a pass in progress,
        # vLLM's 1.5 s for its engine core, gRPC's grace, aiohttp's) adds up past the
        # 5 s a SIGTERM allows (figures: docs/performance.md, "Shutdown")
        closing: list[Awaitable[object]] = []
        if self.engines is not None:
            engines, self.engines = self.engines, None
            closing.append(asyncio.to_thread(engines.close))
        if self._grpc is not None:
            grpc_listener, self._grpc = self._grpc, None
            closing.append(grpc_listener.stop(grace=timeout / 4))
        if self._runner is not None:
            runner, self._runner = self._runner, None
            closing.append(runner.cleanup())
        results = await asyncio.gather(*closing, return_exceptions=True)
        for result in results:  # each stops even if another fails
            if isinstance(result, BaseException):
                raise result

    async def _end_child(self, grace: float) -> None:
        child, self._child = self._child, None
        if child is None or child.returncode is not None:
            return
        child.terminate()
        try:
            await asyncio.wait_for(child.wait(), grace)
        except TimeoutError:
            child.kill()
            await child.wait()


def _prepared_detail(prepared: list[dict[str, Any]]) -> str:
    """What preparing did to the LLM, for the phase's detail (no paths: ``/healthz`` is
    public)."""
    llm = next((item for item in prepared if item.get("stage") == "llm"), {})
    action = str(llm.get("action", ""))
    if action == "converted":
        return f"LLM converted in {llm.get('seconds', 0.0):.1f} s"
    return {"reused": "LLM converted earlier, reused", "found": "LLM ready", "hub": "LLM from the hub"}.get(
        action, action
    )


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())


async def serve(config: Config, cache_dir: Path) -> int:
    if config.log_format != "json":
        return await _serve(config, cache_dir)
    with json_output([config.auth_token or ""]):  # every line out, the engine core's too
        return await _serve(config, cache_dir)


async def _serve(config: Config, cache_dir: Path) -> int:
    service = Service(config, cache_dir)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stopped.set)
    try:
        await service.start()
        await service.stopped.wait()
        log.info("shutting down")
    finally:
        await asyncio.wait_for(service.stop(), config.shutdown_timeout_s + 0.5)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("stopped")
    return service.exit_code
