"""A real `specheads serve` app (`build_server`) behind uvicorn on a free loopback port, for tests."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.tree import DraftTree
from specheads.inference.serve.server import ServerSettings, build_server
from specheads.inference.serve.service import ServiceLimits

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
STOPS = [2]


class LiveServer:
    """`build_server` behind uvicorn on a free loopback port, in a thread."""

    def __init__(self, engine: Engine, tokenizer, *, api_key: str | None = None, stops=STOPS,
                 max_body_bytes: int = 4096, spec_decode_metrics: str | None = None, **limits) -> None:
        settings = ServerSettings(MODEL, api_key=api_key, max_body_bytes=max_body_bytes,
                                  spec_decode_metrics=spec_decode_metrics)
        self.app, self.service = build_server(engine, tokenizer, stops, settings, ServiceLimits(**limits))
        self.service.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from /metrics (0 when absent)."""
        want = "specheads:" + name + ("{" + ",".join(f'{k}="{v}"' for k, v in
                                                   sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
                                         + "}")
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.close()


class Slow:
    """Plain decoding that takes `delay` seconds per step, or waits for `gate` before each one."""

    needs_target_hidden = False

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.delay, self.gate, self.steps = delay, gate, 0

    def start(self, ctx, hidden):
        pass

    def on_verified(self, result, hidden):
        pass

    def propose(self, ctx):
        self.steps += 1
        if self.gate is not None:
            assert self.gate.wait(timeout=60)
        time.sleep(self.delay)
        return DraftTree.root_only(ctx.tokens[-1])


def wait_for(condition, timeout: float = 10.0) -> None:
    """Poll `condition` until it holds (a test fails after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
