"""The gRPC listener: `duplex.v1.Duplex` (duplex/transports/grpc_stream.py), standard health and
reflection. A message over ``max_message_bytes`` either way is refused by grpc itself
(RESOURCE_EXHAUSTED); ``Converse`` takes its ``handshake_timeout_s`` and
``slow_reader_timeout_s`` from the config."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from audio_io._proto import duplex_pb2, duplex_pb2_grpc
from duplex.config import Config
from duplex.sessions import Sessions
from duplex.transports.grpc_stream import DuplexService, StreamEnd, send_status

PUBLIC_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
DENY_WAIT_S = 5.0  # the refusal goes first, with nothing queued before it; no longer than this


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` metadata."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method or ""
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = str(metadata.get("authorization", "")).encode()
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(PUBLIC_METHODS) or hmac.compare_digest(given, self._expected):
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            refused = StreamEnd(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
            await send_status(context, refused, DENY_WAIT_S)

        # the refusal must have the method's own shape, or a streaming call sees INTERNAL
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class GrpcListener:
    """The grpc.aio server and its health servicer, which follows `Readiness`."""

    def __init__(self, config: Config, sessions: Sessions | None = None) -> None:
        interceptors = [_TokenInterceptor(config.auth_token)] if config.auth_token else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        if sessions is not None:
            converse = DuplexService(sessions, config.handshake_timeout_s, config.slow_reader_timeout_s)
            duplex_pb2_grpc.add_DuplexServicer_to_server(converse, self.server)
            services.append(duplex_pb2.DESCRIPTOR.services_by_name["Duplex"].full_name)
        reflection.enable_server_reflection(services, self.server)
        self.port = self.server.add_insecure_port(f"{config.host_for_url}:{config.grpc_port}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
