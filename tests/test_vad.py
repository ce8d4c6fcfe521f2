"""Silero VAD engine with the bundled model, on speech synthesized by our own TTS."""

import asyncio

import numpy as np
import pytest

from models.vad import VadConfig, VadEventKind

GAPS = [0.5, 0.8, 1.2, 0.7, 1.0, 0.6]  # seconds of silence before each utterance (and after the last)


def timeline(speech_set, count: int = 5) -> tuple[np.ndarray, list[tuple[int, int]]]:
    parts, truth, position = [], [], 0
    for gap, utterance in zip(GAPS, speech_set[:count], strict=False):
        silence = np.zeros(int(gap * 16000), np.int16)
        parts += [silence, utterance.audio]
        start, end = utterance.voiced
        truth.append((position + silence.size + start, position + silence.size + end))
        position += silence.size + utterance.audio.size
    parts.append(np.zeros(int(GAPS[-1] * 16000), np.int16))
    return np.concatenate(parts), truth


async def run_vad(vad_engine, audio: np.ndarray, chunk: int, config: VadConfig | None = None) -> list:
    stream = vad_engine.stream(config)
    events = []
    for i in range(0, audio.size, chunk):
        events += await stream.push(audio[i : i + chunk])
    return events


async def test_speech_segments_within_60ms_of_the_truth(vad_engine, speech_set):
    audio, truth = timeline(speech_set)
    events = await run_vad(vad_engine, audio, 320)
    starts = [e.position for e in events if e.kind is VadEventKind.SPEECH_START]
    ends = [e.position for e in events if e.kind is VadEventKind.SPEECH_END]
    assert len(starts) == len(ends) == len(truth), events
    for (start, end), (true_start, true_end) in zip(zip(starts, ends, strict=True), truth, strict=True):
        assert abs(start - true_start) <= 0.060 * 16000, (start / 16000, true_start / 16000)
        assert abs(end - true_end) <= 0.060 * 16000, (end / 16000, true_end / 16000)


@pytest.mark.parametrize("chunk", [160, 512, 777, 16000])
async def test_chunking_does_not_change_the_events(vad_engine, speech_set, chunk):
    audio, _ = timeline(speech_set, 2)
    assert await run_vad(vad_engine, audio, chunk) == await run_vad(vad_engine, audio, 320)


async def test_a_pause_is_announced_before_the_end_at_the_same_position(vad_engine, speech_set):
    audio, _ = timeline(speech_set, 1)
    events = await run_vad(vad_engine, audio, 320)
    kinds = [e.kind for e in events]
    assert kinds[0] is VadEventKind.SPEECH_START and kinds[-1] is VadEventKind.SPEECH_END
    pause = [e for e in events if e.kind is VadEventKind.PAUSE][-1]
    assert pause.position == events[-1].position


async def test_a_held_pause_ends_the_utterance_only_after_its_own_silence(vad_engine, speech_set):
    """Two sentences 700 ms apart: with ``min_silence_ms`` 500 they are two utterances,
    each ended after 500 ms. A session that holds each pause for 900 ms (the words before
    it sound unfinished) gets one, ended by the trailing second of silence after 900."""
    voiced = [u.audio[slice(*u.voiced)] for u in speech_set[:2]]
    silence = [np.zeros(int(s * 16000), np.int16) for s in (0.5, 0.7, 1.0)]
    audio = np.concatenate([silence[0], voiced[0], silence[1], voiced[1], silence[2]])
    config = VadConfig(min_silence_ms=500, pause_ms=96)
    plain = [e for e in await run_vad(vad_engine, audio, 320, config) if e.kind is VadEventKind.SPEECH_END]
    assert [e.silence_ms for e in plain] == [500, 500]
    stream, held = vad_engine.stream(config), []
    for i in range(0, audio.size, 320):
        for event in await stream.push(audio[i : i + 320]):
            held.append(event)
            if event.kind is VadEventKind.PAUSE:
                assert stream.pause is not None
                stream.hold_pause(stream.pause, 900)
    pauses = [e for e in held if e.kind is VadEventKind.PAUSE]
    ends = [e for e in held if e.kind is VadEventKind.SPEECH_END]
    assert len(pauses) >= 2 and [e.silence_ms for e in ends] == [900]
    assert ends[0].position == plain[1].position  # where the second sentence's voice stops


async def test_min_speech_filters_short_blips(vad_engine, speech_set):
    word = speech_set[3].audio  # "No, thanks." (~0.9 s)
    audio = np.concatenate([np.zeros(8000, np.int16), word, np.zeros(16000, np.int16)])
    assert [e for e in await run_vad(vad_engine, audio, 320, VadConfig(min_speech_ms=2000))] == []
    assert await run_vad(vad_engine, audio, 320, VadConfig(min_speech_ms=96))


async def test_prefix_padding_moves_only_the_start(vad_engine, speech_set):
    audio, _ = timeline(speech_set, 1)
    plain = await run_vad(vad_engine, audio, 320)
    padded = await run_vad(vad_engine, audio, 320, VadConfig(prefix_pad_ms=300))
    assert [e.kind for e in padded] == [e.kind for e in plain]
    assert plain[0].position - padded[0].position == (300 - 30) * 16
    assert [e.position for e in padded[1:]] == [e.position for e in plain[1:]]


async def test_silence_and_zeros_give_no_events(vad_engine):
    assert await run_vad(vad_engine, np.zeros(32000, np.int16), 320) == []
    assert await vad_engine.stream().push(np.zeros(0, np.int16)) == []


async def test_sessions_are_batched_and_independent(vad_engine, speech_set):
    audio, _ = timeline(speech_set, 2)
    alone = await run_vad(vad_engine, audio, 320)
    # streamed side by side, as sessions are, each gets exactly its own events
    together = await asyncio.gather(*(run_vad(vad_engine, audio, 320) for _ in range(4)))
    assert all(events == alone for events in together)
    # audio waiting in four streams when the worker wakes runs as one batch per window:
    # the worker is held until all four have queued theirs, so this does not depend on
    # how fast the machine is (which streams happen to be waiting together does)
    streams = [vad_engine.stream() for _ in range(4)]
    batches_before, windows_before = vad_engine.batches_run, vad_engine.windows_run
    with vad_engine._lock:  # reentrant: `wake` takes it on this thread too
        pushes = [asyncio.create_task(stream.push(audio)) for stream in streams]
        while len(vad_engine._streams) < len(streams):  # noqa: ASYNC110 (a thread's set, no event)
            await asyncio.sleep(0)
    batched = await asyncio.gather(*pushes)
    assert all(events == alone for events in batched)
    windows = vad_engine.windows_run - windows_before
    assert windows == 4 * (audio.size // 512)
    assert vad_engine.batches_run - batches_before == windows // 4


async def test_bad_input_is_refused_and_the_engine_lives_on(vad_engine, speech_set):
    stream = vad_engine.stream()
    with pytest.raises(TypeError, match="int16"):
        await stream.push(np.zeros(512, np.float32))
    with pytest.raises(ValueError, match="threshold"):
        VadConfig(threshold=1.5)
    clipped = np.where(np.random.default_rng(0).standard_normal(48000) > 0, 32767, -32768).astype(np.int16)
    await run_vad(vad_engine, clipped, 320)  # whatever it decides, it decides
    audio, truth = timeline(speech_set, 1)
    events = await run_vad(vad_engine, audio, 320)
    assert len([e for e in events if e.kind is VadEventKind.SPEECH_END]) == len(truth)
