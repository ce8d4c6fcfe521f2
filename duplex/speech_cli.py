"""``duplex transcribe`` and ``duplex say``: the speech stages from the command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from audio_io.decode import AudioFileError, decode_audio
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from audio_io.wav import write_wav
from duplex.config import Config
from models.prepare import model_path

SAMPLE_RATE = RUNTIME_RATE


def transcribe(config: Config, args: argparse.Namespace) -> int:
    from models.asr import AsrEngine

    try:
        audio = decode_audio(args.file, SAMPLE_RATE)  # any format FFmpeg reads, WAV included
    except AudioFileError as e:
        print(f"duplex: error: {e}", file=sys.stderr)
        return 2
    asr = AsrEngine(model_path(config, "asr"), workers=config.asr_workers)
    try:
        if args.partials:
            text = asyncio.run(_stream(config, asr, audio))
        else:
            text = asr.transcribe(audio)
    finally:
        asr.close()
    print(text)
    return 0


async def _stream(config: Config, asr: object, audio: np.ndarray) -> str:
    """Through VAD and streaming ASR as the service hears a caller; partials to stderr."""
    from models.asr import AsrEngine
    from models.listen import Listener, ListenEventKind
    from models.vad import VadEngine

    assert isinstance(asr, AsrEngine)
    vad = VadEngine(model_path(config, "vad"))
    listener = Listener(vad, asr)
    finals = []
    try:
        for start in range(0, audio.size, 320):
            events = await listener.push(audio[start : start + 320])
            events += [] if start + 320 < audio.size else await listener.flush()
            for event in events:
                assert event.kind is not ListenEventKind.FINAL or event.result is not None
                if event.kind is ListenEventKind.PARTIAL and event.result is not None:
                    committed = " ".join(w.text for w in event.result.committed)
                    print(
                        f"[{event.position / SAMPLE_RATE:7.2f}s] {event.result.text}  "
                        f"(committed: {committed})",
                        file=sys.stderr,
                    )
                elif event.kind is ListenEventKind.FINAL and event.result is not None:
                    print(
                        f"[{event.position / SAMPLE_RATE:7.2f}s] final: {event.result.text}", file=sys.stderr
                    )
                    finals.append(event.result.text)
            await listener.asr.idle()  # lockstep: as if compute kept up instantly
    finally:
        listener.close()
        vad.close()
    return " ".join(t for t in finals if t)


def say(config: Config, args: argparse.Namespace) -> int:
    from models.tts import TtsEngine

    text = args.text if args.text != "-" else sys.stdin.read()
    if not text.strip():
        print("duplex: error: nothing to say (empty text)", file=sys.stderr)
        return 2
    tts = TtsEngine(model_path(config, "voice"), deterministic=args.deterministic)
    try:
        started = time.perf_counter()
        audio = tts.synthesize(text).audio  # piper cuts it into sentences itself
        elapsed = time.perf_counter() - started
    finally:
        tts.close()
    rate = args.rate or tts.sample_rate
    write_wav(args.output, resample(audio, tts.sample_rate, rate), rate)
    seconds = audio.size / tts.sample_rate
    print(f"{args.output}: {seconds:.2f} s at {rate} Hz, synthesized in {elapsed:.2f} s", file=sys.stderr)
    return 0
