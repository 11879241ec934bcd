"""OpenTelemetry traces (``--otlp-traces-endpoint``): one ``llm_request`` span per HTTP request
with vLLM's ``gen_ai.*`` attributes, in the trace of the request's W3C ``traceparent``; spans
reach an OTLP/HTTP collector; the flag without the packages is an error naming them."""

import http.server
import sys
import threading
import time

import pytest

from kvserve.entrypoints.openai.tracing import RequestTracer, traces_url
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvserve.config import EngineArgs

    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter=exporter)
    args = EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS)
    with running_server(args, "tiny", request_tracer=tracer, log_requests=False) as s:
        yield s, exporter


def _spans(exporter, n: int):
    deadline = time.time() + 30
    while len(exporter.get_finished_spans()) < n and time.time() < deadline:
        time.sleep(0.02)
    return exporter.get_finished_spans()


def test_a_completion_is_one_span_in_the_callers_trace(traced):
    server, exporter = traced
    exporter.clear()
    prompt = list(range(10, 22))
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    with server.http(headers={"traceparent": TRACEPARENT}) as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (span,) = _spans(exporter, 1)
    assert span.name == "llm_request"
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16)
    a = span.attributes
    assert a["gen_ai.request.id"] == r.json()["id"]
    assert a["gen_ai.response.model"] == "tiny"
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (len(prompt), 5)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (5, 0.0)
    assert (a["gen_ai.request.top_p"], a["gen_ai.request.seed"], a["gen_ai.request.n"]) == (0.9, 7, 1)
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    e2e, ttft, queue = (a[f"gen_ai.latency.{k}"] for k in ("e2e", "time_to_first_token", "time_in_queue"))
    assert 0 <= queue <= ttft <= e2e
    assert span.end_time - span.start_time == pytest.approx(e2e * 1e9, abs=2e6)
    assert a["kvserve.status"] == "ok" and a["kvserve.endpoint"] == "completions"


def test_a_streamed_chat_without_traceparent_starts_a_trace(traced):
    server, exporter = traced
    exporter.clear()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    (span,) = _spans(exporter, 1)
    assert span.parent is None and span.context.trace_id != int(TRACE_ID, 16)
    a = span.attributes
    assert a["gen_ai.request.id"].startswith("chatcmpl-") and a["gen_ai.usage.num_sequences"] == 2
    assert a["gen_ai.request.n"] == 2 and len(a["gen_ai.response.finish_reasons"]) == 2


def test_spans_reach_an_otlp_http_collector():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        tracer = RequestTracer(f"http://127.0.0.1:{httpd.server_address[1]}")
        parent = tracer.context_from({"traceparent": TRACEPARENT})
        now = time.time()
        tracer.record(
            parent, now - 0.25, now, {"gen_ai.request.id": "cmpl-x", "gen_ai.usage.prompt_tokens": 3}
        )
        tracer.shutdown()  # flushes the batch
    finally:
        httpd.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    msg = ExportTraceServiceRequest.FromString(received[0][1])
    (span,) = [s for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert (
        span.name == "llm_request"
        and span.trace_id.hex() == TRACE_ID
        and span.parent_span_id.hex() == PARENT_ID
    )
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert (
        attrs["gen_ai.request.id"].string_value == "cmpl-x"
        and attrs["gen_ai.usage.prompt_tokens"].int_value == 3
    )
    assert (span.end_time_unix_nano - span.start_time_unix_nano) == pytest.approx(0.25e9, abs=1e3)


def test_endpoint_forms():
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("localhost:4317", "grpc://c:4317", "http://"):
        with pytest.raises(ValueError, match="must be the http:// or https:// URL of an OTLP/HTTP collector"):
            traces_url(bad)


@pytest.mark.parametrize(
    ("module", "package"),
    [("opentelemetry.sdk.trace", "opentelemetry-sdk"),
     ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry-exporter-otlp-proto-http")],
)  # fmt: skip
def test_the_flag_without_the_packages_names_them(monkeypatch, capsys, module, package):
    from kvserve.entrypoints.openai.api_server import main

    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ValueError, match=rf"needs the package {package}, .*pip install 'kvserve\[otel\]'"):
        RequestTracer("http://c:4318")
    # kvserve serve says so and exits 2 before loading a model
    assert main(["--model", "/nonexistent", "--otlp-traces-endpoint", "http://c:4318"]) == 2
    err = capsys.readouterr().err
    assert f"--otlp-traces-endpoint needs the package {package}" in err and "kvserve[otel]" in err
