"""Request traces: OpenTelemetry, exported over OTLP/gRPC, off unless configured.

One process, one tracer provider (``configure``, from ``ServerConfig.tracing`` at start-up;
``shutdown`` flushes it at exit). The router samples (``sample_ratio``, per trace) and starts
each request's trace (``router/request_trace.py``); the trace context travels to the workers
in gRPC metadata (W3C ``traceparent``: ``metadata``), and a worker's spans join the router's
trace only when the router sampled it (parent-based sampling: a worker starts no trace of its
own). With tracing off every call here is a cheap no-op and nothing is exported.

Who calls: ``pdserve.common.server.serve`` (configure, shutdown), the router's request trace,
the worker services (``worker_context`` on a call; ``record`` of spans after the fact from the
times they measured, or a live ``span``), and the KV transfer (``KVSender.begin_read`` and
``end_read``: the sender's span under the context a pull carries, ``TraceContext``). The span
names and attributes are in docs/observability.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)

# The W3C trace-context headers (``traceparent``, ``tracestate``) of the span a call
# continues, as (key, value) pairs: what crosses a process boundary (gRPC metadata, a Ray
# call's argument). Empty: not traced.
TraceContext = tuple[tuple[str, str], ...]
_HEADERS = frozenset({"traceparent", "tracestate"})


@dataclass(frozen=True)
class TracingConfig:
    # The OTLP/gRPC collector (e.g. http://otel-collector:4317); "": tracing off.
    endpoint: str = ""
    # The share of requests traced (the router decides; workers follow its decision).
    sample_ratio: float = 1.0
    # Plaintext to the collector (a sidecar or a collector on a trusted network).
    insecure: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"otlp_endpoint must be an http:// or https:// URL, got {self.endpoint!r}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


EXPORT_TIMEOUT_S = 3.0
_tracer: trace.Tracer | None = None
_provider: Any = None
# perf_counter -> epoch nanoseconds: spans are recorded from the monotonic clock the code
# measures with, and exported in wall-clock time.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def configure(config: TracingConfig | None, service_name: str, roots: bool) -> None:
    """Installs this process's tracer (once; a no-op when tracing is off). ``roots``: this
    process starts traces (the router), at the sample ratio; else it only continues them."""
    global _tracer, _provider
    if config is None or not config.enabled or _tracer is not None:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

    root = TraceIdRatioBased(config.sample_ratio) if roots else ALWAYS_OFF
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(root),
    )
    # A collector that is down or slow costs the requests nothing (spans are exported in the
    # background and dropped when the queue is full); each export, and so the flush at
    # shutdown, gives up after EXPORT_TIMEOUT_S.
    exporter = OTLPSpanExporter(
        endpoint=config.endpoint, insecure=config.insecure, timeout=EXPORT_TIMEOUT_S
    )
    processor = BatchSpanProcessor(
        exporter, schedule_delay_millis=500, export_timeout_millis=int(EXPORT_TIMEOUT_S * 1e3)
    )
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("pdserve")
    logger.info("tracing to %s (sample ratio %g)", config.endpoint, config.sample_ratio)


def shutdown() -> None:
    """Exports what is buffered (bounded by the SDK's export timeout) and stops."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def tracer() -> trace.Tracer | None:
    """This process's tracer; None when tracing is off."""
    return _tracer


def ns(perf_s: float) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds."""
    return _EPOCH_OFFSET_NS + int(perf_s * 1e9)


def metadata(span: trace.Span | None) -> TraceContext:
    """``span``'s context, for the next process (nothing when not recording)."""
    if span is None or not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def headers(invocation_metadata: Iterable[Any] | None) -> TraceContext:
    """The trace-context entries of a call's metadata (none of its other entries)."""
    return tuple(
        (str(item[0]), str(item[1]))
        for item in invocation_metadata or ()
        if len(item) == 2 and item[0] in _HEADERS
    )


def worker_context(invocation_metadata: Iterable[Any] | None) -> otel_context.Context | None:
    """The caller's trace context from a call's metadata (or a ``TraceContext``); None when
    tracing is off here or the caller sent none (or did not sample this request)."""
    if _tracer is None or not invocation_metadata:
        return None
    carrier: Mapping[str, str] = {
        str(item[0]): str(item[1]) for item in invocation_metadata if len(item) == 2
    }
    if "traceparent" not in carrier:
        return None
    ctx = propagate.extract(carrier)
    span_context = trace.get_current_span(ctx).get_span_context()
    return ctx if span_context.is_valid and span_context.trace_flags.sampled else None


def _context(parent: otel_context.Context | trace.Span) -> otel_context.Context:
    return parent if not isinstance(parent, trace.Span) else trace.set_span_in_context(parent)


@contextlib.contextmanager
def span(
    name: str,
    parent: otel_context.Context | trace.Span | None,
    start_s: float | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span | None]:
    """A live span over the ``with`` block (from ``start_s``, perf_counter seconds, when
    given), a child of ``parent``; an exception marks it failed. Yields None (and records
    nothing) when tracing is off or there is no parent: this process starts no trace here."""
    if _tracer is None or parent is None:
        yield None
        return
    start = ns(start_s) if start_s is not None else None
    live = _tracer.start_span(
        name, context=_context(parent), start_time=start, attributes=attributes
    )
    try:
        yield live
    except BaseException as exc:
        live.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        live.end()


def record(
    name: str,
    parent: otel_context.Context | trace.Span,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
) -> trace.Span | None:
    """A finished span from measured times (perf_counter seconds), a child of ``parent`` (a
    propagated context or a span). Returns it (ended) to parent others on; None when off."""
    if _tracer is None:
        return None
    done = _tracer.start_span(
        name, context=_context(parent), start_time=ns(start_s), attributes=attributes
    )
    done.end(end_time=ns(max(end_s, start_s)))
    return done


def record_call(
    invocation_metadata: Iterable[Any] | None,
    name: str,
    parts: Sequence[tuple[str, float]],
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A worker's span for a call it just finished, ending now and as long as its ``parts``
    (consecutive child spans: name, seconds), under the caller's span; nothing when the
    caller sent no sampled context or tracing is off here."""
    parent = worker_context(invocation_metadata)
    if parent is None:
        return
    end_s = time.perf_counter()
    start_s = end_s - sum(seconds for _, seconds in parts)
    call = record(name, parent, start_s, end_s, attributes)
    if call is None:
        return
    for part, seconds in parts:
        record(part, call, start_s, start_s + seconds)
        start_s += seconds
