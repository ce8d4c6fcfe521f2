"""Whisper's text decoder in numpy, with the silence's share of cross-attention computed once.

The ASR pass (`models.asr_runner`) encodes only the utterance and completes the encoder
output to Whisper's 1,500 positions with the states of 30 s of silence. CTranslate2's
decoder projects all 1,500 positions to cross-attention keys and values on every pass,
and that projection is most of a short utterance's decode (figures: docs/performance.md,
"Our own Whisper decoder"). Those keys and values depend only on the encoder states, so
for the silence positions they are the same on every pass: here they are projected
once, at start-up, and a pass projects only its own audio's positions (~150 for 3 s).

It also takes the whole prompt (previous text, task tokens and the committed words
forced as prefix) in one forward pass; CTranslate2 forces a prefix one decoder step per
token, each with its vocabulary projection.

What it decodes is what CTranslate2's ``Whisper.generate`` decodes with ``beam_size=1``:
greedy, Whisper's suppressed tokens at every step and the blank and end of text at the
first free one, ``max_length`` counted as CTranslate2 counts it, and the no-speech
probability at the start-of-transcript position. The weights are the model's own
(float16 in ``model.bin``), computed in float32.

Each step's best token is the float32 logits' argmax, found reading the vocabulary
projection as int8 (`models.int8_argmax`): in float32 that projection reads 80 MB a
token, the largest part of a pass (docs/performance.md, "The vocabulary projection read
as int8").
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from models.int8_argmax import Int8Argmax

Array = npt.NDArray[np.float32]

_CT2_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_CT2_BINARY_VERSION = 6
_GELU = 3  # CTranslate2's ActivationType for exact (erf) GELU, Whisper's


def read_ct2_weights(path: Path) -> dict[str, npt.NDArray[np.generic]]:
    """The variables of a CTranslate2 ``model.bin`` (format version 6), aliases resolved."""
    data = path.read_bytes()
    pos = 0

    def unpack(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return int(value)

    def string() -> str:
        nonlocal pos
        size = unpack("H")
        text = data[pos : pos + size - 1].decode()
        pos += size
        return text

    version = unpack("I")
    if version != _CT2_BINARY_VERSION:
        raise ValueError(f"{path}: CTranslate2 model format {version}, not {_CT2_BINARY_VERSION}")
    string()  # the spec's name
    unpack("I")  # its revision
    out: dict[str, npt.NDArray[np.generic]] = {}
    for _ in range(unpack("I")):
        name = string()
        shape = [unpack("I") for _ in range(unpack("B"))]
        kind = _CT2_DTYPES[unpack("B")]
        size = unpack("I")
        dtype = np.dtype(np.uint16 if kind == "bfloat16" else kind)
        out[name] = np.frombuffer(data, dtype, size // dtype.itemsize, pos).reshape(shape)
        pos += size
    for _ in range(unpack("I")):
        alias, target = string(), string()
        out[alias] = out[target]
    return out


def as_float32(weights: dict[str, npt.NDArray[np.generic]], name: str) -> Array:
    """A variable of `read_ct2_weights` in float32, whatever the model was converted to:
    float16 or float32, bfloat16 (kept as uint16), or int8/int16 with its ``_scale``."""
    value = weights[name]
    if value.dtype == np.uint16:  # bfloat16: the high half of a float32
        value = (value.astype(np.uint32) << 16).view(np.float32)
    if name + "_scale" in weights:  # CTranslate2 stores round(w * scale), per row for int8
        scale = np.asarray(weights[name + "_scale"], np.float32)
        value = value.astype(np.float32) / (scale[:, None] if scale.ndim else scale)
    return np.ascontiguousarray(value, np.float32)


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]  # the prefix and the decoded tokens, without the end of text
    # at the start of transcript; None when a prefix is forced (words were heard: the
    # pass is not dropped as silence, and the 80 MB projection it takes is saved)
    no_speech_prob: float | None


@dataclass(frozen=True)
class _Layer:
    self_ln: tuple[Array, Array]
    qkv: tuple[Array, Array]  # weights transposed: x @ w + b
    self_out: tuple[Array, Array]
    cross_ln: tuple[Array, Array]
    cross_q: tuple[Array, Array]
    cross_kv: tuple[Array, Array]
    cross_out: tuple[Array, Array]
    ffn_ln: tuple[Array, Array]
    ffn_in: tuple[Array, Array]
    ffn_out: tuple[Array, Array]


def _layer_norm(x: Array, p: tuple[Array, Array]) -> Array:
    mean = x.mean(-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(-1, keepdims=True)
    out: Array = centered / np.sqrt(var + 1e-5) * p[0] + p[1]
    return out


# Up to this many rows, a product with a weight matrix is one vector product per row:
# OpenBLAS packs the matrix on every matrix product, which costs more than reading it
# once a row for a few rows; at 8 the matrix product is ahead (figures:
# docs/performance.md, "Where eight sessions spend the service's Python threads"). A
# batch of decoding rows is at most `models.asr_queue.MAX_BATCH` (4) windows.
ROW_BY_ROW = 4


def _product(x: Array, w: Array) -> Array:
    """``x @ w``, row by row for a few rows (`ROW_BY_ROW`)."""
    if not 1 < x.shape[0] <= ROW_BY_ROW:
        out: Array = x @ w
        return out
    rows = np.empty((x.shape[0], w.shape[1]), np.float32)
    for i, row in enumerate(x):
        np.matmul(row, w, out=rows[i])
    return rows


def _linear(x: Array, p: tuple[Array, Array]) -> Array:
    out: Array = _product(x, p[0]) + p[1]
    return out


def _erf(x: Array) -> Array:
    # Abramowitz and Stegun 7.1.26: |error| < 1.5e-7, below float32's resolution of GELU here
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    out: Array = sign * (1.0 - poly * np.exp(-a * a))
    return out


def _gelu(x: Array) -> Array:
    out: Array = 0.5 * x * (1.0 + _erf(x * np.float32(0.7071067811865476)))
    return out


def _softmax(x: npt.NDArray[np.floating[Any]]) -> Array:
    e = np.exp(x - x.max(-1, keepdims=True))
    out: Array = (e / e.sum(-1, keepdims=True)).astype(np.float32, copy=False)
    return out


class _Row:
    """One window's decoding state: its cross-attention keys and values and its self-
    attention cache, per layer, as [heads, positions, head size]."""

    def __init__(self, cross: list[tuple[Array, Array]], capacity: int, heads: int, size: int) -> None:
        self.cross = cross
        self.keys = [np.empty((heads, capacity, size), np.float32) for _ in cross]
        self.values = [np.empty((heads, capacity, size), np.float32) for _ in cross]
        self.length = 0
        self.tokens: list[int] = []
        self.free_steps = 0
        self.done = False
        self.no_speech_prob: float | None = None


class WhisperDecoder:
    def __init__(
        self,
        model_dir: Path,
        silence_states: Array,
        *,
        eot: int,
        no_timestamps: int,
        sot: int,
        no_speech: int,
    ) -> None:
        weights = read_ct2_weights(model_dir / "model.bin")
        config = json.loads((model_dir / "config.json").read_text())
        if int(weights["decoder/activation"]) != _GELU or not int(weights["decoder/pre_norm"]):
            raise ValueError(f"{model_dir}: not a Whisper decoder this code computes")

        def f32(name: str) -> Array:
            return as_float32(weights, name)

        def linear(name: str) -> tuple[Array, Array]:
            return np.ascontiguousarray(f32(name + "/weight").T), f32(name + "/bias")

        def norm(name: str) -> tuple[Array, Array]:
            return f32(name + "/gamma"), f32(name + "/beta")

        self.heads = int(weights["decoder/num_heads"])
        self.layers: list[_Layer] = []
        while f"decoder/layer_{len(self.layers)}/ffn/linear_0/weight" in weights:
            p = f"decoder/layer_{len(self.layers)}"
            self.layers.append(
                _Layer(
                    norm(f"{p}/self_attention/layer_norm"),
                    linear(f"{p}/self_attention/linear_0"),
                    linear(f"{p}/self_attention/linear_1"),
                    norm(f"{p}/attention/layer_norm"),
                    linear(f"{p}/attention/linear_0"),
                    linear(f"{p}/attention/linear_1"),
                    linear(f"{p}/attention/linear_2"),
                    norm(f"{p}/ffn/layer_norm"),
                    linear(f"{p}/ffn/linear_0"),
                    linear(f"{p}/ffn/linear_1"),
                )
            )
        self.final_ln = norm("decoder/layer_norm")
        self.positions = f32("decoder/position_encodings/encodings")
        # the embeddings, a row per token, are the vocabulary projection too: a step's
        # best token is found reading them as int8 (`Int8Argmax`)
        self.vocabulary = Int8Argmax(f32("decoder/embeddings/weight"))
        self.width = self.vocabulary.weights.shape[1]
        self.head_size = self.width // self.heads
        self.eot, self.no_timestamps, self.sot, self.no_speech = eot, no_timestamps, sot, no_speech
        self.suppress = np.array(config["suppress_ids"], np.int64)
        self.suppress_begin = np.union1d(self.suppress, np.array(config["suppress_ids_begin"], np.int64))
        self.window = silence_states.shape[1]  # Whisper's 1,500 encoder positions
        self.silence = [self._cross(layer, silence_states[0]) for layer in self.layers]

    def _cross(self, layer: _Layer, states: Array) -> tuple[Array, Array]:
        kv = _linear(states, layer.cross_kv)
        keys = kv[:, : self.width].reshape(-1, self.heads, self.head_size).transpose(1, 0, 2)
        values = kv[:, self.width :].reshape(-1, self.heads, self.head_size).transpose(1, 0, 2)
        return np.ascontiguousarray(keys), np.ascontiguousarray(values)

    def generate(
        self,
        windows: list[tuple[Array, list[int], int]],
        drafts: list[list[int]] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[Decoded]:
        """Greedy decoding of each (encoder states of its audio, prompt, max_length)
        together, as CTranslate2's generate: ``prompt`` is previous text, the start of
        transcript, the task tokens up to ``<|notimestamps|>``, then the prefix the result
        continues; ``max_length`` counts as CTranslate2 counts it.

        ``drafts``: for each window, tokens its result may go on with (the last pass's
        words after the prefix). They go through with the prompt, in one forward pass,
        and each is kept while it is the token greedy decoding picks there: the result
        is the same, and the tokens the draft guessed right cost no step of their own.

        ``between_steps`` is called before each step after the prompts' (the ASR worker
        runs waiting finals there, in the middle of a partial pass)."""
        if not windows:
            return []
        rows: list[_Row] = []
        guesses: list[list[int]] = []
        checked: list[Array] = []  # per row, the outputs whose argmax is each next token
        for k, (encoded, prompt, max_length) in enumerate(windows):
            n = encoded.shape[0]
            if n > self.window:
                raise ValueError(f"{n} encoder positions, more than Whisper's window")
            cross = []
            for layer, (silent_k, silent_v) in zip(self.layers, self.silence, strict=True):
                keys, values = self._cross(layer, encoded)
                cross.append(
                    (np.concatenate([keys, silent_k[:, n:]], 1), np.concatenate([values, silent_v[:, n:]], 1))
                )
            start = prompt.index(self.no_timestamps)  # CTranslate2's start step: the prompt before it
            # and never past Whisper's last position (448)
            steps = min(max_length // 2, max_length - start, self.positions.shape[0] - len(prompt))
            if steps <= 0:
                raise ValueError(f"no step left: max_length {max_length}, a {len(prompt)}-token prompt")
            row = _Row(cross, len(prompt) + steps, self.heads, self.head_size)
            row.tokens = list(prompt[start + 1 :])
            row.free_steps = steps
            draft = [t for t in (drafts[k] if drafts else [])[: steps - 1] if t < self.eot]
            out = self._forward(self._embed(prompt + draft, 0), [row], prompt_rows=True)
            if not row.tokens:
                sot = prompt.index(self.sot)
                row.no_speech_prob = float(_softmax(self._logits(out[sot : sot + 1]))[0, self.no_speech])
            rows.append(row)
            guesses.append(draft)
            checked.append(out[len(prompt) - 1 :])
        # the first free step bans more tokens than the others
        firsts = self._best(np.concatenate([c[:1] for c in checked]), self.suppress_begin)
        after = self._best(np.concatenate([c[1:] for c in checked]), self.suppress)
        for row, draft, first in zip(rows, guesses, firsts, strict=True):
            picks, after = [first, *after[: len(draft)]], after[len(draft) :]
            kept = 0  # draft tokens picked where they stand: their keys and values are right
            for pick in picks:
                if not self._take(row, pick) or kept == len(draft) or pick != draft[kept]:
                    break
                kept += 1
            row.length -= len(draft) - kept  # the rest of the draft was not the text
        while step_rows := [row for row in rows if not row.done]:
            if between_steps is not None:
                between_steps()
            x = np.concatenate([self._embed([r.tokens[-1]], r.length) for r in step_rows])
            out = self._forward(x, step_rows, prompt_rows=False)
            for row, token in zip(step_rows, self._best(out, self.suppress), strict=True):
                self._take(row, token)
        return [Decoded(row.tokens, row.no_speech_prob) for row in rows]

    def _best(self, out: Array, banned: npt.NDArray[np.int64]) -> list[int]:
        """The token each row of the decoder's output picks, ``banned`` left out."""
        best: list[int] = self.vocabulary.argmax(_layer_norm(out, self.final_ln), banned).tolist()
        return best

    def _take(self, row: _Row, token: int) -> bool:
        """The row's next token was picked: whether decoding goes on after it."""
        row.free_steps -= 1
        if token == self.eot:
            row.done = True
            return False
        row.tokens.append(token)
        row.done = row.free_steps == 0
        return not row.done

    def _embed(self, tokens: list[int], position: int) -> Array:
        out: Array = self.vocabulary.weights[tokens] + self.positions[position : position + len(tokens)]
        return out

    def _logits(self, hidden: Array) -> Array:
        out: Array = _layer_norm(hidden, self.final_ln) @ self.vocabulary.weights.T
        return out

    def _forward(self, x: Array, rows: list[_Row], prompt_rows: bool) -> Array:
        """The decoder layers over ``x``: one row's whole prompt (``prompt_rows``), or one
        new token for each of ``rows``. Appends to their self-attention caches."""
        w, h, d = self.width, self.heads, self.head_size
        scale = np.float32(d**-0.5)
        spans = [(0, x.shape[0])] if prompt_rows else [(i, i + 1) for i in range(len(rows))]
        for index, layer in enumerate(self.layers):
            qkv = _linear(_layer_norm(x, layer.self_ln), layer.qkv)
            attended = np.empty((x.shape[0], w), np.float32)
            for row, (a, b) in zip(rows, spans, strict=True):
                t = b - a
                q = qkv[a:b, :w].reshape(t, h, d).transpose(1, 0, 2) * scale
                cache_k, cache_v = row.keys[index], row.values[index]
                end = row.length + t
                cache_k[:, row.length : end] = qkv[a:b, w : 2 * w].reshape(t, h, d).transpose(1, 0, 2)
                cache_v[:, row.length : end] = qkv[a:b, 2 * w :].reshape(t, h, d).transpose(1, 0, 2)
                scores = q @ cache_k[:, :end].transpose(0, 2, 1)
                if t > 1:  # causal within the new positions
                    scores[:, :, row.length :] += np.triu(np.full((t, t), -np.inf, np.float32), 1)
                attended[a:b] = (_softmax(scores) @ cache_v[:, :end]).transpose(1, 0, 2).reshape(t, w)
            x = x + _linear(attended, layer.self_out)
            cq = _linear(_layer_norm(x, layer.cross_ln), layer.cross_q)
            for row, (a, b) in zip(rows, spans, strict=True):
                t = b - a
                q = cq[a:b].reshape(t, h, d).transpose(1, 0, 2) * scale
                keys, values = row.cross[index]
                scores = q @ keys.transpose(0, 2, 1)
                attended[a:b] = (_softmax(scores) @ values).transpose(1, 0, 2).reshape(t, w)
            x = x + _linear(attended, layer.cross_out)
            x = x + _linear(_gelu(_linear(_layer_norm(x, layer.ffn_ln), layer.ffn_in)), layer.ffn_out)
        for row, (a, b) in zip(rows, spans, strict=True):
            row.length += b - a
        return x
