"""The ways in: one adapter per transport (WebRTC, gRPC, Twilio Media Streams, SIP/RTP,
the OpenAI Realtime WebSocket), all of one shape.

    wire ─► adapter (its protocol only) ─► SessionPort ─► Session   (duplex/port.py)
    wire ◄─ adapter's Wire ◄─ OutputStage ◄─ Sink ◄─ Session             (output.py)
    connection ◄──── Link ────► session: either ends, both end, once      (link.py)

A new transport writes a `Wire` (`rate`, `frame`, `event`, `end_reply`, `flushed`),
reads its `Outbox` (a writer task, or a 20 ms clock), turns its inbound messages into
`SessionPort` calls, and ties the two lifetimes with a `Link`.
"""
