"""A real OTLP/gRPC trace receiver for tests: OpenTelemetry's own collector service definition
(``opentelemetry.proto.collector.trace.v1.TraceService``), served on loopback port 0, keeping
every span it is sent. What a collector (otel-collector, Jaeger, Tempo) receives, decoded
from the wire by the protocol's own messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from app.local_cluster import ClusterConfig


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: list[ReceivedSpan], lock: threading.Lock) -> None:
        self.spans, self.lock = spans, lock

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, port: int = 0) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Servicer(self._spans, self._lock), self._server
        )
        bound = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.endpoint = f"http://127.0.0.1:{bound}"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 60.0
    ) -> list[ReceivedSpan]:
        """The spans once ``done`` holds for them (polled; exporters batch), bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not received within {timeout_s} s; got {names}")
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


def traced_cluster(
    model: Path,
    redis_url: str,
    log_dir: Path,
    endpoint: str,
    num_decode: int = 1,
    decode_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
) -> ClusterConfig:
    """A cluster whose every component traces every request to ``endpoint``, every request
    disaggregated."""
    traced = ("--otlp-endpoint", endpoint, "--trace-sample-ratio", "1")
    return ClusterConfig(
        model=str(model),
        num_decode=num_decode,
        redis_url=redis_url,
        redis_namespace=log_dir.name,
        log_dir=log_dir,
        prefill_args=(*traced, *prefill_args),
        decode_args=(*traced, *decode_args),
        router_args=(*traced, "--local-prefill-tokens", "0"),
    )
