"""The Whisper runner: one pass over a window of audio (CTranslate2 via faster-whisper,
and our own decoder), on whichever thread calls it.

Whisper's encoder expects 30 s of audio, and padding every pass to 30 s costs the encoder
time of 30 s whatever the utterance's length. Instead each pass encodes only the
utterance (plus `TAIL_PAD` of silence) and completes the encoder output to Whisper's
1,500 positions with the encoder states of 30 s of silence, computed once at start-up.
The decoder then sees what it was trained on: speech followed by silence. It needs all
1,500 positions: truncated to the audio, or to the audio and some seconds of silence,
the encoder output makes the decoder loop on short utterances ("What time is it? What
time is it? ..."). The decoder is our own (`models.whisper_decoder`): the silence
positions' share of its cross-attention is computed once, not on every pass as
CTranslate2's decoder does. docs/performance.md has the figures.

Windows of several streams decode together (`transcribe_batch`); word times are a
second, optional step (`with_times`), since they cost a pass alignment. Pure compute:
which pass runs when is the pass queue's business (`models.asr_queue`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from audio_io.pcm import pcm16_to_float
from models.agreement import HypWord
from models.asr_types import PREVIOUS_TEXT_TOKENS, SAMPLE_RATE, Hypothesis, Window
from models.onnx_cpu import limit_blas_threads
from models.whisper_decoder import WhisperDecoder

WINDOW_S = 30
TAIL_PAD = int(0.3 * SAMPLE_RATE)
NO_SPEECH_THRESHOLD = 0.6
MAX_DECODE_TOKENS = 448  # Whisper's decoder context
WINDOW = WINDOW_S * SAMPLE_RATE - TAIL_PAD  # one pass of a one-shot transcription


class WhisperRunner:
    def __init__(
        self,
        model_path: str | Path,
        compute_type: str = "int8",
        cpu_threads: int = 1,
        device: str = "cpu",
        replicas: int = 1,
    ) -> None:
        import ctranslate2
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        limit_blas_threads()
        self._ct2 = ctranslate2
        self.model = WhisperModel(
            str(model_path),
            device=device,
            compute_type=compute_type,
            cpu_threads=cpu_threads,
            num_workers=replicas,  # CTranslate2 model replicas: passes that may run at once
        )
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe", language="en"
        )
        self._prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]
        silence = self.model.feature_extractor(np.zeros(WINDOW_S * SAMPLE_RATE, np.float32), padding=0)
        self._silence_states = self._encode(silence[:, : self.model.feature_extractor.nb_max_frames])
        tokenizer = self.tokenizer
        self.decoder = WhisperDecoder(
            Path(model_path),
            self._silence_states,
            eot=tokenizer.eot,
            no_timestamps=tokenizer.no_timestamps,
            sot=tokenizer.sot,
            no_speech=tokenizer.no_speech,
        )

    def _encode(self, features: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        view = self._ct2.StorageView.from_array(np.ascontiguousarray(features[None]))
        return np.array(self.model.model.encode(view, to_cpu=True))

    def transcribe(self, samples: npt.NDArray[np.int16]) -> str:
        """One-shot transcription of any length (`one_shot`), on the calling thread: for
        tools. A session's utterance goes through the worker queue instead
        (`AsrEngine.transcribe_queued`)."""
        passes = one_shot(pcm16_to_float(samples))
        try:
            window = next(passes)
            while True:
                window = passes.send(
                    self.transcribe_window(window.audio, window.offset, [], window.word_times)
                )
        except StopIteration as done:
            text: str = done.value
            return text

    def transcribe_window(
        self,
        audio: npt.NDArray[np.float32],
        offset: int,
        prefix: list[int],
        word_times: bool,
        previous: list[int] | None = None,
    ) -> Hypothesis:
        """One pass over at most 30 s of 16 kHz audio, continuing ``prefix`` tokens."""
        (hyp,) = self.transcribe_batch([Window(audio, offset, prefix, previous or [])])
        return self.with_times(hyp) if word_times and hyp.tokens else hyp

    def encode_audio(self, audio: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float32], int]:
        """The encoder states of the audio alone (with `TAIL_PAD` of silence), and its feature frames."""
        features = self.model.feature_extractor(
            np.concatenate([audio, np.zeros(TAIL_PAD, np.float32)]), padding=0
        )
        frames = features.shape[-1] - features.shape[-1] % 2
        return self._encode(features[:, :frames])[0], frames

    def completed(self, encoded: npt.NDArray[np.float32]) -> object:
        """The audio's encoder states completed to Whisper's 1,500 positions with the
        silence's, as CTranslate2 takes them."""
        states = np.concatenate([encoded[None], self._silence_states[:, encoded.shape[0] :]], axis=1)
        return self._ct2.StorageView.from_array(np.ascontiguousarray(states))

    def transcribe_batch(
        self, windows: list[Window], between: Callable[[], None] | None = None
    ) -> list[Hypothesis]:
        """One pass over each window, decoded together (`WhisperDecoder`): the same tokens
        as one by one, in less time. Without word times (`with_times` adds them to one).
        ``between`` is called once the audio is encoded and before each decoding step."""
        out = [Hypothesis([], "")] * len(windows)  # too short or silent: no words
        passes: list[tuple[int, npt.NDArray[np.float32], list[int], int]] = []
        for i, w in enumerate(windows):
            assert w.audio.size <= (WINDOW_S * SAMPLE_RATE) - TAIL_PAD, "window longer than Whisper's 30 s"
            if w.audio.size < SAMPLE_RATE // 10 or not np.any(w.audio):
                continue
            encoded, frames = self.encode_audio(w.audio)
            passes.append((i, encoded, self.prompt(w.previous) + w.prefix, frames))
        if not passes:
            return out
        if between is not None:
            between()
        # max_length counts the prompt, as CTranslate2's (a long previous text without it left no room at all)
        decoded = self.decoder.generate(
            [
                (e, p, min(MAX_DECODE_TOKENS, len(p) + int(8 * windows[i].audio.size / SAMPLE_RATE) + 16))
                for i, e, p, _ in passes
            ],
            [windows[i].draft for i, _, _, _ in passes],
            between,
        )
        for (i, encoded, _, frames), result in zip(passes, decoded, strict=True):
            if result.no_speech_prob is not None and result.no_speech_prob > NO_SPEECH_THRESHOLD:
                continue
            tokens = [t for t in result.tokens if t < self.tokenizer.eot]
            text = self.tokenizer.decode(tokens).strip()
            hyp = Hypothesis([], text, tokens, windows[i].offset, encoded, frames)
            out[i] = replace(hyp, words=self._words(hyp, times=False))
        return out

    def prompt(self, previous: list[int]) -> list[int]:
        """Decoder prompt: earlier text of the utterance (if any), then the task tokens."""
        context = [self.tokenizer.sot_prev, *previous[-PREVIOUS_TEXT_TOKENS:]] if previous else []
        return context + self._prompt

    def with_times(self, hyp: Hypothesis) -> Hypothesis:
        """Add word timestamps (cross-attention alignment: a cost on the pass that asks)."""
        return replace(hyp, words=self._words(hyp, times=True))

    def _words(self, hyp: Hypothesis, times: bool) -> list[HypWord]:
        tokens, offset = hyp.tokens, hyp.offset
        if not tokens:
            return []
        if times:
            assert hyp.encoded is not None
            aligned = self.model.find_alignment(
                self.tokenizer, [tokens], self.completed(hyp.encoded), hyp.frames
            )[0]
            spans = [(w["word"], tuple(w["tokens"]), w["start"], w["end"]) for w in aligned]
        else:
            texts, word_tokens = self.tokenizer.split_to_word_tokens(tokens + [self.tokenizer.eot])
            spans = [
                (t, tuple(ts), 0.0, 0.0)
                for t, ts in zip(texts, word_tokens, strict=True)
                if ts != [self.tokenizer.eot]
            ]
        words: list[HypWord] = []
        for text, toks, start, end in spans:
            s, e = offset + int(start * SAMPLE_RATE), offset + int(end * SAMPLE_RATE)
            if words and not text.startswith(" ") and not text[:1].isalnum():
                last = words[-1]  # punctuation belongs to the word before it
                words[-1] = HypWord(last.text + text, last.tokens + toks, last.start, max(last.end, e))
            else:
                words.append(HypWord(text, toks, s, e))
        return words


class OneShotPass(NamedTuple):
    audio: npt.NDArray[np.float32]
    offset: int  # stream position of audio[0]
    word_times: bool  # a window that is cut at a word needs its words' times


def one_shot(audio: npt.NDArray[np.float32]) -> Generator[OneShotPass, Hypothesis, str]:
    """The passes of a transcription of any length, and its text: 30 s windows, each but
    the last cut at a word (`_cut`) where the next one starts. Send each pass's hypothesis;
    the text is the generator's return value. The one loop of `WhisperRunner.transcribe`
    (passes on the calling thread) and `AsrEngine.transcribe_queued` (on the worker queue)."""
    parts, start = [], 0
    while start < audio.size:
        last = start + WINDOW >= audio.size
        hyp = yield OneShotPass(audio[start : start + WINDOW], start, not last)
        text, start = (hyp.text, audio.size) if last else _cut(hyp, start)
        parts.append(text)
    return " ".join(p for p in parts if p)


def _cut(hyp: Hypothesis, start: int) -> tuple[str, int]:
    """A window of a long transcription, not its last: its text up to the last word
    ending 2 s before the window's end, and where the next window starts (there)."""
    end = start + WINDOW
    keep = [w for w in hyp.words if w.end < end - 2 * SAMPLE_RATE] or hyp.words
    return "".join(w.text for w in keep).strip(), keep[-1].end if keep and keep[-1].end > start else end
