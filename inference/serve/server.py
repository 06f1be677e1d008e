"""`specheads serve`: OpenAI's completions and chat completions API over the engine (FastAPI), with Prometheus
metrics.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI request and response shapes; `stream: true`
sends server-sent events ending with `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics`. Output is
exact: greedy requests (`temperature: 0`) return the target's own greedy continuation, sampled ones follow its
distribution at the request's temperature, top_p and top_k, whatever the proposer drafts.

Bad requests get OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) from one place
(`request_errors.py`), whichever layer finds the fault: a body that is not UTF-8 JSON, a field of the wrong type, a
required field missing or null, an argument this server does not know, a sampling setting out of range, an unknown
model name or a prompt the context cannot hold are 400s naming the field and the fix; a body over the size limit
413, a full server 429, a server shutting down 503 (and `/health` 503, so a load balancer moves away), and without
the bearer token (when the server has an API key) 401. None of them disturbs requests in flight.

Structured outputs: `response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs` (`json`,
`regex`, `grammar`, `choice`) or `guided_*` fields constrain the answer to a grammar, on both endpoints, streamed or
not, with speculation on (`engine/constraint.py`: exact with respect to the target masked by the grammar). A schema,
regex or grammar that does not compile is a 400 naming it.

Per-request acceptance (`spec_decode_metrics.py`): a request with `"spec_decode_metrics": true` (or a level,
"summary" or "detailed"), or every request of a server started with a level (`ServerSettings.spec_decode_metrics`,
`--per-request-spec-decode-metrics`), gets its acceptance in `usage.spec_decode_metrics`: in the response, or on a
stream in the final usage chunk (sent when the request asked for the metrics itself or for
`stream_options.include_usage`). `false` leaves it out even where the server reports it for every request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from specheads.inference.engine.constraint import GrammarConstraint
from specheads.inference.engine.engine import Engine, GenerationResult
from specheads.inference.engine.grammar import grammar_from_request
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.serve.metrics import ServerMetrics
from specheads.inference.serve.request_errors import BadRequest, error_response, install_error_handlers, shown
from specheads.inference.serve.service import GenerationService, Job, QueueFull, ServiceLimits, ShuttingDown
from specheads.inference.serve.spec_decode_metrics import check_level, spec_decode_metrics
from specheads.inference.serve.text_stream import TextStream
from specheads.target import render_messages

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the server's limit
MAX_STOP_STRINGS = 4  # as OpenAI
# torch's generators take seeds in [-2**63, 2**64 - 1] but fold a negative one onto its two's complement (-1 seeds
# as 2**64 - 1 does), so the signed 64-bit range reaches each of their seeds exactly once; it is also vLLM's range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# A top_k at or above the vocabulary keeps every token; the bound refuses only what no 64-bit integer holds.
TOP_K_MAX = (1 << 63) - 1
TOP_LOGPROBS_MAX = 20  # OpenAI's


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients pass as `model` (GET /v1/models lists it)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    max_body_bytes: int = 1 << 20
    spec_decode_metrics: str | None = None  # "summary" or "detailed": every request's usage carries its acceptance

    def __post_init__(self) -> None:
        check_level(self.spec_decode_metrics)


class _Strict(BaseModel):
    # As OpenAI's API: an argument it does not know is refused by name (a misspelt one silently ignored would change
    # an answer without a word), and a value of the wrong type is not coerced ("0.7" is no temperature).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's; this server's chunks carry no obfuscation padding


class _Request(_Strict):
    # null is each field's default, as in OpenAI's API
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # default 1 (OpenAI's): sampling; 0 is greedy
    top_p: float | None = None  # default 1
    top_k: int | None = None  # an extension (as vLLM's): 0 (default) keeps every token
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | int | None = None  # a bool in chat, a count in completions
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and unused: they identify the caller or ask the API to store things, and change no answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Structured outputs (`engine/grammar.py`): OpenAI's field, vLLM's, and vLLM's older per-kind fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # this request's acceptance in its usage: true (the server's level, else summary), a level, false, or None (the
    # server's default)
    spec_decode_metrics: bool | Literal["summary", "detailed"] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]  # required and not null: this server takes no tool calls
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; it wins when both are sent
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


# Known arguments this server does not implement: (the values that leave them inert, why). Any other value is a 400
# naming the argument, never a silent change to the answer.
_INERT: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "one answer per request; send n requests instead"),
    "best_of": ((None, 1), "one answer per request; send several requests instead"),
    "logprobs": ((None, False, 0), "this server returns no log probabilities"),
    "top_logprobs": ((None, 0), "this server returns no log probabilities"),
    "echo": ((None, False), "the prompt is not returned with the answer"),
    "suffix": ((None, ""), "there is no insertion mode"),
    "presence_penalty": ((None, 0.0), "it would change the target's distribution; leave it at 0"),
    "frequency_penalty": ((None, 0.0), "it would change the target's distribution; leave it at 0"),
    "logit_bias": ((None, {}), "it would change the target's distribution; leave it out"),
    "tools": ((None, []), "this server does no tool calling"),
    "tool_choice": ((None, "none", "auto"), "this server does no tool calling"),
    "functions": ((None, []), "this server does no function calling"),
    "function_call": ((None, "none", "auto"), "this server does no function calling"),
}


def create_app(service: GenerationService, tokenizer: Any, settings: ServerSettings) -> FastAPI:
    """The HTTP application around a started `service`."""
    app = FastAPI(title="specheads", docs_url=None, redoc_url=None)
    max_context = service.engine.max_context

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if settings.api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {settings.api_key}":
                return error_response(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                      "authentication_error")
        declared = request.headers.get("content-length")
        too_big = f"the request body is over the server's limit of {settings.max_body_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            return error_response(413, too_big)
        if declared is None and request.method == "POST" and len(await request.body()) > settings.max_body_bytes:
            return error_response(413, too_big)
        return await call_next(request)

    install_error_handlers(app, [CompletionRequest, ChatRequest])

    @app.get("/health")
    async def health():
        if service.draining:  # a load balancer's probe fails, so it sends no more requests here
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "specheads", "max_model_len": max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest("send one prompt per request (got a list of several)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
            vocab = service.engine.vocab_size
            for i, t in enumerate(ids):
                if not 0 <= t < vocab:
                    raise BadRequest(f"prompt[{i}] must be a token id of this model, in [0, {vocab - 1}], got "
                                     f"{shown(t)}", f"prompt[{i}]")
        return await _serve(body, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if not body.messages:
            raise BadRequest("messages must hold at least one message", "messages")
        messages = [{"role": m.role, "content": _text(m.content)} | ({"name": m.name} if m.name else {})
                    for m in body.messages]
        try:
            prompt_ids = render_messages(tokenizer, messages)
        except Exception as err:  # noqa: BLE001 - a chat template raises what it likes (jinja's TemplateError mostly)
            raise BadRequest(f"the model's chat template refused these messages: {err}", "messages") from None
        return await _serve(body, prompt_ids, request, chat=True)

    async def _serve(body: _Request, prompt_ids: list[int], request: Request, *, chat: bool):
        if body.model is not None and body.model != settings.model_name:
            raise BadRequest(f"unknown model {body.model!r}; this server serves {settings.model_name!r}", "model")
        max_tokens = _max_tokens(body, chat, service.limits.max_tokens)
        sampling = _sampling(body)
        stops = _stop_strings(body.stop)
        constraint = _constraint(body, tokenizer, service)
        if not prompt_ids:
            raise BadRequest("the prompt is empty", "prompt")
        if max_context is not None and len(prompt_ids) >= max_context:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens, but this model's context holds {max_context} "
                             "(prompt and answer together); shorten it", "messages" if chat else "prompt")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        text = TextStream(tokenizer, stops)

        def on_tokens(new: list[int]) -> str | None:  # worker thread
            delta = text.add(new)
            if delta:
                loop.call_soon_threadsafe(events.put_nowait, ("text", delta))
            return "stop" if text.stopped else None

        def on_done(result: GenerationResult | None, err: BaseException | None) -> None:  # worker thread
            loop.call_soon_threadsafe(events.put_nowait, ("done", result, err))

        level = _spec_decode_level(body.spec_decode_metrics, settings.spec_decode_metrics)
        reply = _Reply(chat, settings.model_name, len(prompt_ids), level)
        job = Job(prompt_ids=prompt_ids, max_new_tokens=max_tokens, sampling=sampling, on_tokens=on_tokens,
                  on_done=on_done, constraint=constraint, request_id=reply.id)
        try:
            service.submit(job)
        except QueueFull as err:
            raise BadRequest(str(err), status=429, kind="rate_limit_error") from None
        except ShuttingDown as err:
            raise BadRequest(str(err), status=503, kind="server_error") from None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage) or bool(
                body.spec_decode_metrics)
            return StreamingResponse(_stream(reply, events, job, text, include_usage), media_type="text/event-stream")
        parts: list[str] = []
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return Response(status_code=499)
                continue
            if event[0] == "text":
                parts.append(event[1])
                continue
            result = _result(event)
            parts.append(text.flush())
            return reply.whole("".join(parts), result)

    return app


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _max_tokens(body: _Request, chat: bool, limit: int) -> int:
    newer = getattr(body, "max_completion_tokens", None)  # chat only
    _check_range("max_tokens", body.max_tokens, 1, limit, " (this server's limit)")
    _check_range("max_completion_tokens", newer, 1, limit, " (this server's limit)")
    asked = newer if newer is not None else body.max_tokens
    if asked is None:
        return limit if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, limit)
    return asked


def _check_range(name: str, value: int | None, low: int, high: int, note: str = "") -> None:
    """A 400 naming `name` unless `value` lies in [low, high]; None (not sent) passes."""
    if value is not None and not low <= value <= high:
        raise BadRequest(f"{name} must be in [{low}, {high}]{note}, got {shown(value)}", name)


def _sampling(body: _Request) -> SamplingParams:
    # Checked here, not left to the engine: a seed past 64 bits would only fail inside generation, as a 500.
    _check_range("seed", body.seed, SEED_MIN, SEED_MAX, " (a signed 64-bit integer)")
    _check_range("top_k", body.top_k, 0, TOP_K_MAX, " (0 keeps every token)")
    _check_range("top_logprobs", body.top_logprobs, 0, TOP_LOGPROBS_MAX)
    for name, (inert, why) in _INERT.items():
        if (value := getattr(body, name, None)) not in inert:  # None where the endpoint has no such field
            raise BadRequest(f"{name}={value!r} is not supported: {why}", name)
    try:
        return SamplingParams(temperature=_default(body.temperature, 1.0), top_p=_default(body.top_p, 1.0),
                              top_k=_default(body.top_k, 0), seed=body.seed)
    except ValueError as err:
        raise BadRequest(str(err), str(err).split()[0]) from None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                      "guided_choice")


def _constraint(body: _Request, tokenizer: Any, service: GenerationService) -> GrammarConstraint | None:
    """The request's grammar as a fresh per-request constraint (None without one); a bad one is a 400 naming it."""
    fields = {k: getattr(body, k) for k in _CONSTRAINT_FIELDS if getattr(body, k) is not None}
    if not fields:
        return None
    param = next(iter(fields))
    try:
        grammar = grammar_from_request(fields)
        if grammar is None:  # response_format {"type": "text"}
            return None
        return GrammarConstraint(grammar, tokenizer, vocab_size=service.engine.vocab_size,
                                 stop_token_ids=service.stop_token_ids)
    except ValueError as err:
        raise BadRequest(str(err), param) from None


def _spec_decode_level(asked: bool | str | None, server: str | None) -> str | None:
    """The level of the acceptance report in this request's usage (None: none)."""
    if asked is None or asked is False:
        return server if asked is None else None
    return (server or "summary") if asked is True else asked


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise BadRequest(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", "stop")
    return stops


def _result(event: tuple) -> GenerationResult:
    _, result, err = event
    if err is not None:
        raise _failure(err)
    return result


def _failure(err: BaseException) -> BadRequest:
    """The error a client gets for a request that ended without an answer."""
    if isinstance(err, ShuttingDown):
        return BadRequest(str(err), status=503, kind="server_error")
    return BadRequest(f"generation failed: {err}", status=500, kind="server_error")


class _Reply:
    """OpenAI response bodies and stream chunks for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, spec_decode_metrics: str | None = None) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.spec_decode_metrics = spec_decode_metrics  # the level of acceptance report in usage, or None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, result: GenerationResult) -> dict:
        done = len(result.output_ids)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                 "total_tokens": self.prompt_tokens + done}
        if self.spec_decode_metrics is not None:
            usage["spec_decode_metrics"] = spec_decode_metrics(result.stats, self.spec_decode_metrics)
        return usage

    def _body(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, result: GenerationResult) -> dict:
        reason = finish_reason(result)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            return self._body("chat.completion", [choice], usage=self.usage(result))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._body("text_completion", [choice], usage=self.usage(result))

    def chunk(self, text: str | None, reason: str | None = None, *, first: bool = False) -> str:
        if self.chat:
            delta = (({"role": "assistant", "content": ""} if first else {})
                     | ({} if text is None else {"content": text}))
            body = self._body("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": reason}])
        else:
            body = self._body("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                   "finish_reason": reason}])
        return sse(body)

    def usage_chunk(self, result: GenerationResult) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._body(kind, [], usage=self.usage(result)))


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's names: "stop" (a stop token or string) and "length" (max_tokens or the context); the server's own
    "timeout" (past --request-timeout), "cancelled" and "shutdown" (still running when a shutdown's grace period
    ended) pass through."""
    reason = result.stats.finish_reason
    return "length" if reason == "context" else reason


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _stream(reply: _Reply, events: asyncio.Queue, job: Job, text: TextStream,
                  include_usage: bool) -> AsyncIterator[str]:
    try:
        if reply.chat:
            yield reply.chunk(None, first=True)
        while True:
            event = await events.get()
            if event[0] == "text":
                yield reply.chunk(event[1])
                continue
            _, result, err = event
            if err is not None:
                failure = _failure(err)
                yield sse({"error": {"message": str(failure), "type": failure.kind, "param": None,
                                     "code": failure.status}})
            else:
                if rest := text.flush():
                    yield reply.chunk(rest)
                yield reply.chunk(None if reply.chat else "", finish_reason(result))
                if include_usage:
                    yield reply.usage_chunk(result)
            yield sse("[DONE]")
            return
    finally:
        job.cancel()  # a client that left mid-stream ends its job at the next step (no-op once it is done)


def build_server(engine: Engine, tokenizer: Any, stop_token_ids: list[int], settings: ServerSettings,
                 limits: ServiceLimits = ServiceLimits()) -> tuple[FastAPI, GenerationService]:
    """The application and its service, not yet decoding: `launch.serve` runs the service in the main thread
    (`service.run()`), a test in a thread of its own (`service.start()`, then `service.close()` once the HTTP server
    stopped). Both wire the server here, the one way."""
    service = GenerationService(engine, stop_token_ids, ServerMetrics(settings.model_name, engine.max_context), limits)
    return create_app(service, tokenizer, settings), service
