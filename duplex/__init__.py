"""duplex: a realtime full-duplex speech service."""

__version__ = "0.1.0"
