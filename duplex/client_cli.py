"""``duplex client``: talk to a duplex server over gRPC from a WAV file, stdin or the
microphone; the reply's audio goes to a WAV file (or the speakers), its words and
latencies to stdout.

    duplex client question.wav --out reply.wav          # real time, like a caller
    duplex client question.wav --fast                   # as fast as the server takes it
    arecord -r 16000 -f S16_LE -c 1 | duplex client -   # raw PCM16 on stdin
    duplex client --mic                                 # needs the sounddevice package
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

import grpc
import numpy as np

from audio_io._proto import duplex_pb2 as pb
from audio_io.frame import Int16Array
from audio_io.resample import resample
from audio_io.wav import read_wav, write_wav
from duplex.grpc_client import Conversation, DuplexClient

RATE = 16000
CHUNK = RATE // 50  # 20 ms
TRAILING_SILENCE_S = 1.5  # after the input, so that the server hears the turn end
MAX_AHEAD_S = 5.0  # --fast stays this far ahead of real time at most (the server's queue is 10 s)


async def run(args: argparse.Namespace, token: str | None) -> int:
    if args.mic:
        return await _live(args, token)
    if not args.input:
        print("duplex client: give a WAV file, '-' for stdin, or --mic", file=sys.stderr)
        return 2
    audio = _read_input(args.input, args.stdin_rate)
    async with DuplexClient(args.target, token) as client:
        try:
            conversation = await client.converse(system_prompt=args.system_prompt)
        except grpc.aio.AioRpcError as e:
            print(f"duplex client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        printer = Printer(conversation.started.output_format.sample_rate)
        reading = asyncio.create_task(printer.read(conversation))
        await _stream(conversation, audio, fast=args.fast)
        try:
            await asyncio.wait_for(printer.all_replied.wait(), args.wait_s)
        except TimeoutError:
            print("duplex client: no reply in time", file=sys.stderr)
        await conversation.close()
        await reading
        code, details = await conversation.status()
    if args.out is not None:
        write_wav(args.out, printer.audio(), printer.rate)
    if code != grpc.StatusCode.OK:
        print(f"duplex client: {code.name}: {details}", file=sys.stderr)
        return 1
    return 0


def _read_input(source: str, stdin_rate: int) -> Int16Array:
    if source == "-":
        data = sys.stdin.buffer.read()
        samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.int16)
        return resample(samples, stdin_rate, RATE)
    samples, rate = read_wav(source)
    return resample(samples, rate, RATE)


async def _stream(conversation: Conversation, audio: Int16Array, fast: bool) -> None:
    """The audio, then trailing silence, in 20 ms chunks: in real time, or ahead of it."""
    audio = np.concatenate([audio, np.zeros(int(TRAILING_SILENCE_S * RATE), np.int16)])
    start = time.monotonic()
    for k, i in enumerate(range(0, audio.size, CHUNK)):
        due = start + k * 0.02 - (MAX_AHEAD_S if fast else 0.0)
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        await conversation.send_audio(audio[i : i + CHUNK].astype("<i2").tobytes())


class Printer:
    """Prints the conversation as it goes; keeps the reply audio."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.chunks: list[bytes] = []
        self.all_replied = asyncio.Event()
        self._open: set[str] = set()
        self._text: dict[str, str] = {}

    async def read(self, conversation: Conversation) -> None:
        async for event in conversation:
            self.show(event)

    def show(self, event: pb.ServerEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "audio":
            self.chunks.append(event.audio.data)
        elif kind == "transcript" and event.transcript.final:
            print(f"you: {event.transcript.text}", flush=True)
        elif kind == "text":
            self._text[event.text.response_id] = self._text.get(event.text.response_id, "") + event.text.delta
        elif kind == "metrics":
            steps = ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in event.metrics.steps_ms.items())
            print(f"  voice-to-voice {event.metrics.voice_to_voice_ms:.0f} ms ({steps})", flush=True)
        elif kind == "error":
            print(f"error: {event.error.code}: {event.error.message}", file=sys.stderr, flush=True)
        elif kind == "turn":
            self._turn(event.turn)

    def _turn(self, turn: pb.TurnEvent) -> None:
        if turn.kind == pb.TurnEvent.RESPONSE_STARTED:
            self._open.add(turn.response_id)
            self.all_replied.clear()
        elif turn.kind == pb.TurnEvent.INTERRUPTED:
            print(f"  (cut: the caller heard {turn.heard_text!r})", flush=True)
        elif turn.kind == pb.TurnEvent.RESPONSE_DONE:
            print(f"assistant: {self._text.get(turn.response_id, '')}", flush=True)
            self._open.discard(turn.response_id)
            if not self._open:
                self.all_replied.set()

    def audio(self) -> Int16Array:
        return np.frombuffer(b"".join(self.chunks), dtype="<i2").astype(np.int16)


async def _live(args: argparse.Namespace, token: str | None) -> int:
    """Microphone in, speakers out, with playback acknowledgements (exact truncation)."""
    try:
        import sounddevice
    except (ImportError, OSError) as e:  # OSError: no PortAudio library
        print(f"duplex client: --mic needs the sounddevice package and PortAudio ({e})", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    async with DuplexClient(args.target, token) as client:
        conversation = await client.converse(system_prompt=args.system_prompt, playback_acks=True)
        printer = Printer(conversation.started.output_format.sample_rate)
        pending = bytearray()  # received, not yet played (the audio thread takes from it)
        played = 0  # output samples played or dropped: the stream position the server counts in
        lock = threading.Lock()

        def captured(data: np.ndarray, frames: int, when: object, status: object) -> None:
            chunk = data[:, 0].astype("<i2").tobytes()
            loop.call_soon_threadsafe(asyncio.ensure_future, conversation.send_audio(chunk))

        def play(out: np.ndarray, frames: int, when: object, status: object) -> None:
            nonlocal played
            with lock:
                take = bytes(pending[: frames * 2])
                del pending[: frames * 2]
                played += len(take) // 2
                position = played
            out[:, 0] = np.frombuffer(take + b"\0" * (frames * 2 - len(take)), dtype="<i2")
            loop.call_soon_threadsafe(asyncio.ensure_future, conversation.ack(position))

        with (
            sounddevice.InputStream(
                samplerate=RATE, channels=1, dtype="int16", blocksize=CHUNK, callback=captured
            ),
            sounddevice.OutputStream(
                samplerate=printer.rate,
                channels=1,
                dtype="int16",
                blocksize=printer.rate // 50,
                callback=play,
            ),
        ):
            print("listening; Ctrl-C to stop", file=sys.stderr)
            try:
                async for event in conversation:
                    printer.show(event)
                    with lock:
                        if event.HasField("audio"):
                            pending.extend(event.audio.data)
                        elif event.HasField("turn") and event.turn.kind == pb.TurnEvent.INTERRUPTED:
                            played += len(pending) // 2  # barge-in: what is not played yet goes
                            pending.clear()
            except (KeyboardInterrupt, asyncio.CancelledError):
                conversation.abort()
    return 0
