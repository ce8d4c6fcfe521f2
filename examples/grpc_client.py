"""Talk to duplex over gRPC from Python: speak a WAV file, print what the server heard
and what it answered, and save the answer's audio.

    python examples/grpc_client.py question.wav reply.wav --target 127.0.0.1:50051

The WAV: mono, 16-bit, at 8, 16, 24 or 48 kHz (make one with
``duplex say "What is the largest ocean on Earth?" -o question.wav``). If the server
has an auth_token, give it in DUPLEX_AUTH_TOKEN. The client is the one that ships with
duplex (``pip install duplex``): `duplex.grpc_client`, over the messages generated from
proto/duplex.proto.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import wave

import grpc

from audio_io._proto import duplex_pb2 as pb
from duplex.grpc_client import Conversation, DuplexClient

RATES = (8000, 16000, 24000, 48000)  # what the server takes as PCM16
SILENCE_AFTER_S = 1.5  # the server decides the turn ended when it hears a pause
WAIT_S = 90.0  # longest the whole conversation may take


def read_wav(path: str) -> tuple[bytes, int]:
    with wave.open(path, "rb") as f:
        if f.getnchannels() != 1 or f.getsampwidth() != 2 or f.getframerate() not in RATES:
            sys.exit(f"{path}: need mono 16-bit PCM at one of {RATES} Hz")
        return f.readframes(f.getnframes()), f.getframerate()


async def speak(conversation: Conversation, pcm: bytes, rate: int) -> None:
    """Send the audio as a microphone would: 20 ms at a time, in real time."""
    chunk = rate // 50 * 2  # bytes in 20 ms
    pcm += bytes(int(SILENCE_AFTER_S * rate) * 2)
    for i in range(0, len(pcm), chunk):
        await conversation.send_audio(pcm[i : i + chunk])
        await asyncio.sleep(0.02)


async def main(question: str, reply_path: str, target: str) -> int:
    pcm, rate = read_wav(question)
    token = os.environ.get("DUPLEX_AUTH_TOKEN")
    audio_in = pb.AudioFormat(encoding=pb.PCM16, sample_rate=rate)
    async with DuplexClient(target, token) as client:
        try:
            conversation = await client.converse(input_format=audio_in)
        except grpc.aio.AioRpcError as e:  # refused: a wrong token, the server full or not ready
            print(f"could not start: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        out_rate = conversation.started.output_format.sample_rate  # the voice's, unless we asked
        speaking = asyncio.create_task(speak(conversation, pcm, rate))
        reply_audio, reply_text = bytearray(), ""
        async with asyncio.timeout(WAIT_S):
            async for event in conversation:  # ServerEvent messages, as they come, to the end
                kind = event.WhichOneof("event")
                if kind == "transcript" and event.transcript.final:
                    print(f"you said: {event.transcript.text}", flush=True)
                elif kind == "text":
                    reply_text += event.text.delta  # the reply's words, as the LLM writes them
                elif kind == "audio":
                    reply_audio += event.audio.data  # PCM16 at out_rate
                elif kind == "error":
                    print(f"error: {event.error.code}: {event.error.message}", file=sys.stderr)
                elif kind == "turn" and event.turn.kind == pb.TurnEvent.RESPONSE_DONE:
                    print(f"duplex said: {reply_text}", flush=True)
                    await speaking
                    await conversation.close()  # one question, one answer: half-close, the server ends
        code, details = await conversation.status()
    if code != grpc.StatusCode.OK:
        print(f"the call ended with {code.name}: {details}", file=sys.stderr)
        return 1
    with wave.open(reply_path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(out_rate)
        f.writeframes(bytes(reply_audio))
    print(f"saved {len(reply_audio) / 2 / out_rate:.1f} s of reply audio to {reply_path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Ask duplex a spoken question over gRPC.")
    parser.add_argument("question", help="WAV file to speak")
    parser.add_argument("reply", help="WAV file to write the reply to")
    parser.add_argument("--target", default="127.0.0.1:50051", help="the server's gRPC address")
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.question, args.reply, args.target)))
    except TimeoutError:
        sys.exit(f"no answer within {WAIT_S:.0f} s")
