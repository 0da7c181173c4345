"""OpenTelemetry: off and free by default; on, a child's span continues its parent's
`agent` call across processes (a real OTLP/HTTP collector on 127.0.0.1 receives them)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from swarm import telemetry
from swarm.cli import main
from swarm.testing.cluster import local_swarm
from swarm.testing.scripts import ByTask
from swarm.testing.server import Reply, ScriptedModelServer, ToolCall


def reset() -> None:
    telemetry._checked = False
    telemetry._tracer = None


@pytest.fixture(autouse=True)
def forget_telemetry() -> Iterator[None]:
    """Telemetry is decided once per process: a test that turned it on (and failed before
    turning it off) must not leave it on for the tests after it."""
    yield
    reset()


def test_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    reset()
    modules = set(sys.modules)
    with telemetry.span("anything", x=1):
        assert telemetry.traceparent() == ""
    assert not telemetry.enabled()
    assert not {m for m in set(sys.modules) - modules if m.startswith("opentelemetry")}


class Collector(ThreadingHTTPServer):
    """Receives OTLP/HTTP trace exports and keeps every span."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector.lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            collector.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def collector() -> Iterator[Collector]:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.mark.slow
def test_child_span_continues_the_parents_agent_call(
        collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    for name, value in otel.items():
        monkeypatch.setenv(name, value)
    reset()
    with ScriptedModelServer(responder=ByTask({
        "TRACED": [Reply(tool_calls=[ToolCall("agent", {"message": "LEAFKID work"},
                                              id="c0")]), Reply(content="root done")],
        "LEAFKID": [Reply(tool_calls=[ToolCall("run_cli", {"command": "true"})]),
                      Reply(content="kid done")],
    })) as model, local_swarm(tmp_path / "home", env=otel) as url:
        env = {k: "" for k in os.environ if k.startswith(("SWARM_", "OPENAI_", "EVA_"))}
        env.update(SWARM_BASE_URL=model.base_url, SWARM_REDIS_URL=url,
                   SWARM_HOME=str(tmp_path / "home"))
        result = CliRunner().invoke(main, ["run", "--yes", "--workers", "0", "-C",
                                           str(tmp_path), "TRACED job"], env=env)
        assert result.exit_code == 0, result.output
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with collector.lock:
                names = [s.name for s in collector.spans]
            if "agent" in names and names.count("model call") >= 4:
                break
            time.sleep(0.1)
    reset()
    names = sorted(s.name for s in collector.spans)
    assert names.count("agent") == 1 and names.count("tool agent") == 1, names
    spans = {s.name: s for s in collector.spans}
    assert {"swarm", "tool agent", "agent", "model call", "tool run_cli"} <= set(spans), spans
    call, child = spans["tool agent"], spans["agent"]
    # The worker's span is a child of the root's `agent` call: same trace, parent = the call.
    assert child.trace_id == call.trace_id == spans["swarm"].trace_id
    assert child.parent_span_id == call.span_id
    run_cli = spans["tool run_cli"]
    assert run_cli.trace_id == call.trace_id
