"""The serving loop: requests wait in a bounded queue and one worker thread decodes them with the engine.

The server (`server.py`) turns HTTP requests into `Job`s and hands them here; the worker decodes them as rows of
the engine's batch (`Engine.add`/`step`, up to `engine.max_rows` at once, joining and leaving between steps), so
each answer is exactly what `specheads generate` gives for the same prompt and sampling. A job ends at a stop token,
its token limit, its deadline (`request_timeout_s` from its arrival, queueing included: finish reason "timeout") or
its cancellation (a client that left: "cancelled"), and its slot goes to the next job at once.

Admission: the service holds at most `engine.max_rows + max_queue` requests, those being decoded and those waiting;
one more is refused (`QueueFull`, HTTP 429). Shutdown (`drain`, on SIGTERM or Ctrl-C): nothing more is admitted
(`ShuttingDown`, HTTP 503), waiting requests are answered with `ShuttingDown`, and running ones finish; those still
running `shutdown_timeout_s` later end at their next step with finish reason "shutdown". Every admitted request is
answered. A proposer that fails
makes its step a plain step (`Engine` fallback): the request completes, the fallback counter moves and the error is
logged once per reason. Each job keeps its timeline (`request_times.py`) for the request metrics, and every finished
request's acceptance is logged at debug level (`spec_decode_metrics.log_line`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specheads.inference.engine.constraint import GrammarConstraint
from specheads.inference.engine.engine import Engine, GenerationResult
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.serve.metrics import ServerMetrics
from specheads.inference.serve.request_times import RequestTimes
from specheads.inference.serve.spec_decode_metrics import log_line

log = logging.getLogger(__name__)


IDLE_POLL_S = 0.2  # how often an idle worker looks for a shutdown (a signal handler cannot wake a blocked queue)


@dataclass(frozen=True)
class ServiceLimits:
    max_queue: int = 64  # requests waiting beyond the engine's rows being decoded; more are refused (HTTP 429)
    max_tokens: int = 2048  # the most new tokens one request may ask for
    request_timeout_s: float = 600.0  # from arrival to the last token, queueing included
    shutdown_timeout_s: float = 10.0  # on shutdown, how long running requests may go on before they are ended

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


class QueueFull(Exception):
    """The service holds as many requests as it may (decoding and waiting)."""


class ShuttingDown(Exception):
    """The service is draining: it admits nothing more, and a request that was waiting will not run."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    # Both are called from the worker thread: each step's new tokens (return a finish reason to end the job
    # there, e.g. "stop" when a stop string appeared), then once the result, or the error that ended it.
    on_tokens: Callable[[list[int]], str | None]
    on_done: Callable[[GenerationResult | None, BaseException | None], None]
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrived=time.monotonic()))
    cancelled: threading.Event = field(default_factory=threading.Event)
    request_id: str = ""  # the response's id, for the log
    constraint: GrammarConstraint | None = None  # the request's grammar (structured outputs), or None

    def cancel(self) -> None:
        """End the job at its next step (or skip it while queued): its client is gone."""
        self.cancelled.set()


class GenerationService:
    def __init__(self, engine: Engine, stop_token_ids: Sequence[int], metrics: ServerMetrics,
                 limits: ServiceLimits = ServiceLimits()) -> None:
        self.engine, self.stop_token_ids, self.metrics, self.limits = engine, list(stop_token_ids), metrics, limits
        engine.fallback = self._fell_back
        self.capacity = engine.max_rows + limits.max_queue  # requests held at once: decoding and waiting
        self._queue: queue.Queue[Job] = queue.Queue()  # bounded by `capacity`, counted in `_held`
        self._admission = threading.Lock()  # makes "admit or refuse" and the final refusals one step each
        self._held = 0  # admitted requests not answered yet
        # Set once by `drain`, read by the worker and `submit`. A bare assignment, so that a signal handler may do it
        # while this thread holds any lock.
        self._drain_deadline: float | None = None
        self._logged_reasons: set[str] = set()
        self._worker = threading.Thread(target=self.run, name="specheads-engine", daemon=True)
        self._drafts = not isinstance(engine.proposer, AutoregressiveProposer)
        self._show_enabled()

    def start(self) -> None:
        """Decode in a thread of its own (`run` there)."""
        self._worker.start()

    @property
    def draining(self) -> bool:
        """Whether `drain` was called: nothing more is admitted."""
        return self._drain_deadline is not None

    def drain(self, timeout_s: float | None = None) -> None:
        """Begin the shutdown: admit nothing more, answer the waiting requests with `ShuttingDown`, let the running
        ones finish, and end those still running `timeout_s` from now (default `limits.shutdown_timeout_s`) with
        finish reason "shutdown"; `run` returns once every request is answered. Safe in a signal handler; a second
        call changes nothing."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + (self.limits.shutdown_timeout_s if timeout_s is None
                                                       else timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """`drain`, then wait for the worker thread (started by `start`) to answer everything and stop."""
        self.drain(timeout_s)
        if self._worker.is_alive():
            self._worker.join(timeout=(self._drain_deadline - time.monotonic()) + 60)

    def submit(self, job: Job) -> None:
        """Admit `job` (it will be answered through `job.on_done`), or refuse it: `ShuttingDown`, `QueueFull`."""
        with self._admission:
            if self.draining:
                raise ShuttingDown("the server is shutting down and takes no new requests; retry on another replica")
            if self._held >= self.capacity:
                raise QueueFull(f"the server holds {self._held} requests already ({self.engine.max_rows} decoding, "
                                f"{self.limits.max_queue} waiting); retry later")
            self._held += 1
            self.metrics.labels(self.metrics.waiting).inc()
            self._queue.put_nowait(job)

    def _answer(self, job: Job, result: GenerationResult | None, err: BaseException | None) -> None:
        with self._admission:
            self._held -= 1
        job.on_done(result, err)

    def _refuse_waiting(self, why: str) -> None:
        """Answer every waiting job with `ShuttingDown` (call with `_admission` held where nothing may be admitted
        after it)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            self.metrics.labels(self.metrics.waiting).dec()
            self._finished(job, GenerationStats(finish_reason="shutdown"))
            self._held -= 1
            job.on_done(None, ShuttingDown(why))

    def _show_enabled(self) -> None:
        """Whether the next step (of as many rows as are running now, at least one) may draft."""
        on = self._drafts and self.engine.speculation.enabled(max(self.engine.num_running, 1))
        self.metrics.labels(self.metrics.enabled).set(1 if on else 0)

    def _fell_back(self, reason: str, err: Exception) -> None:
        self.metrics.labels(self.metrics.fallbacks, reason=reason).inc()
        if reason not in self._logged_reasons:  # once per reason: a broken proposer fails at every step
            self._logged_reasons.add(reason)
            log.warning("speculation fell back to plain decoding (%s): %s: %s", reason, type(err).__name__, err)

    def run(self) -> None:
        """Decode, in the calling thread, until a `drain` has answered every request. Continuous batching: between
        engine steps, waiting jobs join while rows are free (it waits on the queue only when nothing is in flight);
        each finished row answers its job at once.

        `specheads serve` calls this from the main thread, the HTTP server running in another: with torch's OpenMP
        backend the main thread's parallel regions reuse a team of spinning workers, and on a 2-core CPU the same
        decode took twice as long from another thread (2.3 s against 4.2 s for 64 tokens of the default target)."""
        jobs: dict[int, Job] = {}  # id(sequence) -> its job
        try:
            self._decode(jobs)
        finally:  # only a KeyboardInterrupt (a forced stop) leaves jobs here: they are answered all the same
            for job in jobs.values():
                self._answer(job, None, ShuttingDown("the server was stopped before this request finished"))
            with self._admission:
                self._drain_deadline = self._drain_deadline or time.monotonic()
                self._refuse_waiting("the server was stopped before this request started")

    def _decode(self, jobs: dict[int, Job]) -> None:
        logged_drain = False
        while True:
            draining = self.draining
            if draining:
                if not logged_drain and (jobs or not self._queue.empty()):
                    log.warning("shutting down: %d running requests have %.1f s to finish, %d waiting ones are refused",
                                len(jobs), max(0.0, self._drain_deadline - time.monotonic()), self._queue.qsize())
                logged_drain = True
                with self._admission:
                    self._refuse_waiting("the server is shutting down; this request was waiting and did not start")
                    if not jobs:
                        return
            while not draining and len(jobs) < self.engine.max_rows:
                try:
                    job = self._queue.get(block=not jobs, timeout=IDLE_POLL_S)
                except queue.Empty:
                    break
                self.metrics.labels(self.metrics.waiting).dec()
                seq = self._admit(job)
                if seq is not None:
                    jobs[id(seq)] = job
                    self.metrics.labels(self.metrics.running).inc()
            if not jobs:
                continue
            try:
                finished = self.engine.step()
            except Exception as err:  # noqa: BLE001 - the rows in flight fail; the server and the queue go on
                log.exception("an engine step failed; its requests end with an error")
                self.engine.abort()
                for job in jobs.values():
                    self.metrics.record_error()
                    self._answer(job, None, err)
                self.metrics.labels(self.metrics.kv_cache_usage).set(0.0)
                self.metrics.labels(self.metrics.running).dec(len(jobs))
                jobs.clear()
                continue
            self._show_enabled()
            self.metrics.labels(self.metrics.kv_cache_usage).set(self.engine.kv_cache_usage)
            for seq in finished:
                job = jobs.pop(id(seq))
                self.metrics.labels(self.metrics.running).dec()
                self._finished(job, seq.stats)
                self._answer(job, seq.result(), None)

    def _finished(self, job: Job, stats: GenerationStats) -> None:
        job.times.finished = time.monotonic()
        self.metrics.record_request(stats, job.times, prompt_tokens=len(job.prompt_ids))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", log_line(job.request_id or "request", stats))

    def _admit(self, job: Job):
        """Add `job` to the engine (None if it ended before starting: timed out or abandoned while queued)."""
        deadline = job.times.arrived + self.limits.request_timeout_s

        def finish_reason() -> str | None:
            if job.cancelled.is_set():
                return "cancelled"
            now = time.monotonic()
            if self._drain_deadline is not None and now >= self._drain_deadline:
                return "shutdown"
            return "timeout" if now > deadline else None

        if (early := finish_reason()) is not None:
            stats = GenerationStats(finish_reason=early)
            self._finished(job, stats)
            self._answer(job, GenerationResult([], stats), None)
            return None
        stop_text: list[str] = []

        def on_tokens(new: list[int]) -> None:
            job.times.token_times.append(time.monotonic())  # one event per step, as vLLM's inter-token latency
            if (reason := job.on_tokens(new)) is not None:
                stop_text.append(reason)

        def should_stop() -> str | None:
            return stop_text[0] if stop_text else finish_reason()

        job.times.scheduled = time.monotonic()
        try:
            return self.engine.add(job.prompt_ids, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                                   stop_token_ids=self.stop_token_ids, on_tokens=on_tokens, should_stop=should_stop,
                                   constraint=job.constraint)
        except ValueError as err:  # the server checks requests first; anything left fails this request alone
            self.metrics.record_error()
            self._answer(job, None, err)
            return None
