"""A small Python client for ``pdserve.v1.Router`` (used by ``pdserve generate`` and tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.common.channels import GRPC_OPTIONS, insecure_channel
from pdserve.common.convert import finish_reason_from_proto
from pdserve.v1 import router_pb2, router_pb2_grpc


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    request_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    mean_tpot_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    num_migrations: int = 0

    def to_json_dict(self) -> dict[str, object]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
            },
            "ttft_s": self.ttft_s,
            "mean_tpot_s": self.mean_tpot_s,
        }


async def generate(
    stub: router_pb2_grpc.RouterStub,
    request: router_pb2.GenerateRequest,
    on_text: Callable[[str], None] = lambda text: None,
    timeout_s: float | None = None,
    api_key: str | None = None,
) -> GenerateResult:
    """Streams one request; ``on_text`` hears each text delta. Raises grpc.aio.AioRpcError."""
    result = GenerateResult()
    stream = stub.Generate(request, timeout=timeout_s, metadata=api_key_metadata(api_key))
    async for response in stream:
        if response.HasField("chunk"):
            result.token_ids.extend(response.chunk.token_ids)
            result.text += response.chunk.text
            if response.chunk.text:
                on_text(response.chunk.text)
        else:
            final = response.final
            result.finish_reason = finish_reason_from_proto(final.finish_reason)
            result.request_id = final.request_id
            result.prompt_tokens = final.usage.prompt_tokens
            result.completion_tokens = final.usage.completion_tokens
            result.cached_tokens = final.usage.cached_tokens
            result.ttft_s = final.timings.ttft_s
            result.mean_tpot_s = final.timings.mean_tpot_s
            result.prefill_s = final.timings.prefill_s
            result.transfer_s = final.timings.transfer_s
            result.num_migrations = final.num_migrations
    return result


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def router_channel(
    address: str, tls_ca: str | None = None, tls_server_name: str | None = None
) -> grpc.aio.Channel:
    """A channel to a router's public port; TLS (verifying the router against ``tls_ca``)
    when given. ``tls_server_name``: the name to verify when ``address`` is not one the
    certificate carries (a port-forward to 127.0.0.1)."""
    if tls_ca is None:
        return insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
    options = list(GRPC_OPTIONS)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)
