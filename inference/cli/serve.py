"""`specheads serve`: the OpenAI-compatible server (`specheads.inference.serve.launch`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specheads.inference.cli import args as shared

NAME = "serve"
HELP = "serve OpenAI-compatible completions and chat completions"
DESCRIPTION = ("An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
               "/metrics) decoding with speculation; output is exact (greedy requests equal plain greedy decoding). "
               "Requests are decoded together, up to --max-batch per step.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_target(p)
    shared.add_method(p, help="the proposer, as in generate (default ar)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    shared.add_api_key(p, help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECHEADS_API_KEY if set)")
    p.add_argument("--model-name", help="the model name clients send (default: the --target value)")
    p.add_argument("--max-batch", type=int, default=4,
                   help="requests decoded together, one verify forward per step for all (default 4)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait beyond the --max-batch being decoded; more get HTTP 429 (default 64)")
    shared.add_max_tokens(p, default=2048, help="the most new tokens one request may ask for (default 2048)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds from arrival (queueing included) after which a request ends with finish_reason "
                        "'timeout' (default 600)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM or Ctrl-C: new requests get HTTP 503 and /health fails, waiting ones get a 503, "
                        "running ones have S seconds to finish before they end with finish_reason 'shutdown'; then "
                        "the server exits (a second signal stops it at once; default 10)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get HTTP 413 (default 1 MiB)")
    p.add_argument("--speculation", choices=("on", "off", "adaptive"),
                   help="on: every step drafts; off: every step is plain; adaptive: draft only where this machine's "
                        "calibration says it pays, by batch size and each request's acceptance (needs --calibration). "
                        "Default: adaptive with --calibration, else on. Output is exact in every mode")
    p.add_argument("--calibration", type=Path, metavar="JSON",
                   help="what `specheads calibrate` wrote for this target, method and machine")
    p.add_argument("--per-request-spec-decode-metrics", choices=("summary", "detailed"),
                   help="report every request's speculative acceptance in its usage (usage.spec_decode_metrics: "
                        "mean acceptance length 1 + accepted/drafts as vLLM's, τ, acceptance rate, drafted and "
                        "accepted tokens; detailed adds per-position acceptance). Default: only for requests that "
                        "send \"spec_decode_metrics\": true")
    shared.add_model_settings(p)


def run(args: argparse.Namespace) -> None:
    from specheads.inference.serve.launch import serve, serving_engine, speculation_mode
    from specheads.inference.serve.server import ServerSettings
    from specheads.inference.serve.service import ServiceLimits
    from specheads.target import stop_token_ids

    options = shared.method_options(args)  # checked before anything loads
    mode, profile = speculation_mode(args.speculation, args.calibration)
    limits = ServiceLimits(max_queue=args.max_queue, max_tokens=args.max_tokens, request_timeout_s=args.request_timeout,
                           shutdown_timeout_s=args.shutdown_timeout)
    settings = ServerSettings(model_name=args.model_name or args.target,
                              api_key=args.api_key or os.environ.get("SPECHEADS_API_KEY") or None,
                              max_body_bytes=args.max_body_bytes,
                              spec_decode_metrics=args.per_request_spec_decode_metrics)
    model, tokenizer = shared.load_model(args)
    proposer, label = shared.make_method(args, options, model, tokenizer)
    engine = serving_engine(model, proposer, label=label, max_batch=args.max_batch, mode=mode, profile=profile,
                            calibration=args.calibration, step=args.step, compile=args.compile,
                            backend=shared.target_backend(args, max_rows=args.max_batch))
    serve(engine, tokenizer, stop_token_ids(tokenizer, model), settings, limits, host=args.host, port=args.port)
