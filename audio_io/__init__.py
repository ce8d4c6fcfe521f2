"""Audio plumbing and transports: frames, resampling, G.711, pacing, playout ledger."""

from audio_io.frame import AudioFrame
from audio_io.ledger import PlayoutLedger, TextMark, TurnPlayout
from audio_io.pacer import Pacer
from audio_io.resample import Reframer, Resampler, downmix

__all__ = [
    "AudioFrame",
    "Pacer",
    "PlayoutLedger",
    "Reframer",
    "Resampler",
    "TextMark",
    "TurnPlayout",
    "downmix",
]
