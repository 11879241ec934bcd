"""OpenTelemetry traces of the HTTP generation requests (``kvserve serve --otlp-traces-endpoint URL``).

One span per request (``llm_request``, kind SERVER), from its arrival to its last byte, with
vLLM's ``gen_ai.*`` attribute names: the request id, the model, the main sampling fields, the
prompt and completion token counts, queue time, time to first token, end-to-end latency and
the finish reasons. A W3C ``traceparent`` (and ``tracestate``) header on the HTTP request makes
the span a child of the caller's span, in the caller's trace.

Spans go out over OTLP/HTTP (protobuf) in batches on a background thread
(``opentelemetry-exporter-otlp-proto-http``): it needs nothing beyond ``requests`` and
``protobuf``, where the gRPC exporter would bring ``grpcio``. Both packages are the ``otel``
extra (``pip install 'kvserve[otel]'``); without them the flag is an error naming them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger("kvserve.server.tracing")

#: The packages tracing needs, and the extra that installs them.
OTEL_PACKAGES = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
OTEL_EXTRA = "kvserve[otel]"
#: The OTLP/HTTP path of traces, added to an endpoint given without a path.
TRACES_PATH = "/v1/traces"
SPAN_NAME = "llm_request"


def _missing(package: str, flag: str) -> ValueError:
    return ValueError(
        f"{flag} needs the package {package}, which is not installed: "
        f"pip install '{OTEL_EXTRA}' (installs {' and '.join(OTEL_PACKAGES)})."
    )


def traces_url(endpoint: str, flag: str = "--otlp-traces-endpoint") -> str:
    """The URL spans are posted to: ``endpoint`` as given, with ``/v1/traces`` added when it
    has no path (``http://collector:4318`` -> ``http://collector:4318/v1/traces``).

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host (naming ``flag``).
    """
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"{flag} {endpoint!r} must be the http:// or https:// URL of an OTLP/HTTP collector "
            f"(e.g. http://localhost:4318{TRACES_PATH}); kvserve exports over HTTP, not gRPC."
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


class RequestTracer:
    """Makes one span per finished HTTP request and exports it.

    Args:
        endpoint: the collector's OTLP/HTTP URL (``traces_url``); spans are batched and sent
            on a background thread.
        exporter: instead of ``endpoint``, an OpenTelemetry ``SpanExporter`` that gets each
            span as it ends (tests: the SDK's ``InMemorySpanExporter``).
        service_name: the ``service.name`` resource attribute.
        flag: the setting named in errors.

    Raises:
        ValueError: neither or both of ``endpoint`` and ``exporter``; a bad ``endpoint``; the
            OpenTelemetry SDK or OTLP exporter package not installed (naming it and the extra).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        exporter: Any = None,
        service_name: str = "kvserve",
        flag: str = "--otlp-traces-endpoint",
    ):
        if (endpoint is None) == (exporter is None):
            raise ValueError("RequestTracer takes one of endpoint and exporter.")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise _missing("opentelemetry-sdk", flag) from None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        processor: Any
        if exporter is None:
            assert endpoint is not None
            url = traces_url(endpoint, flag)
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise _missing("opentelemetry-exporter-otlp-proto-http", flag) from None
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=url))
            self.url: str | None = url
        else:
            processor = SimpleSpanProcessor(exporter)
            self.url = None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvserve")
        self.propagator = TraceContextTextMapPropagator()

    def context_from(self, headers: Mapping[str, str]) -> Any:
        """The parent context of a request's span from its ``traceparent`` / ``tracestate``
        headers (an empty context, so a new trace, when absent or malformed)."""
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if headers.get(k)}
        return self.propagator.extract(carrier=carrier)

    def record(
        self,
        parent: Any,
        start: float,
        end: float,
        attributes: Mapping[str, Any],
        error: str | None = None,
    ) -> None:
        """Emit one ``llm_request`` span from ``start`` to ``end`` (seconds since the epoch)
        under ``parent`` (``context_from``), with ``attributes`` (None values left out); its
        status is ERROR with ``error`` as description when given. Never raises: a failure is
        logged (tracing must not fail a request)."""
        try:
            from opentelemetry.trace import SpanKind, Status, StatusCode

            attrs = {k: v for k, v in attributes.items() if v is not None}
            span = self.tracer.start_span(
                SPAN_NAME, context=parent, kind=SpanKind.SERVER, attributes=attrs, start_time=int(start * 1e9)
            )
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end(end_time=int(end * 1e9))
        except Exception as e:
            logger.warning("could not record a request's trace span: %r", e)

    def shutdown(self) -> None:
        """Send the spans still batched and stop the exporter (bounded by the SDK's timeouts)."""
        try:
            self.provider.shutdown()
        except Exception as e:
            logger.warning("could not flush the trace spans: %r", e)
