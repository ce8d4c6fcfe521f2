"""Talk to duplex with the official openai SDK, over its Realtime API (WebSocket
/v1/realtime): speak a WAV file, print the events that come back, save the reply audio.

    pip install openai
    python examples/realtime_openai.py question.wav reply.wav --url http://127.0.0.1:8000/v1

The WAV: mono 16-bit PCM at 24 kHz, the Realtime API's ``audio/pcm`` (make one with
``duplex say "What is the largest ocean on Earth?" -o question.wav --rate 24000``). If
the server has an auth_token, give it in DUPLEX_AUTH_TOKEN: the SDK sends its API key as
the bearer token. Nothing here is duplex's own code: this is the SDK as OpenAI documents it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import wave
from typing import Any

from openai import AsyncOpenAI

RATE = 24000
CHUNK = RATE // 10 * 2  # 100 ms of PCM16
SILENCE_AFTER_S = 1.5  # the server's VAD ends the turn when it hears a pause
WAIT_S = 90.0


def read_wav(path: str) -> bytes:
    with wave.open(path, "rb") as f:
        if f.getnchannels() != 1 or f.getsampwidth() != 2 or f.getframerate() != RATE:
            sys.exit(f"{path}: need mono 16-bit PCM at {RATE} Hz")
        return f.readframes(f.getnframes())


async def speak(conn: Any, pcm: bytes) -> None:
    """Append the audio as a microphone would, 100 ms at a time in real time, then a pause."""
    pcm += bytes(int(SILENCE_AFTER_S * RATE) * 2)
    for i in range(0, len(pcm), CHUNK):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + CHUNK]).decode())
        await asyncio.sleep(0.1)


async def main(question: str, reply_path: str, url: str) -> int:
    pcm = read_wav(question)
    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("DUPLEX_AUTH_TOKEN") or "none")
    reply = bytearray()
    async with client.realtime.connect(model="duplex") as conn:  # the model name is not used
        await conn.session.update(
            session={"type": "realtime", "instructions": "You are a helpful voice assistant. Be brief."}
        )
        speaking = asyncio.create_task(speak(conn, pcm))
        async with asyncio.timeout(WAIT_S):
            async for event in conn:  # typed events of the openai SDK
                if event.type == "response.output_audio.delta":
                    reply += base64.b64decode(event.delta)  # PCM16, 24 kHz
                    continue  # many of these: not printed
                print(event.type, flush=True)
                if event.type == "conversation.item.input_audio_transcription.completed":
                    print(f"  you said: {event.transcript}", flush=True)
                elif event.type == "response.output_audio_transcript.done":
                    print(f"  duplex said: {event.transcript}", flush=True)
                elif event.type == "error":
                    print(f"  {event.error.code}: {event.error.message}", file=sys.stderr)
                elif event.type == "response.done":
                    print(f"  status: {event.response.status}", flush=True)
                    break  # one question, one answer
        await speaking
    with wave.open(reply_path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes(bytes(reply))
    print(f"saved {len(reply) / 2 / RATE:.1f} s of reply audio to {reply_path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Ask duplex a spoken question with the openai SDK.")
    parser.add_argument("question", help="WAV file to speak (mono, 16-bit, 24 kHz)")
    parser.add_argument("reply", help="WAV file to write the reply to")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="duplex's HTTP address, with /v1")
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.question, args.reply, args.url)))
    except TimeoutError:
        sys.exit(f"no answer within {WAIT_S:.0f} s")
    except OSError as e:
        sys.exit(f"cannot reach {args.url}: {e}")
