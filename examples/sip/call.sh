#!/bin/sh
# Call duplex's SIP line with baresip, headless: your WAV is the caller's voice, and
# what duplex answers is saved as a WAV.
#
#   examples/sip/call.sh question.wav sip:duplex@127.0.0.1:5060 reply.wav [listen_seconds]
#
# question.wav: mono 16-bit at 8 kHz, G.711's rate (duplex say "..." -o q.wav --rate 8000).
# After it, the line stays open listen_seconds (default 12) of silence for the answer
# (duplex hears the end of your turn in that pause); then baresip hangs up.
# duplex serves SIP when sip_port is set; if it also has sip_username and sip_password,
# give the same as SIP_USER and SIP_PASSWORD. Needs baresip (Debian: baresip-core).
set -eu

if [ $# -lt 3 ]; then
  echo "usage: $0 question.wav sip:duplex@HOST:PORT reply.wav [listen_seconds]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
question=$(realpath "$1")
uri=$2
reply=$(realpath "$3")
listen=${4:-12}

# baresip reads its config from a directory: a fresh copy of ours, with the WAV in it
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/baresip/config" "$work/config"
account=$(cat "$here/baresip/accounts")
if [ -n "${SIP_USER:-}" ]; then
  account="$account;auth_user=$SIP_USER;auth_pass=${SIP_PASSWORD:-}"  # SIP digest auth
fi
(umask 077 && printf '%s\n' "$account" > "$work/accounts")

# the question, then the silence to listen in: baresip hangs up when its file ends
seconds=$(python3 - "$question" "$work/question.wav" "$listen" <<'PY'
import sys, wave
source, target, listen = sys.argv[1], sys.argv[2], float(sys.argv[3])
with wave.open(source, "rb") as f:
    if (f.getnchannels(), f.getsampwidth(), f.getframerate()) != (1, 2, 8000):
        sys.exit(f"{source}: need mono 16-bit PCM at 8000 Hz")
    audio = f.readframes(f.getnframes())
audio += bytes(2 * int(listen * 8000))
with wave.open(target, "wb") as f:
    f.setnchannels(1), f.setsampwidth(2), f.setframerate(8000), f.writeframes(audio)
print(int(len(audio) / 2 / 8000) + 1)
PY
)

# dial at start; -t: quit in any case a little after the file's end
cd "$work"
baresip -f "$work" -e "/dial $uri" -t "$((seconds + 15))"

# sndfile recorded both directions: *-dec.wav is what baresip decoded, duplex's voice
for recording in "$work"/*-dec.wav; do
  [ -f "$recording" ] || { echo "no call audio was recorded (was the call answered?)" >&2; exit 1; }
  cp "$recording" "$reply"
  echo "saved duplex's side of the call to $reply"
  exit 0
done
