"""The HTTP side of `s2moe serve`: Starlette's endpoints on uvicorn over one decoder, whose generations run one
at a time in a thread of their own. The requests behind the one generating wait their turn in order, at most a
bound of them, and the rest get 503 with Retry-After; a client that goes away stops its generation at the next step,
and so do SIGINT and SIGTERM, which answer the request in flight before the server stops and the signal is raised
again for the CLI's exit code. openai_api reads the requests and shapes the answers; the engine decodes."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.decoding.chat import Conversation, Message, chat_tokens
from ..engine.errors import ConfigError, ContextError, S2MoEError
from ..engine.events import Iteration, Prefilled, Started, Summary
from .cli import one_line
from .openai_api import (
    ApiError,
    Reply,
    TextOut,
    chat_request,
    completion_request,
    figures,
    finish_reason,
    parse_json,
    sse,
    usage,
)

MAX_BODY_BYTES = 16 << 20  # far more than any context's prompt; a larger body is refused, not read
GRACEFUL_SECONDS = 10  # how long a shutdown waits for a client that does not read its answer
# The engine's names for the settings its errors are about → the request fields that set them.
FIELDS = {
    "n_predict": "max_tokens",
    "n_ctx": "the server's -c/--ctx-size",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "seed": "seed",
}


def serve(service: Service, sock: socket.socket, host: str) -> None:
    """Answer requests on `sock` until SIGINT or SIGTERM, which is raised again once the server has stopped."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # from the signal handler: the loop does the rest between its callbacks
            service.loop.call_soon_threadsafe(service.close)

    config = uvicorn.Config(
        service.app(), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=GRACEFUL_SECONDS
    )
    server = Server(config)

    async def main():
        service.loop = asyncio.get_running_loop()
        port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        _say(
            f"s2moe serve: {service.alias} · mode {service.base.mode} · {service.template.status} · "
            f"listening on http://{shown}:{port}/v1 · Ctrl-C stops"
        )
        if service.api_key is None and not _loopback(host):
            _say(
                f"note: {host} is reachable from other machines and no --api-key is set: anyone who reaches it can "
                "use the model"
            )
        await server.serve(sockets=[sock])

    try:
        asyncio.run(main())
    finally:
        service.executor.shutdown(wait=True)  # the generation in flight was told to stop at its next step


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ServerClosing(Exception):
    """The server is shutting down: requests still waiting get 503."""


class ClientGone(Exception):
    """The client closed its connection before its answer."""


class Slot:
    """One generation at a time; the requests behind it wait their turn in order, at most `bound` of them.
    Used on the event loop's thread only."""

    def __init__(self, bound: int):
        self.bound, self.busy, self.waiting = bound, False, deque()

    def reserve(self) -> asyncio.Future | None:
        """A future done at the caller's turn (at once where none is ahead); None where the queue is full."""
        turn = asyncio.get_running_loop().create_future()
        if not self.busy:
            self.busy = True
            turn.set_result(None)
        elif len(self.waiting) >= self.bound:
            return None
        else:
            self.waiting.append(turn)
        return turn

    def give_up(self, turn: asyncio.Future) -> None:
        """The caller of reserve will not generate: its place in the queue, or its turn, goes to the next."""
        if turn.done() and not turn.cancelled() and turn.exception() is None:
            self.leave()
        else:
            turn.cancel()
            if turn in self.waiting:
                self.waiting.remove(turn)

    def leave(self) -> None:
        """The generation ended: the next one waiting starts."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.busy = False

    def close(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_exception(ServerClosing())


class Job:
    """One request's generation: what the decoding thread tells the request's handler, in order, and what the
    line said for it once it has ended needs."""

    def __init__(self, http, t0: float, request, cfg, loop: asyncio.AbstractEventLoop):
        self.http, self.t0, self.request, self.cfg, self.loop = http, t0, request, cfg, loop
        self.stop = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.client_gone = False
        # set by the decoding thread as the generation ends (None: it failed, and its handler said so)
        self.summary = None
        self.prompt_tokens = 0
        self.reused = 0  # prompt tokens whose KV entries the generation before left
        self.seed = 0  # the seed it sampled with
        self.stopped_by_text = False

    @property
    def stop_word(self) -> str:
        """Why the generation ended: the engine's word, or what stopped it from outside."""
        if self.stopped_by_text:
            return "stop string"
        if self.summary.stop_reason == "interrupted":
            return "client gone" if self.client_gone else "server stopping"
        return self.summary.stop_reason

    def give_up(self) -> None:
        """The client went away: the generation stops at its next step."""
        self.client_gone = True
        self.stop.set()

    def put(self, kind: str, value=None) -> None:  # from the decoding thread
        self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))


async def _disconnected(request) -> None:
    """Returns once the client has closed its connection (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Service:
    """The endpoints over one decoder."""

    def __init__(self, decoder, base, *, alias: str, queue: int, api_key: str | None, default_tokens: int | None):
        self.decoder, self.base, self.alias, self.api_key = decoder, base, alias, api_key
        self.default_tokens = default_tokens
        # read here, on the thread that starts the server: reading it calls llama.cpp, which must not run beside
        # a generation's decoding
        self.template = decoder.chat_template
        self.slot = Slot(queue)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2moe-generate")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.current: Job | None = None
        self.closing = False
        self.mean_seconds = 1.0  # a request's usual time, for Retry-After

    def app(self):
        def endpoint(handler, public=False):
            async def wrapped(request):
                return await self._answer(request, handler, public)

            return wrapped

        routes = [Route("/health", endpoint(self.health, public=True), methods=["GET"])]
        for prefix in ("/v1", ""):
            routes += [
                Route(f"{prefix}/models", endpoint(self.models), methods=["GET"]),
                Route(f"{prefix}/completions", endpoint(self.completions), methods=["POST"]),
                Route(f"{prefix}/chat/completions", endpoint(self.chat_completions), methods=["POST"]),
            ]

        async def http_error(request, exc):
            error = ApiError(
                exc.status_code,
                f"{request.method} {request.url.path}: {exc.detail}",
                code="not_found" if exc.status_code == 404 else None,
            )
            return self._error(request, error, time.perf_counter())

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error})

    # -- the frame every endpoint runs in ---------------------------------------------------------------------------
    async def _answer(self, request, handler, public: bool):
        t0 = time.perf_counter()
        try:
            if not public and self.api_key is not None:
                self._authorize(request)
            return await handler(request, t0)
        except ApiError as e:
            return self._error(request, e, t0)
        except (ClientGone, ClientDisconnect):
            self._log(request, 499, t0, "the client closed the connection while waiting")
            return Response(status_code=499)
        except Exception as e:  # a fault of the server's own: one line, and the server goes on
            return self._error(request, ApiError(500, f"internal error: {one_line(repr(e))}", kind="server_error"), t0)

    def _authorize(self, request) -> None:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(
                401,
                "invalid API key: send the server's --api-key as `Authorization: Bearer KEY`",
                code="invalid_api_key",
            )

    def _error(self, request, error, t0: float):
        self._log(request, error.status, t0, error.message)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def _log(self, request, status: int, t0: float, what: str) -> None:
        _say(f"{request.method} {request.url.path} {status} · {time.perf_counter() - t0:.2f} s · {one_line(what)}")

    # -- endpoints ---------------------------------------------------------------------------------------------------
    async def health(self, request, t0):
        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="unavailable_error")
        # beyond llama-server's answer: whether a generation runs, and how many requests wait behind it
        return JSONResponse({"status": "ok", "generating": self.current is not None, "waiting": len(self.slot.waiting)})

    async def models(self, request, t0):
        info = self.decoder.info
        entry = {
            "id": self.alias,
            "object": "model",
            "created": int(os.stat(info.path).st_mtime),
            "owned_by": "s2moe",
            "meta": {
                "arch": info.arch,
                "n_layer": info.n_layer,
                "n_expert": info.n_expert,
                "n_expert_used": info.n_expert_used,
                "n_ctx": self.decoder.n_ctx,
                "mode": self.base.mode,
                "chat_template": self.template.name,
            },
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def completions(self, request, t0):
        return await self._generate(request, t0, completion_request(await self._body(request)))

    async def chat_completions(self, request, t0):
        req = chat_request(await self._body(request))
        template = self.template
        if not template.usable:
            why = (
                "the model has no chat template"
                if template.text is None
                else "llama.cpp does not know the model's chat template"
            )
            raise ApiError(400, f"{why}: send a plain prompt to /v1/completions", param="messages")
        return await self._generate(request, t0, req)

    async def _body(self, request) -> dict:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def _config(self, req):
        cfg = replace(self.base, **req.sampling)
        n = req.max_tokens or self.default_tokens or self.decoder.n_ctx
        cfg = replace(cfg, n_predict=n)
        try:
            cfg.validate(self.decoder.info)
        except ConfigError as e:
            raise ApiError(400, e.worded(FIELDS), param=FIELDS.get(e.option)) from None
        if isinstance(req.prompt, list) and not all(0 <= t < self.decoder.info.n_vocab for t in req.prompt):
            raise ApiError(400, f"prompt: token ids run from 0 to {self.decoder.info.n_vocab - 1}", param="prompt")
        return cfg

    def _busy(self):
        if self.closing:
            return ApiError(503, "the server is shutting down", kind="unavailable_error")
        wait = max(1, math.ceil(self.mean_seconds * (len(self.slot.waiting) + 1)))
        return ApiError(
            503,
            f"the server is busy: {len(self.slot.waiting)} requests already wait behind the one generating",
            kind="unavailable_error",
            headers={"Retry-After": str(wait)},
        )

    async def _generate(self, request, t0: float, req):
        cfg = self._config(req)
        turn = None if self.closing else self.slot.reserve()
        if turn is None:
            raise self._busy()
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not turn.done():
                raise ClientGone
            if turn.exception() is not None:
                raise self._busy()
        except BaseException:
            gone.cancel()
            self.slot.give_up(turn)
            raise
        job = self._start(request, t0, req, cfg)
        gone.add_done_callback(lambda task: task.cancelled() or job.give_up())
        try:
            kind, value = await job.items.get()
            if kind == "error":
                raise self._api_error(value)
            reply = Reply(req.chat, self.alias)
            if req.stream:
                return self._streaming(job, reply)
            text = []
            while True:
                kind, value = await job.items.get()
                if kind == "text":
                    text.append(value)
                elif kind == "error":
                    raise self._api_error(value)
                else:
                    break
            return JSONResponse(reply.whole("".join(text), *self._closing_fields(job)))
        except asyncio.CancelledError:  # the server gave up on this request (a shutdown's time ran out)
            job.give_up()
            raise
        finally:
            gone.cancel()  # a stream's response listens for the client itself

    def _start(self, http, t0: float, req, cfg) -> Job:
        job = Job(http, t0, req, cfg, self.loop)
        self.current = job
        started = time.perf_counter()

        def ended(_):
            self.current = None if self.current is job else self.current
            self.mean_seconds = 0.7 * self.mean_seconds + 0.3 * (time.perf_counter() - started)
            self.slot.leave()
            if job.summary is not None:
                self._log_done(job)

        self.loop.run_in_executor(self.executor, self._decode, job).add_done_callback(ended)
        return job

    def _closing_fields(self, job: Job) -> tuple[str, dict, dict]:
        """An ended generation's finish_reason, usage and figures."""
        summary = job.summary
        return (
            finish_reason(summary.stop_reason, job.stopped_by_text),
            usage(job.prompt_tokens, summary.n_tokens),
            figures(summary, job.reused, job.stop_word, job.seed),
        )

    def _api_error(self, error):
        if isinstance(error, ContextError):
            return ApiError(413, error.worded(FIELDS), code="context_length_exceeded")
        if isinstance(error, S2MoEError):
            return ApiError(400, error.worded(FIELDS))
        return ApiError(500, f"internal error: {one_line(repr(error))}", kind="server_error")

    def _streaming(self, job: Job, reply):
        async def events():
            done = False
            try:
                if reply.chat:
                    yield sse(reply.chunk(None, first=True))
                after = None  # an item taken while gathering text, the next one to handle
                while True:
                    kind, value = after or await job.items.get()
                    after = None
                    if kind == "text":
                        # the steps decoded while the last chunk went out leave in one chunk, not one each
                        while after is None and not job.items.empty():
                            after = job.items.get_nowait()
                            if after[0] == "text":
                                value, after = value + after[1], None
                        yield sse(reply.chunk(value))
                        continue
                    if kind == "error":
                        error = self._api_error(value)
                        self._log(job.http, error.status, job.t0, error.message)
                        yield sse(error.body())
                        break
                    reason, use, extra = self._closing_fields(job)
                    last = reply.chunk(None, reason)
                    last["s2moe"] = extra
                    yield sse(last)
                    if job.request.include_usage:
                        yield sse(reply.usage_chunk(use))
                    break
                yield sse("[DONE]")
                done = True
            finally:
                if not done:  # the client went away: the response cancelled this
                    job.give_up()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def _log_done(self, job: Job) -> None:
        """The line said for a request once its generation has ended (499: the client went away first)."""
        summary = job.summary
        fetched = (
            f" · {int(summary.experts_fetched + summary.draft_fetched)} experts fetched"
            if summary.offloaded_steps
            else ""
        )
        self._log(
            job.http,
            499 if job.client_gone else 200,
            job.t0,
            f"{job.prompt_tokens} prompt + {summary.n_tokens} tokens ({summary.tok_per_s:.1f} tok/s) · mode "
            f"{summary.mode} · accept length {summary.accept_len:.2f}{fetched} · stop: {job.stop_word}",
        )

    # -- the decoding thread -----------------------------------------------------------------------------------------
    def _decode(self, job: Job) -> None:
        decoder, req = self.decoder, job.request
        try:
            if req.chat:
                *history, (_, user) = req.messages
                conversation = Conversation(self.template, messages=[Message(r, c) for r, c in history])
                prompt = chat_tokens(decoder, conversation, user)
            else:
                prompt = req.prompt
            out = TextOut(decoder.rt.piece, req.stops)
            summary = Summary()
            for event in decoder.generate(prompt, job.cfg, should_stop=job.stop.is_set, keep_context=True):
                summary.add(event)
                if isinstance(event, Started):
                    job.prompt_tokens, job.seed = len(event.prompt_tokens), event.config["seed"]
                    job.put("started")
                elif isinstance(event, Prefilled):
                    job.reused = event.reused
                elif isinstance(event, Iteration):
                    text = out.add(event.committed)
                    if text:
                        job.put("text", text)
                    if out.stopped:
                        job.stop.set()
            text = out.flush()
            if text:
                job.put("text", text)
            job.summary, job.stopped_by_text = summary, out.stopped
            job.put("done")
        except Exception as e:  # the handler answers it (an error object); the thread goes on to the next request
            job.put("error", e)

    def close(self) -> None:
        """SIGINT or SIGTERM: the generation in flight stops at its next step and is answered; the rest get 503."""
        self.closing = True
        if self.current is not None:
            self.current.stop.set()
        self.slot.close()
