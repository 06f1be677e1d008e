"""Regeneration through an OpenAI-compatible server: vLLM, SGLang or `specheads serve` answers the conversations.

A target too large for the training machine is served where it fits; `python -m specheads.train.regenerate
--endpoint URL` sends each conversation's turns to the server's `/v1/chat/completions` (the server applies the
target's chat template, as it does for every client), several conversations at once (`concurrency`), each
conversation's turns in order (turn i is asked with the regenerated turns before it).

Failures: a connection error, a 429 or a 5xx is retried with exponential backoff; a 400 means the server will
not answer this conversation's next turn (its prompt outgrew the context, say), so the conversation ends there,
as the in-process path drops a turn whose prompt is too long; any other answer (a wrong key, an unknown model)
stops the run with the server's own message, and what was answered before is kept for the rerun.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

RETRIED = (429, 500, 502, 503, 504)  # statuses worth asking again: overload and passing failures


class EndpointError(ValueError):
    """The server refused in a way a retry cannot mend; the message names the fix."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server's base URL, with or without /v1
    model: str | None = None  # the served model's name (None: the first the server lists)
    api_key: str | None = None  # sent as a bearer token
    concurrency: int = 16  # conversations in flight
    retries: int = 5  # further tries of a request after a retryable failure
    backoff_s: float = 1.0  # the wait before the first retry, doubling after each (at most 30 s)
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise EndpointError(f"--endpoint must be an http(s) URL such as http://host:8000/v1, got {self.url!r}")
        if self.concurrency < 1 or self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise EndpointError("--concurrency must be >= 1, --retries and the backoff >= 0, the timeout > 0")

    @property
    def base(self) -> str:  # ".../v1"
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


@dataclass(frozen=True)
class Answered:
    index: int  # the conversation's position in the list given
    messages: list[dict] | None  # the regenerated conversation; None when no assistant turn was answered
    tokens: int  # completion tokens generated for it


class EndpointAnswerer:
    """Answers conversations through `endpoint`, `concurrency` at a time (an `Answerer` of `regenerate`)."""

    def __init__(self, endpoint: Endpoint, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> None:
        try:
            import httpx
        except ImportError as err:
            raise EndpointError("--endpoint needs httpx: pip install 'specheads[serve]'") from err
        self.endpoint = endpoint
        self.params = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._http = httpx.Client(base_url=endpoint.base, headers=headers, timeout=endpoint.timeout_s,
                                  limits=httpx.Limits(max_connections=endpoint.concurrency))
        self._lock = threading.Lock()
        self.requests = 0  # requests sent, retries included
        self.retried = 0
        self.model = endpoint.model or self._first_model()

    def close(self) -> None:
        self._http.close()

    def _first_model(self) -> str:
        data = self._request("GET", "/models", None).get("data") or []
        if not data:
            raise EndpointError(f"{self.endpoint.base}/models lists no model; pass --model NAME")
        return data[0]["id"]

    def answer(self, conversations: list[list[dict]]) -> Iterator[Answered]:
        """Each conversation regenerated, yielded as it completes (in any order). An `EndpointError` stops the
        conversations in flight; those already yielded stand."""
        pool = ThreadPoolExecutor(max_workers=self.endpoint.concurrency, thread_name_prefix="regenerate")
        todo = iter(enumerate(conversations))
        running: set[Future] = set()
        try:
            while True:
                # at most `concurrency` queued: a failure stops the run without a backlog already sent
                while len(running) < self.endpoint.concurrency and (item := next(todo, None)) is not None:
                    running.add(pool.submit(self._conversation, *item))
                if not running:
                    return
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield future.result()
        finally:
            for future in running:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _conversation(self, index: int, messages: list[dict]) -> Answered:
        out: list[dict] = []
        tokens = 0
        for message in messages:
            if message["role"] != "assistant":
                out.append(message)
                continue
            body = {"model": self.model, "messages": out, **self.params}
            reply = self._request("POST", "/chat/completions", body, refusal_ends=True)
            if reply is None:  # the server will not answer this turn: the conversation ends before it
                break
            out.append({"role": "assistant", "content": (reply["choices"][0]["message"]["content"] or "").strip()})
            tokens += int((reply.get("usage") or {}).get("completion_tokens") or 0)
        while out and out[-1]["role"] != "assistant":  # a user turn with no answer teaches nothing
            out.pop()
        return Answered(index, out if out else None, tokens)

    def _request(self, method: str, path: str, body: dict | None, refusal_ends: bool = False) -> Any:
        import httpx

        attempt = 0
        while True:
            with self._lock:
                self.requests += 1
            try:
                response = self._http.request(method, path, json=body)
            except httpx.TransportError as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    return response.json()
                problem = f"{response.status_code} {_server_message(response)}"
                if response.status_code == 400 and refusal_ends:
                    log.info("the server refused a turn (%s); the conversation ends before it", problem)
                    return None
                if response.status_code not in RETRIED:
                    hint = " (pass --api-key)" if response.status_code in (401, 403) else (
                        " (pass --model with a name the server lists at /v1/models)"
                        if response.status_code == 404 else "")
                    raise EndpointError(f"{self.endpoint.base}{path} answered {problem}{hint}")
            if attempt == self.endpoint.retries:
                raise EndpointError(f"{self.endpoint.base}{path} failed {attempt + 1} times, last with {problem}; "
                                    "check the server, then rerun the same command to resume")
            with self._lock:
                self.retried += 1
            wait_s = min(self.endpoint.backoff_s * 2 ** attempt, 30.0)
            log.warning("%s%s: %s; retrying in %.1f s", self.endpoint.base, path, problem, wait_s)
            time.sleep(wait_s)
            attempt += 1


def _server_message(response: Any) -> str:
    """The message of an OpenAI-shaped error body, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):  # OpenAI's shape
        return str(error["message"])
    if isinstance(body, dict) and isinstance(body.get("message"), str):  # vLLM's and SGLang's older shape
        return body["message"]
    return response.text[:200]
