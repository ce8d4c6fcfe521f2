"""``duplex``: serve, prepare. Exit status 2 for bad configuration or missing models."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from duplex import __version__
from duplex.config import FIELDS, Config, ConfigError, load_config
from duplex.logs import setup_logging
from models.bundled import ModelNotFoundError
from models.cache import configure_engine_caches, default_cache_dir

log = logging.getLogger("duplex")
# where the package was imported from: a source checkout holds benchmarks/ beside it
CHECKOUT = Path(__file__).resolve().parent.parent

MODEL_KEYS = (
    "cache_dir",
    "vad",
    "asr",
    "voice",
    "llm",
    "llm_dtype",
    "llm_quantization",
    "log_level",
    "log_format",
)


def _add_config_flags(parser: argparse.ArgumentParser, keys: Sequence[str]) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration file")
    for key in keys:
        f = FIELDS[key]
        choices = f.metadata["choices"] or None
        switch = isinstance(f.default, bool)  # --allow-unauthenticated alone means true
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            dest=key,
            default=None,
            nargs="?" if switch else None,
            const="true" if switch else None,
            metavar="BOOL" if switch else None if choices else key.upper(),
            choices=choices,
            help=f"{f.metadata['help']} [default: {f.default}]",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description="Realtime full-duplex speech service.")
    parser.add_argument("--version", action="version", version=f"duplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the service (prepares models when needed)")
    _add_config_flags(serve, list(FIELDS))
    prepare = sub.add_parser("prepare", help="locate bundled models, convert the LLM once, print where")
    _add_config_flags(prepare, MODEL_KEYS)
    prepare.add_argument("--json", action="store_true", help="print the prepared models as JSON")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.add_argument("--verify", action="store_true", help="also load the LLM in vLLM and chat once")
    serve_llm = sub.add_parser(
        "serve-llm",
        help="run vLLM's OpenAI-compatible server for the configured LLM (for serve --llm-url)",
        description="Prepare the configured LLM and run vLLM's OpenAI-compatible server on it, with the "
        "settings duplex's remote backend relies on; arguments after -- go to vLLM's server as they are.",
    )
    _add_config_flags(
        serve_llm,
        (
            *(key for key in MODEL_KEYS if key not in ("vad", "asr", "voice")),  # the LLM's only
            "host",
            "llm_execution",
            "llm_kv_cache_gib",
            "llm_gpu_memory_fraction",
            "llm_max_context",
            "llm_api_key",
        ),
    )
    serve_llm.add_argument("--port", type=int, default=8100, help="the server's port [default: 8100]")
    serve_llm.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run this many servers (on the ports after --port) behind vLLM's router on --port [default: 1]",
    )
    serve_llm.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then flags for vLLM's server")
    transcribe = sub.add_parser("transcribe", help="print the transcript of an audio file")
    _add_config_flags(transcribe, ("asr", "vad", "asr_workers", "log_level"))
    transcribe.add_argument(
        "file", type=Path, help="audio file: WAV, FLAC, MP3, Ogg, M4A... (any format FFmpeg reads, any rate)"
    )
    transcribe.add_argument(
        "--partials", action="store_true", help="stream it through VAD and streaming ASR; partials to stderr"
    )
    show = sub.add_parser("config", help="print the configuration that serve would use, as TOML")
    _add_config_flags(show, list(FIELDS))
    show.add_argument(
        "--example", action="store_true", help="print every key, its default and help (deploy/duplex.toml)"
    )
    say = sub.add_parser("say", help="synthesize speech to a WAV file")
    _add_config_flags(say, ("voice", "log_level"))
    say.add_argument("text", help="what to say ('-' reads stdin)")
    say.add_argument("-o", "--output", type=Path, required=True, help="WAV file to write")
    say.add_argument("--rate", type=int, default=None, help="sample rate of the WAV (default: the voice's)")
    say.add_argument("--deterministic", action="store_true", help="no generator noise: same audio every time")
    client = sub.add_parser("client", help="talk to a duplex server over gRPC (a WAV file, stdin, or --mic)")
    _add_config_flags(client, ("log_level",))
    _add_client_arguments(client)
    bench = sub.add_parser(
        "bench", help="measure a stage (source checkout only); prints one JSON object as its last line"
    )
    _add_config_flags(
        bench,
        (
            "asr",
            "vad",
            "voice",
            "llm",
            "llm_url",
            "llm_api_key",
            "llm_dtype",
            "llm_quantization",
            "llm_execution",
            "llm_max_tokens",
            "cache_dir",
            "asr_workers",
            "log_level",
        ),
    )
    bench.add_argument(
        "stage",
        choices=("asr", "tts", "ar", "ar-cpu", "ar-variants", "conversation", "endpoint", "soak", "tools"),
    )
    bench.add_argument("--sessions", default="1,4,8", help="concurrent sessions to measure, comma-separated")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    bench.add_argument(
        "--compare",
        action="store_true",
        help="ar with --llm-url: the in-process engine too, on the same turns, interleaved",
    )
    bench.add_argument(
        "--variants",
        default="",
        help="ar-variants: only these, comma-separated (e.g. none-float32-compiled,int8-bfloat16-eager)",
    )
    bench.add_argument(
        "--utterances",
        nargs="+",
        metavar="WAV",
        help="conversation: the caller's own recordings of the three questions and the story request, "
        "in order; endpoint: recordings of turns that pause mid-sentence (instead of synthesized ones)",
    )
    bench.add_argument(
        "--turns",
        type=int,
        default=0,
        help="conversation: also one session of this many turns; endpoint: turns per setting (10)",
    )
    bench.add_argument(
        "--session-config",
        default="{}",
        metavar="JSON",
        help='conversation: the sessions\' settings other than the defaults, e.g. {"quick_pause": false}',
    )
    bench.add_argument(
        "--cycles", type=int, default=None, help="soak: connect/disconnect cycles over every transport (100)"
    )
    bench.add_argument(
        "--minutes", type=float, default=0.0, help="soak: also one session this long, a question every 30 s"
    )
    return parser


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", nargs="?", help="WAV file, or '-' for raw PCM16 mono on stdin")
    parser.add_argument("--target", default="127.0.0.1:50051", help="the server's gRPC address")
    parser.add_argument("--token", default=None, help="the server's auth token (or DUPLEX_AUTH_TOKEN)")
    parser.add_argument("--stdin-rate", type=int, default=16000, help="sample rate of PCM on stdin")
    parser.add_argument("--fast", action="store_true", help="send as fast as the server takes it")
    parser.add_argument("--mic", action="store_true", help="talk live: microphone in, speakers out")
    parser.add_argument("--out", type=Path, default=None, help="write the reply audio to this WAV file")
    parser.add_argument("--system-prompt", default="", help="the assistant's instructions for this session")
    parser.add_argument("--wait-s", type=float, default=60.0, help="longest wait for the replies")


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}


def _fail(message: str) -> int:
    print(f"duplex: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, os.environ, _flags(args))
    except ConfigError as e:
        return _fail(f"configuration: {e}")
    setup_logging(config.log_level, config.log_format, [config.auth_token or ""])
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    try:
        if args.command == "serve":
            return _serve(config, cache_dir)
        if args.command == "serve-llm":
            from duplex.serve_llm import serve_llm

            extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
            return serve_llm(config, cache_dir, args.port, extra, args.replicas)
        if args.command == "transcribe":
            from duplex.speech_cli import transcribe

            return transcribe(config, args)
        if args.command == "say":
            from duplex.speech_cli import say

            return say(config, args)
        if args.command == "client":
            from duplex.client_cli import run

            return asyncio.run(run(args, args.token or config.auth_token))
        if args.command == "config":
            from duplex.config_example import example, render

            print(example() if args.example else render(config, "as loaded"), end="")
            return 0
        if args.command == "bench":
            return _bench(argv[1:])  # (no option comes before the command but --version, which exits)
        return _prepare(config, cache_dir, args)
    except ModelNotFoundError as e:
        return _fail(str(e))


def _bench(argv: Sequence[str]) -> int:
    """``duplex bench ARGV``: ``python -m benchmarks ARGV`` in a process of its own, started
    in the checkout that holds this package, where `benchmarks` is found as any top-level
    package of the current directory is (the runtime never reaches for it: it is not in the
    wheel, and an editable install maps only the runtime's packages). The child goes back
    to this process's working directory before it reads anything, so that relative paths
    (``--config``, ``--utterances``, a local ``--llm``) mean what they mean here. Its exit
    status is the command's (128 + the signal's number if a signal ended it, as a shell
    says); SIGTERM is passed on to it."""
    if not (CHECKOUT / "benchmarks" / "__main__.py").is_file():
        return _fail(
            "benchmarks ship with the source checkout, not with the installed package: "
            "run `duplex bench` from a checkout of the repository (installed with pip install -e)"
        )
    command = [sys.executable, "-m", "benchmarks", "--cwd", os.getcwd(), *argv]
    with subprocess.Popen(command, cwd=CHECKOUT) as child:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the child, in the same process group, got the SIGINT too
            code = child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code


def _serve(config: Config, cache_dir: Path) -> int:
    from duplex.service import serve

    log.info("starting duplex %s", __version__, extra={"fields": {"config": config.redacted()}})
    code = asyncio.run(serve(config, cache_dir))
    # Everything is closed in order by Service.stop. The interpreter's own teardown
    # (finalizers of vLLM, torch, onnxruntime) has nothing left to do and is slow enough
    # to put SIGTERM past its budget (figures: docs/performance.md, "Shutdown").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _prepare(config: Config, cache_dir: Path, args: argparse.Namespace) -> int:
    from duplex.service import model_choices
    from models.prepare import prepare

    # Terminated (e.g. by `duplex serve` shutting down): unwind, so that a conversion
    # in progress removes its staging directory.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    configure_engine_caches(cache_dir)
    prepared = prepare(model_choices(config), cache_dir, progress=not (args.no_progress or args.json))
    if args.json:
        print(json.dumps([dataclasses.asdict(p) for p in prepared]))
    else:
        print(f"Models prepared (cache: {cache_dir}):")
        for p in prepared:
            print(f"  {p.describe()}")
    if args.verify:
        from models.verify import verify_llm

        llm = next(p for p in prepared if p.stage == "llm")
        result = verify_llm(llm.path, config.llm_dtype)
        print(
            f"LLM check ({result.dtype}, loaded in {result.start_seconds:.1f} s, "
            f"replied in {result.reply_seconds:.1f} s): {result.reply!r}"
        )
        if not result.reply.strip():
            return _fail(f"the LLM at {llm.path} gave an empty reply")
    return 0
