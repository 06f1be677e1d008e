"""`launch.serve` in a process of its own over the tests' tiny target, decoding plain steps of at least `--delay`
seconds per row (`Slow`), so that a test can signal it while requests run and wait:

    python -m tests.inference.serve.slow_serve --port P --delay 0.05 --max-batch 2 --max-queue 4 --shutdown-timeout 3
"""

from __future__ import annotations

import argparse
import logging

from specheads.inference.engine.engine import Engine
from specheads.inference.serve.launch import serve
from specheads.inference.serve.server import ServerSettings
from specheads.inference.serve.service import ServiceLimits
from tests.conftest import tiny_model, tiny_tokenizer
from tests.inference.serve.live_server import MODEL, STOPS, Slow


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--max-batch", type=int, default=2)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--shutdown-timeout", type=float, default=3.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as the CLI
    engine = Engine(tiny_model("llama", seed=0), Slow(delay=args.delay), max_rows=args.max_batch)
    serve(engine, tiny_tokenizer(), STOPS, ServerSettings(MODEL),
          ServiceLimits(max_queue=args.max_queue, max_tokens=200, shutdown_timeout_s=args.shutdown_timeout),
          host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
