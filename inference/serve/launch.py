"""`specheads serve`'s lifecycle: the engine its speculation mode and calibration ask for, and the HTTP server in a
thread of its own while the engine decodes in the main one, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer, Proposer
from specheads.inference.proposers.verify_cost import machine_key, prepare_verify_costs
from specheads.inference.serve.adaptive import (
    SpeculationProfile,
    check_profile,
    read_profile,
    speculation_policy,
)
from specheads.inference.serve.metrics import ServerMetrics
from specheads.inference.serve.server import ServerSettings, create_app
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
                   compile: bool = False) -> Engine:
    """The engine for `mode`: a profile made for another method or machine is refused, and one under which no batch
    size pays for speculation serves with plain steps (without the drafter's per-step upkeep)."""
    if not isinstance(proposer, AutoregressiveProposer):
        prepare_verify_costs(model, max_batch)
    if profile is not None:
        check_profile(profile, method=label, machine_key=machine_key(model), source=str(calibration))
        if profile.max_batch == 0:
            log.warning("%s: speculation paid at no calibrated batch size (tau %.2f); serving with plain steps",
                        calibration, profile.tau)
            proposer = AutoregressiveProposer()
    return Engine(model, proposer, max_rows=max_batch, speculation=speculation_policy(mode, profile), step=step,
                  compile=compile)


def serve(engine: Engine, tokenizer: Any, stop_token_ids: list[int], settings: ServerSettings, limits: ServiceLimits,
          *, host: str, port: int) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop taking requests, finish the ones being decoded and return.

    The engine decodes in this (the main) thread, the HTTP server in another: see `GenerationService.run`."""
    import uvicorn

    service = GenerationService(engine, stop_token_ids, ServerMetrics(settings.model_name, engine.max_context), limits)
    app = create_app(service, tokenizer, settings)
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    thread = threading.Thread(target=http.run, name="specheads-http", daemon=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a plain kill stops the server as Ctrl-C does
    thread.start()
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        thread.join(timeout=30)
        service.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
