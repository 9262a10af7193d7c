"""The public gRPC API's messages (``pdserve.v1.Router``) and the router's own types, converted
only here, at the gRPC frontend's edge (``router/service.py``): a ``GenerateRequest``'s bytes
into a ``Request`` (or a named refusal), each ``Result`` into a ``GenerateResponse``.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from pdserve.common.convert import (
    finish_reason_to_proto,
    logprobs_to_proto,
    sampling_from_proto,
)
from pdserve.v1 import router_pb2
from router.limits import RequestLimits, check_sizes
from router.request import Request
from router.request_class import Slo, Tenant
from router.result import Chunk, Result


@dataclass(frozen=True)
class Unparsable:
    """A request body protobuf could not parse; ``Generate`` refuses it by name."""

    message: str


def parse_request(data: bytes) -> router_pb2.GenerateRequest | Unparsable:
    """The request deserializer: a body that does not parse becomes a named INVALID_ARGUMENT
    (gRPC's own answer would be UNKNOWN)."""
    try:
        return router_pb2.GenerateRequest.FromString(data)
    except Exception:  # protobuf's DecodeError, or worse: nothing of it may escape
        field = invalid_utf8_field(data)
        if field is not None:
            return Unparsable(f"{field} is not valid UTF-8")
        return Unparsable("the request is not a valid pdserve.v1.GenerateRequest")


def request_from_proto(
    msg: router_pb2.GenerateRequest,
    client_id: str,
    tenant: Tenant,
    start_s: float,
    limits: RequestLimits,
    max_model_len: int,
) -> Request:
    """Raises ValueError naming the field: its sizes first (``router/limits.py``, before any
    of it is converted), then its sampling as ``SamplingParams`` checks it, then its flow
    control fields. ``tenant``: whose it is (its key is the caller strikes count)."""
    prompt = msg.prompt if msg.HasField("prompt") else None
    sampling = msg.sampling
    check_sizes(
        client_id,
        prompt,
        len(msg.prompt_token_ids),
        sampling.stop,
        len(sampling.stop_token_ids),
        limits,
        max_model_len,
    )
    params = sampling_from_proto(msg.sampling)
    priority = sampling.priority if sampling.HasField("priority") else None
    service_class = msg.service_class if msg.HasField("service_class") else None
    if service_class is not None and not 0 < len(service_class) <= _MAX_CLASS_CHARS:
        raise ValueError(f"service_class must be 1 to {_MAX_CLASS_CHARS} characters")
    slo = msg.slo
    return Request(
        client_id=client_id,
        params=params,
        caller=tenant.caller,
        start_s=start_s,
        prompt=prompt,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        tenant=tenant,
        service_class=service_class,
        priority=priority,
        slo=Slo(
            slo.ttft_s if slo.HasField("ttft_s") else None,
            slo.tpot_s if slo.HasField("tpot_s") else None,
        ),
    )


_MAX_CLASS_CHARS = 64  # a class name's length: a longer one names no class


def result_to_proto(result: Result) -> router_pb2.GenerateResponse:
    if isinstance(result, Chunk):
        return router_pb2.GenerateResponse(
            chunk=router_pb2.TokenChunk(
                token_ids=result.token_ids,
                text=result.text,
                logprobs=[logprobs_to_proto(lp) for lp in result.logprobs],
                prompt_logprobs=[logprobs_to_proto(lp) for lp in result.prompt_logprobs],
            )
        )
    return router_pb2.GenerateResponse(
        final=router_pb2.GenerateFinal(
            request_id=result.request_id,
            finish_reason=finish_reason_to_proto(result.finish_reason),
            usage=router_pb2.Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                cached_tokens=result.cached_tokens,
            ),
            timings=router_pb2.Timings(
                ttft_s=result.ttft_s,
                mean_tpot_s=result.mean_tpot_s,
                prefill_s=result.prefill_s,
                transfer_s=result.transfer_s,
                phases=result.phases,
            ),
            num_migrations=result.num_migrations,
        )
    )


# The string fields of a GenerateRequest, by field number (nested: sampling.stop).
_STRINGS = {1: "prompt", 4: "request_id", 5: "service_class"}
_SAMPLING, _STOP = 3, 7


def invalid_utf8_field(data: bytes) -> str | None:
    """The name of the first string field of a serialized GenerateRequest that is not valid
    UTF-8 (protobuf's parser only says that something is), or None."""

    def fields_of(raw: bytes) -> UnknownFieldSet | None:
        holder = empty_pb2.Empty()
        try:
            holder.ParseFromString(raw)
        except DecodeError:
            return None
        return UnknownFieldSet(holder)

    top = fields_of(data)
    if top is None:
        return None
    stops = 0
    for f in iter(top):  # iter(): the stub lacks __iter__ (it has __getitem__)
        if f.field_number in _STRINGS and not _is_utf8(f.data):
            return _STRINGS[f.field_number]
        if f.field_number == _SAMPLING and isinstance(f.data, bytes):
            inner = fields_of(f.data)
            for g in iter(inner) if inner is not None else ():
                if g.field_number == _STOP:
                    if not _is_utf8(g.data):
                        return f"stop[{stops}]"
                    stops += 1
    return None


def _is_utf8(value: object) -> bool:
    if not isinstance(value, bytes):
        return True
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
