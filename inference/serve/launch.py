"""`specheads serve`'s lifecycle: the engine its speculation mode and calibration ask for, and the HTTP server in a
thread of its own while the engine decodes in the main one, until SIGTERM or Ctrl-C drains it (a second one stops it
at once)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer, Proposer
from specheads.inference.engine.target_backend import TargetBackend
from specheads.inference.proposers.verify_cost import forward_key, prepare_verify_costs
from specheads.inference.serve.adaptive import (
    SpeculationProfile,
    check_profile,
    read_profile,
    speculation_policy,
)
from specheads.inference.serve.server import ServerSettings, build_server
from specheads.inference.serve.service import GenerationService, ServiceLimits

log = logging.getLogger("specheads.serve")


def speculation_mode(speculation: str | None, calibration: Path | None) -> tuple[str, SpeculationProfile | None]:
    """The mode (default: adaptive with a calibration, else on) and the calibration read, before any model loads."""
    mode = speculation or ("adaptive" if calibration else "on")
    if mode == "adaptive" and calibration is None:
        raise ValueError("--speculation adaptive needs --calibration JSON; write one with `specheads calibrate` "
                         "(same --target, --method and options)")
    if calibration is not None and mode != "adaptive":
        raise ValueError(f"--calibration is read by --speculation adaptive only, not {mode}; drop one of them")
    return mode, read_profile(calibration) if calibration else None


def serving_engine(model: PreTrainedModel, proposer: Proposer, *, label: str, max_batch: int, mode: str,
                   profile: SpeculationProfile | None, calibration: Path | None = None, step: str = "auto",
                   compile: bool = False, backend: TargetBackend | None = None) -> Engine:
    """The engine for `mode`: a profile made for another method or machine is refused, and one under which no batch
    size pays for speculation serves with plain steps (without the drafter's per-step upkeep). `backend`: what runs
    the target (default: our PyTorch forward, `step` and `compile`)."""
    if not isinstance(proposer, AutoregressiveProposer):
        prepare_verify_costs(model if backend is None else backend, max_batch)
    if profile is not None:
        check_profile(profile, method=label, machine_key=forward_key(model, backend), source=str(calibration))
        if profile.max_batch == 0:
            log.warning("%s: speculation paid at no calibrated batch size (tau %.2f); serving with plain steps",
                        calibration, profile.tau)
            proposer = AutoregressiveProposer()
    return Engine(model, proposer, max_rows=max_batch, speculation=speculation_policy(mode, profile), step=step,
                  compile=compile, backend=backend)


HTTP_CLOSE_S = 5.0  # after the last answer, how long uvicorn may take to write the responses and close


def serve(engine: Engine, tokenizer: Any, stop_token_ids: list[int], settings: ServerSettings, limits: ServiceLimits,
          *, host: str, port: int) -> None:
    """Serve until SIGTERM or Ctrl-C, then drain and return: new requests get 503 and `/health` fails, waiting ones
    are answered with a 503, running ones finish, or end with finish reason "shutdown" once
    `limits.shutdown_timeout_s` has passed. A second signal stops at once (running requests get a 503).

    The engine decodes in this (the main) thread, the HTTP server in another: see `GenerationService.run`."""
    import uvicorn

    app, service = build_server(engine, tokenizer, stop_token_ids, settings, limits)
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                         timeout_graceful_shutdown=int(HTTP_CLOSE_S)))
    thread = threading.Thread(target=http.run, name="specheads-http", daemon=True)
    previous = {sig: signal.signal(sig, _Shutdown(service)) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread.start()
    try:
        while not http.started:
            if not thread.is_alive():  # uvicorn logged why (the port taken, mostly) and gave up
                raise RuntimeError(f"the HTTP server could not listen on {host}:{port} (its error is above); "
                                   "free the port or pick another --port")
            time.sleep(0.05)
        service.run()
    except KeyboardInterrupt:
        log.warning("stopped at once: the requests that were running got an error")
    finally:
        http.should_exit = True
        thread.join(timeout=HTTP_CLOSE_S + 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Shutdown:
    """The signal handler: the first signal drains the service (it only sets its deadline: safe whatever the main
    thread holds), the second raises KeyboardInterrupt to stop now."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def __call__(self, signum, frame) -> None:
        if self.service.draining:
            raise KeyboardInterrupt
        self.service.drain()
