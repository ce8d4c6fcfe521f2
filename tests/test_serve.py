"""`duplex serve` as a user runs it: a real process, real listeners, real signals."""

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models.cpu_variant import default_variant
from tests.conftest import duplex_command, free_port

pytestmark = pytest.mark.slow


def get_health(port: int, path: str = "/healthz", timeout: float = 2) -> tuple[int, dict]:
    """Status and JSON body of one of the health routes (``/healthz``, ``/livez``, ``/readyz``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def grpc_health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


class Server:
    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            duplex_command("serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port), *args),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.descendants: set[int] = set()
        self._output: str | None = None

    def note_descendants(self) -> None:
        try:
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def wait_listening(self, timeout: float = 60) -> tuple[int, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            self.note_descendants()
            try:
                return get_health(self.port)
            except (ConnectionError, urllib.error.URLError):
                time.sleep(0.2)
        raise AssertionError("server did not listen in time")

    def terminate(self) -> float:
        self.note_descendants()
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=15)
        return time.monotonic() - started

    def output(self) -> str:
        if self.proc.poll() is None:
            self.note_descendants()
            self.proc.kill()
        for pid in alive(self.descendants):  # a killed server leaves its engine core holding stdout
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        if self._output is None:
            self._output = self.proc.communicate()[0]
        return self._output

    def stop_cleanly(self) -> str:
        """SIGTERM: exit status 0 within 5 s, and no process of its own left behind."""
        seconds = self.terminate()
        left = outliving(self.descendants, grace=2.0)  # before output() kills what is left
        output = self.output()
        assert self.proc.returncode == 0, output
        assert seconds < 5.0, output
        assert not left, output
        return output


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"}


def outliving(pids: set[int], grace: float) -> set[int]:
    """Those still running `grace` seconds on: a helper that ends as soon as the server
    has (multiprocessing's resource tracker, on its pipe's EOF) is not left behind."""
    deadline = time.monotonic() + grace
    while (running := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def test_serve_becomes_ready_and_stops_cleanly_on_sigterm(offline_env):
    server = Server(offline_env)
    try:
        status, body = server.wait_listening()
        deadline = time.monotonic() + 300
        while status != 200 and time.monotonic() < deadline:
            assert body["status"] == "starting", body
            server.note_descendants()
            time.sleep(0.5)
            status, body = get_health(server.port)
        assert status == 200, body
        assert set(body["components"]) == {"vad", "asr", "tts", "llm"}
        assert all(c["state"] == "ready" for c in body["components"].values())
        weights = default_variant().weights  # llm_quantization auto; full weights: the bf16 conversion
        weights = "bf16" if weights == "none" else weights
        assert body["components"]["llm"]["detail"].endswith(f"SmolLM2-135M-Instruct.Q4_1-{weights}")
        assert not any("/" in c["detail"] for c in body["components"].values()), body  # names, not paths
        assert grpc_health(server.grpc_port) == health_pb2.HealthCheckResponse.SERVING
        server.note_descendants()
        assert server.descendants, "the LLM's engine core runs in a child process"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2) as r:
            exported = r.read().decode()
        assert "duplex_sessions_active 0.0" in exported
        lag_count = next(
            x for x in exported.splitlines() if x.startswith("duplex_event_loop_lag_seconds_count")
        )
        assert float(lag_count.split()[-1]) > 0  # the loop-lag probe runs while serving
        output = server.stop_cleanly()  # engines loaded: SIGTERM still ends it all within 5 s
    finally:
        server.output()
    assert "listening" in output and "stopped" in output
    assert "engine ready" in output
    assert "heap frozen" in output  # after loading, so that no full collection walks the engines


def test_sigterm_during_model_preparation_stops_within_5s_leaving_no_child(tmp_path: Path, offline_env):
    # A fresh cache: the LLM conversion (~25 s, in a child process) is under way.
    server = Server(offline_env, "--cache-dir", str(tmp_path / "cache"))
    try:
        status, body = server.wait_listening()
        assert status == 503 and body["status"] == "starting"
        assert grpc_health(server.grpc_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        deadline = time.monotonic() + 20
        while not server.descendants and time.monotonic() < deadline:
            server.note_descendants()
            time.sleep(0.1)
        assert server.descendants, "model preparation should run in a child process"
        time.sleep(2)  # let it get into the conversion
        server.stop_cleanly()
    finally:
        server.output()


def test_json_logs_hide_the_auth_token(offline_env):
    token = "very-secret-token-42"
    server = Server(offline_env | {"DUPLEX_AUTH_TOKEN": token}, "--log-format", "json")
    try:
        server.wait_listening()
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=2)
        assert info.value.code == 401
        req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=2) as r:
            assert r.status == 200
        server.terminate()
    finally:
        output = server.output()
    assert token not in output
    records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert any(r["msg"] == "listening" for r in records)
    assert any(r.get("config", {}).get("auth_token") == "***" for r in records)


def test_serve_exits_1_when_model_preparation_fails(tmp_path: Path, offline_env):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)  # passes the path check, fails conversion
    server = Server(offline_env, "--llm", str(gguf), "--cache-dir", str(tmp_path / "cache"))
    try:
        server.proc.wait(timeout=120)
    finally:
        output = server.output()
    assert server.proc.returncode == 1, output
    assert "model preparation failed" in output and "cannot convert this GGUF" in output
