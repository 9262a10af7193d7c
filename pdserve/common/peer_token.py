"""A per-cluster token on every internal call: on a shared host, plaintext loopback worker ports
are reachable by every local user, who could call ``PrefillAndDecode`` past the router's API
keys, drain workers, or pull KV. With a token (``pdserve up`` makes a random one; elsewhere
``PDSERVE_PEER_TOKEN``), internal servers refuse calls without it (UNAUTHENTICATED), and
every channel to a peer (``channels.peer_channel``) sends it. Health checks stay open (probes).
Mutual TLS, where set, authenticates peers as well; the token adds nothing to it but costs
nothing either.

One token per process: set by ``ServiceServer`` from its ``ServerConfig`` before any channel
or internal server is made (a process runs one component; in-process tests use none)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

METADATA_KEY = "x-pdserve-peer-token"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_token = ""


def use(token: str) -> None:
    """This process's token from now on (``""``: none)."""
    global _token
    _token = token


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    if not _token:
        return []
    return [kind(_token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """For an internal server (never the router's public port: API keys guard that)."""
    return [_RequireToken(_token)] if _token else []


class _SendToken:
    """Adds the token to a call's metadata. gRPC files a client interceptor under the first
    call kind it implements only, hence one subclass per kind below."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, self._token))
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnary(_SendToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStream(_SendToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnary(_SendToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _StreamStream(_SendToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        sent = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        given = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(given, self._token):
            return handler
        return _refusing(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        f"internal port: a call needs this cluster's token ({METADATA_KEY})",
    )


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and codecs) as ``handler`` that refuses the call."""
    codecs = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, *codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, *codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse, *codecs)
    return grpc.stream_stream_rpc_method_handler(_refuse, *codecs)
