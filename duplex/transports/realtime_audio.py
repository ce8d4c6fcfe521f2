"""`InputAudio`: a Realtime client's input audio on its way to the session. An append's
base64 audio, in the client's input format (``audio/pcm`` at 24 kHz, ``audio/pcmu``,
``audio/pcma``), is decoded and resampled to the runtime's rate; for manual turns (no
``turn_detection``) it is held here until ``input_audio_buffer.commit``, at most
`MAX_BUFFER_S`, since the session hears none of it before.

A long append is decoded off the event loop (`THREAD_APPEND_CHARS`): the loop serves
every other session meanwhile (figures: docs/performance.md, "Realtime transport").
Appends are handled one at a time, so the resampler, which keeps state between
appends, is only ever used by one of them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

import numpy as np

from audio_io.frame import Int16Array
from audio_io.g711 import decode_wire
from audio_io.resample import Resampler
from duplex.transports.realtime_config import FORMATS, LAWS, RealtimeError

RUNTIME_INPUT_RATE = 16000
MAX_BUFFER_S = 300  # manual turns: input audio held until commit
THREAD_APPEND_CHARS = 64 * 1024  # an append longer than this (about 1 s of audio) decodes off the loop


def _decode(audio: bytes, kind: str) -> Int16Array:
    try:
        return decode_wire(audio, LAWS[kind])
    except ValueError:
        raise RealtimeError("PCM16 audio must be whole 16-bit samples.", param="audio") from None


class InputAudio:
    """One connection's input audio: the resampler and, for manual turns, the buffer."""

    def __init__(self) -> None:
        self._resampler = Resampler(24000, RUNTIME_INPUT_RATE)
        self._buffer: list[Int16Array] = []  # manual turns: audio appended since the last commit
        self.held = 0  # samples in the buffer

    async def decode(self, audio: str, kind: str) -> Int16Array:
        """An append's audio (base64, in format ``kind``) at `RUNTIME_INPUT_RATE`."""
        if self._resampler.in_rate != FORMATS[kind]:
            self._resampler = Resampler(FORMATS[kind], RUNTIME_INPUT_RATE)
        if len(audio) > THREAD_APPEND_CHARS:
            return await asyncio.to_thread(self._pcm, audio, kind)
        return self._pcm(audio, kind)

    def _pcm(self, audio: str, kind: str) -> Int16Array:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("'audio' is not valid base64.", "invalid_base64", "audio") from None
        return self._resampler.process(_decode(data, kind))

    def hold(self, pcm: Int16Array) -> None:
        """Keep decoded audio until the commit (refused past `MAX_BUFFER_S`)."""
        if self.held + pcm.size > MAX_BUFFER_S * RUNTIME_INPUT_RATE:
            raise RealtimeError(
                f"The input audio buffer holds at most {MAX_BUFFER_S} s: commit or clear it.",
                "input_audio_buffer_full",
                "audio",
            )
        self._buffer.append(pcm)
        self.held += pcm.size

    def take(self) -> Int16Array:
        """All the audio held, in one array; the buffer is empty after."""
        audio, self._buffer, self.held = np.concatenate(self._buffer), [], 0
        return audio

    def clear(self) -> None:
        self._buffer, self.held = [], 0
