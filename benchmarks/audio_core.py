"""Audio core: pacer timing under a busy event loop, resampler and G.711 cost and latency."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from audio_io import g711
from audio_io.frame import AudioFrame
from audio_io.pacer import Pacer
from audio_io.resample import Resampler
from benchmarks.common import new_plot, save_plot, write_result


async def _busy(stop: asyncio.Event, block_s: float, every_s: float) -> None:
    while not stop.is_set():
        end = time.perf_counter() + block_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(every_s)


async def pacer_run(frames: int, busy_tasks: int) -> np.ndarray:
    pacer = Pacer(period=0.020)
    for _ in range(frames):
        pacer.put(AudioFrame(np.zeros(320, dtype=np.int16), 16000))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_busy(stop, 0.004, 0.006)) for _ in range(busy_tasks)]
    released = []
    async for _ in pacer.frames():
        released.append(time.monotonic())
        if len(released) == frames:
            break
    stop.set()
    await asyncio.gather(*tasks)
    return np.array(released)


def bench_pacer(frames: int = 500) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fig, ax = new_plot()
    for busy in (0, 2):
        t = asyncio.run(pacer_run(frames, busy))
        periods_ms = np.diff(t) * 1000
        offsets_ms = (t - (t[0] + 0.020 * np.arange(frames))) * 1000
        out[f"busy_tasks_{busy}"] = {
            "frames": frames,
            "mean_period_ms": float(periods_ms.mean()),
            "p50_period_ms": float(np.percentile(periods_ms, 50)),
            "p99_period_ms": float(np.percentile(periods_ms, 99)),
            "max_period_ms": float(periods_ms.max()),
            "final_offset_ms": float(offsets_ms[-1]),
            "max_abs_offset_ms": float(np.abs(offsets_ms).max()),
        }
        ax.plot(offsets_ms, label=f"{busy} busy tasks (4 ms of every 10 ms each)")
    title = "Pacer: 20 ms frames against a drift-free grid"
    save_plot(fig, ax, "pacer", title, "release - ideal grid (ms)", xlabel="frame")
    return out


def bench_resampler(seconds: float = 10.0) -> dict[str, Any]:
    out = {}
    rng = np.random.default_rng(0)
    for in_rate, out_rate in ((48000, 16000), (16000, 48000), (8000, 16000), (16000, 8000), (22050, 16000)):
        x = rng.integers(-8000, 8000, int(in_rate * seconds)).astype(np.int16)
        chunk = in_rate // 50
        r = Resampler(in_rate, out_rate)
        started = time.perf_counter()
        sizes = [r.process(x[i : i + chunk]).size for i in range(0, x.size, chunk)]
        elapsed = time.perf_counter() - started
        first = next(i for i, s in enumerate(sizes) if s)
        lag = np.arange(1, len(sizes) + 1) * (out_rate // 50) - np.cumsum(sizes)
        out[f"{in_rate}->{out_rate}"] = {
            "real_time_factor": elapsed / seconds,
            "us_per_20ms_chunk": elapsed / len(sizes) * 1e6,
            "first_output_chunk": first,
            "max_buffered_ms": float(lag.max() / out_rate * 1000),
            "steady_chunk_sizes": sorted(set(sizes[5:])),
        }
    return out


def bench_g711(seconds: float = 60.0) -> dict[str, Any]:
    x = np.random.default_rng(0).integers(-32768, 32767, int(8000 * seconds)).astype(np.int16)
    out = {}
    for law, enc, dec in (
        ("ulaw", g711.ulaw_encode, g711.ulaw_decode),
        ("alaw", g711.alaw_encode, g711.alaw_decode),
    ):
        started = time.perf_counter()
        codes = enc(x)
        mid = time.perf_counter()
        dec(codes)
        end = time.perf_counter()
        out[law] = {
            "encode_x_real_time": seconds / (mid - started),
            "decode_x_real_time": seconds / (end - mid),
        }
    return out


def main() -> None:
    result = {"pacer": bench_pacer(), "resampler": bench_resampler(), "g711": bench_g711()}
    print(write_result("audio_core", result))


if __name__ == "__main__":
    main()
