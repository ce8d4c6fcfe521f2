"""A piper voice in two parts, so that a phrase's first audio is ready before all of it.

piper runs one ONNX graph per sentence. Its first part (the text encoder, the duration
predictor and the flow) turns phoneme ids into latent frames; its last, the decoder,
turns each frame into `hop` samples, at a cost that grows with the audio: most of a
long phrase's time is the decoder's. Its first 16 frames (186 ms of audio), given 8
frames after them for context, cost the same whatever the phrase's length, and spans
decoded so differ from the whole decode by a fraction of a percent of full scale at
most (figures: docs/performance.md, "The first phrase's audio in pieces"). So the
voice is split at load, in memory, at the decoder's one input (`VoiceParts.load`, with
the ``onnx`` package): a phrase's first frames are decoded and played while the rest
is decoded.

The first part also gives the frames each phoneme id lasts (the tensor piper's
``patch_voice_with_alignment`` exposes): where each word falls in the audio is known
exactly, and before any of it is decoded.

A voice whose graph does not split so (its decoder takes more than the latent frames,
as a multi-speaker voice's does) is not loaded here (`load` returns None); the engine
then runs it whole, as piper does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from models.onnx_cpu import cpu_session

log = logging.getLogger("duplex.tts")

CONTEXT_FRAMES = 8  # decoded on each side of a span, then cut off
_DECODER_PREFIX = "/dec/"  # piper's export names the decoder's nodes so


@dataclass(frozen=True)
class Encoded:
    """One sentence through the first part: its latent frames and each id's frames."""

    latent: npt.NDArray[np.float32]  # (1, channels, frames)
    id_frames: npt.NDArray[np.int64]  # frames per phoneme id

    @property
    def frames(self) -> int:
        return int(self.latent.shape[2])


class VoiceParts:
    def __init__(self, encoder: Any, decoder: Any, latent_name: str, hop: int) -> None:
        self.encoder = encoder  # onnxruntime sessions
        self.decoder = decoder
        self.latent_name = latent_name
        self.hop = hop  # samples per latent frame

    @classmethod
    def load(cls, voice_path: str | Path, hop: int, threads: int) -> VoiceParts | None:
        """The voice's graph split before its decoder, or None if it cannot be."""
        import onnx
        import onnx.utils

        model = onnx.load(str(voice_path))
        graph = model.graph
        decoder = [n for n in graph.node if n.name.startswith(_DECODER_PREFIX)]
        made = {out for n in decoder for out in n.output}
        constants = {t.name for t in graph.initializer}
        inputs = {i for n in decoder for i in n.input if i and i not in made and i not in constants}
        durations = [out for n in graph.node if n.op_type == "Ceil" for out in n.output]
        if len(inputs) != 1 or len(durations) != 1 or [o.name for o in graph.output] != ["output"]:
            log.info("voice %s not split: decoder inputs %s, durations %s", voice_path, inputs, durations)
            return None
        (latent,) = inputs
        extractor = onnx.utils.Extractor(model)
        first = extractor.extract_model([i.name for i in graph.input], [latent, durations[0]])
        last = extractor.extract_model([latent], ["output"])
        return cls(
            cpu_session(first.SerializeToString(), threads),
            cpu_session(last.SerializeToString(), threads),
            latent,
            hop,
        )

    def encode(self, ids: list[int], scales: npt.NDArray[np.float32]) -> Encoded:
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": scales,
        }
        latent, id_frames = self.encoder.run(None, feed)
        frames = np.asarray(id_frames).reshape(-1).astype(np.int64)
        return Encoded(np.ascontiguousarray(latent, dtype=np.float32), frames)

    def decode(self, encoded: Encoded, start: int, end: int) -> npt.NDArray[np.float32]:
        """The samples of frames ``[start, end)``, decoded with `CONTEXT_FRAMES` of the
        frames around them."""
        lo, hi = max(0, start - CONTEXT_FRAMES), min(encoded.frames, end + CONTEXT_FRAMES)
        (out,) = self.decoder.run(None, {self.latent_name: encoded.latent[:, :, lo:hi]})
        audio = np.asarray(out, dtype=np.float32).reshape(-1)
        return audio[(start - lo) * self.hop : (end - lo) * self.hop]

    def spans(self, encoded: Encoded, first_frames: int | None) -> Iterator[tuple[int, int]]:
        """The spans of frames to decode one after another: all at once (None), or the
        first ``first_frames`` alone, then spans each up to three times the audio
        before it (each is decoded while the ones before play); no span is shorter
        than the context it would cost."""
        n = encoded.frames
        start, end = 0, first_frames or n
        while end + 2 * CONTEXT_FRAMES < n:
            yield start, end
            start, end = end, end * 4
        yield start, n


def phoneme_spans(
    phonemes: list[str], id_map: Mapping[str, Sequence[int]], id_frames: npt.NDArray[np.int64], hop: int
) -> list[tuple[str, int, int]] | None:
    """Each phoneme with its samples ``[start, end)`` in its sentence's audio, from the
    frames of its ids. piper lays them out as BOS PAD (phoneme PAD)* EOS and drops the
    phonemes its map lacks; a phoneme's span here includes the PAD after it. None if
    the ids do not line up so."""
    from piper.const import BOS, EOS, PAD  # piper is imported with the engine, not before

    pad = id_map.get(PAD, [])
    bounds = np.concatenate([[0], np.cumsum(id_frames) * hop])
    spans, at = [], 0
    for phoneme in itertools.chain([BOS], phonemes, [EOS]):
        ids = id_map.get(phoneme)
        if ids is None:
            continue
        width = len(ids) + (len(pad) if phoneme != EOS else 0)
        if at + width > len(id_frames):
            return None
        spans.append((phoneme, int(bounds[at]), int(bounds[at + width])))
        at += width
    return spans[1:-1] if at == len(id_frames) else None  # without BOS and EOS


def word_spans(spans: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """Samples of each word of a sentence: its phonemes between spaces."""
    words: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for phoneme, start, end in spans:
        if phoneme == " ":
            if current is not None:
                words.append(current)
            current = None
        else:
            current = (start, end) if current is None else (current[0], end)
    if current is not None:
        words.append(current)
    return words
