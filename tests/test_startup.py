"""Start-up phases (duplex/startup.py) and vLLM's log lines through the service's
logging (duplex/logs.py), without vLLM: its engine core's side is played by a forked
child and a fresh interpreter that apply the same ``dictConfig`` vLLM applies. The
real service, vLLM included, is tests/test_probes.py's slow test."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from duplex.logs import route_vllm_logs, wrap_line
from duplex.startup import PHASES, SOCKET_ENV, Startup, VllmPhaseTap, phase, vllm_phase, wants_progress

TOKEN = "tok-startup-9876543210"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_logged_as_they_end_and_shown_as_they_happen(caplog):
    clock = FakeClock()
    startup = Startup(clock=clock)
    caplog.set_level(logging.INFO, logger="duplex.startup")
    assert startup.snapshot() == {"phase": None, "done": [], "seconds": 0.0, "finished": False}
    startup.begin("prepare")
    clock.now += 2.5
    snapshot = startup.snapshot()
    assert snapshot["phase"] == {"name": "prepare", "what": PHASES["prepare"], "seconds": 2.5}
    startup.end("LLM converted earlier, reused")
    startup.begin("load_vad")
    clock.now += 0.25
    startup.begin("load_asr")  # the next phase ends the one under way
    startup.note("two workers")
    clock.now += 1.0
    snapshot = startup.snapshot()
    assert snapshot["phase"] == {
        "name": "load_asr",
        "what": PHASES["load_asr"],
        "seconds": 1.0,
        "detail": "two workers",
    }
    assert snapshot["done"] == [
        {"name": "prepare", "seconds": 2.5, "detail": "LLM converted earlier, reused"},
        {"name": "load_vad", "seconds": 0.25},
    ]
    startup.finish()
    snapshot = startup.snapshot()
    assert snapshot["phase"] is None and snapshot["finished"] and snapshot["seconds"] == 3.8
    assert [d["name"] for d in snapshot["done"]] == ["prepare", "load_vad", "load_asr"]
    ended = [r for r in caplog.records if "took" in r.getMessage() and getattr(r, "fields", {}).get("phase")]
    assert [(r.fields["phase"], r.fields["seconds"]) for r in ended] == [
        ("prepare", 2.5),
        ("load_vad", 0.25),
        ("load_asr", 1.0),
    ]
    assert caplog.records[-1].getMessage() == "start-up took 3.8 s"
    clock.now += 5
    assert startup.snapshot()["seconds"] == 3.8  # the total stops with the start-up


def test_a_failed_phase_says_so():
    startup = Startup()
    with pytest.raises(RuntimeError), phase(startup, "load_tts"):
        raise RuntimeError("no voice")
    assert startup.snapshot()["done"] == [{"name": "load_tts", "seconds": 0.0, "detail": "failed"}]
    with phase(None, "load_tts"):  # no Startup: nothing to follow
        pass


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("log_format", "tty", "bar"),
    [("text", True, True), ("text", False, False), ("json", True, False), ("json", False, False)],
)
def test_a_progress_bar_only_on_a_terminal_and_never_in_json_mode(log_format, tty, bar):
    assert wants_progress(log_format, Stream(tty)) is bar


def test_the_progress_bar_names_the_phase_under_way(capsys):
    startup = Startup(progress=True)
    startup.begin("load_tts")
    startup.end()
    startup.finish()
    err = capsys.readouterr().err
    assert f"{PHASES['load_tts']}: 0/{len(PHASES)} phases" in err
    assert f"started: {len(PHASES)}/{len(PHASES)} phases" in err  # all done, skipped ones too
    startup.close()  # idempotent


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ("Starting to load model %s...", ("llm_weights", "")),
        ("Warming up model for the compilation...", ("llm_compile", "")),
        (
            "%sDirectly load the compiled graph(s) for compile range %s from the cache, took %.3f s",
            (None, "loaded the compiled graph from the cache"),
        ),
        (
            "%sCompiling a graph for compile range %s takes %.2f s",
            (None, "compiled (the next start loads it)"),
        ),
        ("Warming up done.", ("llm_warmup", "")),
        ("init engine (profile, create kv cache, warmup model) took %.2f s", None),
        ("Loading weights took %.2f seconds", None),
    ],
)
def test_vllm_messages_that_move_the_phases(message, said):
    assert vllm_phase(message) == said


def _engine_core(messages: list[tuple[str, ...]]) -> None:
    """What vLLM's forked engine core logs as it starts."""
    log = logging.getLogger("vllm.v1.worker.cpu_model_runner")
    for message, *args in messages:
        log.info(message, *args)


def test_the_engine_cores_phases_reach_the_service_from_a_forked_child():
    startup = Startup()
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    try:
        startup.begin("llm_engine")
        with VllmPhaseTap(startup):
            child = multiprocessing.get_context("fork").Process(
                target=_engine_core,
                args=(
                    [
                        ("Starting to load model %s...", "SmolLM2"),
                        ("Warming up model for the compilation...",),
                        ("%sCompiling a graph for compile range %s takes %.2f s", "", "(1, 4096)", 1.0),
                        ("Warming up done.",),
                    ],
                ),
            )
            child.start()
            child.join(timeout=30)
            assert child.exitcode == 0
            deadline = time.monotonic() + 10
            while (startup.current or ("",))[0] != "llm_warmup" and time.monotonic() < deadline:
                time.sleep(0.02)
        startup.finish()
    finally:
        vllm_logger.setLevel(level)
    done = startup.snapshot()["done"]
    assert [d["name"] for d in done] == ["llm_engine", "llm_weights", "llm_compile", "llm_warmup"]
    assert done[2]["detail"] == "compiled (the next start loads it)"
    assert not any(isinstance(h, VllmPhaseTap) for h in vllm_logger.handlers)  # it left with the start


def _late_engine_core(go: Any) -> None:
    go.wait(30)
    _engine_core([("Starting to load model %s...", "late")] * 10_000)  # more than a pipe holds


def test_an_engine_core_that_logs_after_the_start_up_is_not_held_up():
    startup = Startup()
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    context = multiprocessing.get_context("fork")
    go = context.Event()
    try:
        with VllmPhaseTap(startup):
            child = context.Process(target=_late_engine_core, args=(go,))
            child.start()
        go.set()  # the service stopped listening; the child's lines find no reader
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        vllm_logger.setLevel(level)
    assert startup.current is None  # nothing reached the service after the tap left


# vLLM's spawned engine core: a fresh interpreter that applies vLLM's dictConfig
SPAWNED_CORE = """
import json, logging, logging.config, os
logging.config.dictConfig(json.load(open(os.environ["VLLM_LOGGING_CONFIG_PATH"])))
log = logging.getLogger("vllm.v1.worker.cpu_model_runner")
log.info("Starting to load model %s...", "SmolLM2")
log.info("Warming up model for the compilation...")
logging.getLogger("vllm.compilation.decorators").info("%sDirectly load AOT compilation from path %s", "", "x")
log.info("Warming up done.")
"""


def _clean_env() -> dict[str, str]:
    """This environment without duplex's and vLLM's settings (a child starts as a service would)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEX_", "VLLM_"))}


def _python(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter from the checkout; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_engine_cores_phases_reach_the_service_from_a_spawned_process(tmp_path: Path):
    startup = Startup()
    env = _clean_env()
    startup.begin("llm_engine")
    saved = {k: os.environ.get(k) for k in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")}
    try:
        route_vllm_logs("warning", "json", tmp_path)  # the lines: warnings only; the phases: all
        with VllmPhaseTap(startup):
            env |= {k: os.environ[k] for k in ("VLLM_LOGGING_CONFIG_PATH", SOCKET_ENV)}
            done = _python(SPAWNED_CORE, env=env)
            deadline = time.monotonic() + 10
            while (startup.current or ("",))[0] != "llm_warmup" and time.monotonic() < deadline:
                time.sleep(0.02)
        assert SOCKET_ENV not in os.environ  # for the processes started meanwhile only
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    startup.finish()
    done_phases = startup.snapshot()["done"]
    assert [d["name"] for d in done_phases] == ["llm_engine", "llm_weights", "llm_compile", "llm_warmup"]
    assert done_phases[2]["detail"] == "loaded the compiled graph from the cache"
    assert done.stderr == ""  # INFO lines: below the level asked for, yet they moved the phases


@pytest.mark.parametrize(
    ("line", "level", "kept"),
    [
        ('{"ts": "x", "level": "info", "logger": "duplex", "msg": "listening", "pid": 1}', None, True),
        ("[W1201 22:50:53.713 utils.cpp:68] Warning: NUMA binding", "warning", False),
        ("[E1201 22:50:53.713 x.cpp:1] failed", "error", False),
        ("Loading safetensors checkpoint shards: 100% Completed | 1/1", "info", False),
        ("{not json", "info", False),
        ("[1, 2]", "info", False),
    ],
)
def test_lines_that_are_not_log_lines_are_wrapped_as_json(line, level, kept):
    wrapped = wrap_line(line, [])
    if kept:
        assert wrapped == line
    else:
        record = json.loads(wrapped)
        assert record["msg"] == line and record["level"] == level and record["logger"] == "stderr"
        assert {"ts", "pid"} <= record.keys()
    assert json.loads(wrap_line(f"token {TOKEN} here", [TOKEN]))["msg"] == "token *** here"


# A process of the service: JSON logs with the token masked, vLLM's logging routed,
# then vLLM's dictConfig applied as vLLM applies it in every process (it reads the file
# VLLM_LOGGING_CONFIG_PATH names; duplex's is a plain dictConfig): in this process, in
# a forked child, and in a fresh interpreter (a spawned child, as vLLM's engine core is
# on the CPU) that also writes a line of its own to stderr, as a C++ library does.
SERVICE = """
import contextlib, json, logging, logging.config, multiprocessing, os, subprocess, sys, warnings
from pathlib import Path
from duplex.logs import json_output, route_vllm_logs, setup_logging

SPAWNED = (
    "import sys, logging, logging.config, json, os;"
    "logging.config.dictConfig(json.load(open(os.environ['VLLM_LOGGING_CONFIG_PATH'])));"
    "logging.getLogger('vllm.worker').warning('spawned: token %s', sys.argv[1]);"
    "logging.getLogger('torch.other').warning('a library in the spawned child');"
    "sys.stderr.write('[W1201 utils.cpp:68] Warning: NUMA binding, token ' + sys.argv[1] + '\\\\n')"
)

def vllm_configures_logging():
    with open(os.environ["VLLM_LOGGING_CONFIG_PATH"]) as f:
        logging.config.dictConfig(json.load(f))

def engine_core(where):
    vllm_configures_logging()
    logging.getLogger("vllm.v1.engine.core").warning("%s: token %s", where, sys.argv[2])

fmt, token = sys.argv[1], sys.argv[2]
setup_logging("warning", fmt, [token])
with json_output([token]) if fmt == "json" else contextlib.nullcontext():
    route_vllm_logs("warning", fmt, Path(sys.argv[3]))
    vllm_configures_logging()
    logging.getLogger("vllm.config").warning("parent: token %s", token)
    logging.getLogger("vllm.config").info("an info line below the level asked for")
    warnings.warn("a warning from a library")
    child = multiprocessing.get_context("fork").Process(target=engine_core, args=("forked",))
    child.start(); child.join()
    logging.getLogger("vllm.config").warning("after the fork: token %s", token)
    subprocess.run([sys.executable, "-c", SPAWNED, token], check=True)
    print("a print to stdout")
"""


def _run_service(fmt: str, tmp_path: Path) -> tuple[list[str], str]:
    done = _python(SERVICE, fmt, TOKEN, str(tmp_path), env=_clean_env())
    return done.stderr.splitlines(), done.stdout


def test_vllm_lines_in_every_process_are_json_with_the_token_masked(tmp_path: Path):
    lines, stdout = _run_service("json", tmp_path)
    assert stdout == ""  # everything, vLLM's default stdout included, comes out on stderr
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg", "pid"} <= r.keys() for r in records)
    by_msg = {r["msg"]: r for r in records}
    assert {
        "parent: token ***",
        "forked: token ***",
        "after the fork: token ***",
        "spawned: token ***",
    } <= by_msg.keys()
    assert by_msg["forked: token ***"]["pid"] != by_msg["parent: token ***"]["pid"]  # the child's own line
    assert by_msg["forked: token ***"]["logger"] == "vllm.v1.engine.core"
    assert by_msg["spawned: token ***"]["pid"] not in (by_msg["parent: token ***"]["pid"], None)
    assert by_msg["a library in the spawned child"]["logger"] == "torch.other"  # its root logger too
    raw = by_msg["[W1201 utils.cpp:68] Warning: NUMA binding, token ***"]  # not a log line: wrapped
    assert raw["logger"] == "stderr" and raw["level"] == "warning"
    assert by_msg["a print to stdout"]["logger"] == "stderr"
    assert any(r["logger"] == "py.warnings" and "a warning from a library" in r["msg"] for r in records)
    assert not any("below the level" in r["msg"] for r in records)  # the level asked for holds
    assert TOKEN not in "\n".join(lines)


def test_vllm_lines_in_text_mode_read_like_the_services(tmp_path: Path):
    lines, stdout = _run_service("text", tmp_path)
    assert stdout == "a print to stdout\n"  # text mode leaves the streams alone
    assert any(line.endswith("WARNING vllm.config: parent: token ***") for line in lines)
    assert any(line.endswith("WARNING vllm.v1.engine.core: forked: token ***") for line in lines)
    assert any(line.endswith("WARNING vllm.worker: spawned: token ***") for line in lines)
    assert TOKEN not in "\n".join(lines[:-1])  # the last: the C++ library's own line, as it wrote it
