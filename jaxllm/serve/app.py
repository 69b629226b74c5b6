"""The HTTP side: Starlette routes, authentication, body limits, SSE streaming.

Handlers validate a request, hand it to the engine thread as a `Job`, and turn the events that come
back into an OpenAI response or an SSE stream. Every client error is an `ApiError`, answered with
OpenAI's error body and never logged as a traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import re
import threading
import time
import urllib.parse
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxllm.engine.jobs import Delta, Failed, Finished, Job, Prompt, QueueFull
from jaxllm.engine.memory import KVMemory
from jaxllm.engine.scheduler import Scheduler
from jaxllm.serve.answers import AnswerStream, LogprobWriter, choice, full_response, prompt_logprobs_json, usage_chunk
from jaxllm.serve.body import ClientGone, check_key, json_body
from jaxllm.serve.grammar import Grammars
from jaxllm.serve.inbox import Inbox, Wakeups
from jaxllm.serve.metrics import CONTENT_TYPE, Metrics
from jaxllm.serve.output import chat_features
from jaxllm.serve.protocol import ApiError, GenRequest, bad, detokenize, parse_request, tokenize
from jaxllm.serve.response_output import sse
from jaxllm.serve.responses import ResponseStore, Turn

log = logging.getLogger("jaxllm.serve")


@dataclass
class ServeOptions:
    served_name: str
    max_model_len: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: the backend's (`XlaOps.prefill_tokens`)
    max_queue: int = 64
    api_key: str | None = None
    max_request_bytes: int = 4 << 20
    request_timeout: float | None = 600.0
    body_timeout: float = 30.0  # seconds a request body may stall between two reads
    body_deadline: float = 60.0  # seconds a whole request body may take
    shutdown_timeout: float = 30.0
    stall_timeout: float = 120.0  # /health says 503 after this long without progress with work waiting
    decode_steps: int = 8
    warmup: bool = True
    started: float | None = None  # process start (time.monotonic()), for the time to ready
    freeze_heap: bool = False  # for a process that serves for its lifetime: `Warmup.settle_heap`
    kv_memory: KVMemory = KVMemory()  # the KV pool's size, and whether it caches prefixes
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id, the oldest dropped first
    deterministic: bool = False  # an answer is the same whatever runs beside it (`Scheduler`)


SHUTDOWN_JOIN_S = 2.0  # seconds the engine's threads get to stop (a device call may run longer)
BIG_BODY = 64 << 10  # bytes of a request body from which it is parsed on the big bodies' thread
DISCONNECT_CHECK = 0.5  # seconds between two looks at whether a non-streaming client is still there


class TimedOut(Exception):
    pass


class Server:
    def __init__(self, engine, opts: ServeOptions):
        self.engine, self.opts = engine, opts
        self.grammars = Grammars.for_engine(engine)  # structured output (None: no tokenizer)
        self.scheduler = Scheduler(
            engine,
            opts.max_num_seqs,
            opts.max_model_len,
            opts.max_queue,
            opts.decode_steps,
            opts.max_num_batched_tokens,
            structured=self.grammars is not None,
            freeze_heap=opts.freeze_heap,
            kv_memory=opts.kv_memory,
            deterministic=opts.deterministic,
        )
        self.metrics = self.scheduler.observer = Metrics(self.scheduler, opts.served_name)
        self.features = chat_features(engine.cfg.family)  # reasoning and tool calls in chat answers
        self.started = time.time()
        self.stored = ResponseStore(opts.max_stored_responses)
        self.wakeups: Wakeups | None = None  # the event loop's, made by its first request
        # Requests are parsed (chat template, tokenizer) off the event loop, one at a time on a thread
        # of their own, as vLLM's server tokenizes. A worker thread each, as Starlette's pool gives,
        # let a burst of sixteen requests' threads take turns at the GIL ahead of the engine thread
        # (one H100, the Gemma 3 270M shape: a 1-row prefill call 15 ms instead of 4, requests
        # submitted 6 to 10 ms after they arrived, for a parse of 0.1 ms).
        self.parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxllm-parse")
        # Bodies of BIG_BODY bytes and more are parsed on a thread of their own, so a small request
        # never waits for a long prompt's tokenizing (3 s for 3.5 MB on a CPU core), which lets go
        # of the GIL (`Tokenizer.encode`) but not of the thread.
        self.big_parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxllm-parse-big")

    def inbox(self) -> Inbox:
        loop = asyncio.get_running_loop()
        if self.wakeups is None or self.wakeups.loop is not loop:
            self.wakeups = Wakeups(loop)
        return Inbox(self.wakeups)

    def start(self):
        """Compile the engine's calls, and meanwhile build the grammar engine's tokenizer."""
        grammar = threading.Thread(target=self.grammars.prepare, name="jaxllm-grammar") if self.grammars else None
        if grammar is not None:
            grammar.start()
        getattr(self.engine.tokenizer, "max_bytes_per_token", None)  # computed once (1 s for 262144 tokens)
        self.scheduler.start(self.opts.warmup)
        if grammar is not None:
            grammar.join()

    # -- plumbing --------------------------------------------------------------------------------
    def check_auth(self, request: Request):
        check_key(request, self.opts.api_key)

    async def read_json(self, request: Request):
        o = self.opts
        return await json_body(request, o.api_key, o.max_request_bytes, o.body_timeout, o.body_deadline)

    def parse_and_submit(self, parse, inbox: Inbox) -> tuple[GenRequest, Job | None]:
        """On the parse thread: the request parsed (`parse()`) and, unless it is constrained (its
        grammar is compiled first), handed to the scheduler at once, so that a burst of requests
        reaches the engine thread as they are parsed rather than as the event loop gets back to
        each. Raises QueueFull."""
        req = parse()
        return req, None if req.constraint is not None else self.submit(req, inbox)

    def submit(self, req: GenRequest, inbox: Inbox, matcher=None) -> Job:
        job = Job.for_request(req, lambda index, event: inbox.put((index, event)), matcher=matcher)
        self.scheduler.submit(job)
        return job

    async def parsed(self, request: Request, fn, *args):
        """fn(*args) on a parse thread (the big bodies' for a body of BIG_BODY bytes or more): a
        request's chat template and tokenizer, off the event loop."""
        big = getattr(request.state, "body_bytes", 0) >= BIG_BODY
        return await asyncio.get_running_loop().run_in_executor(
            self.big_parser if big else self.parser, functools.partial(fn, *args)
        )

    def deadline(self) -> float:
        t = self.opts.request_timeout
        return float("inf") if t is None else time.monotonic() + t

    async def next_event(self, inbox: Inbox, deadline: float, request: Request | None = None):
        """The next engine event; raises TimedOut at the deadline. With `request`, also notices a
        client that went away (streams notice it themselves: Starlette cancels them)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut
            ev = await inbox.get(min(left, DISCONNECT_CHECK))
            if ev is not None:
                return ev
            if request is not None and await request.is_disconnected():
                raise ClientGone

    def timeout_error(self) -> ApiError:
        return ApiError(
            504,
            f"the request did not finish within {self.opts.request_timeout:g} s",
            type="timeout_error",
            code="timeout",
        )

    # -- routes ----------------------------------------------------------------------------------
    async def health(self, request: Request):
        why = self.scheduler.health(self.opts.stall_timeout)
        if why is not None:
            raise ApiError(503, why, type="server_error")
        if self.scheduler.stopping:
            raise ApiError(503, "the server is shutting down", type="server_error")
        return JSONResponse({"status": "ok", **self.scheduler.load()})

    def model_card(self) -> dict:
        return {
            "id": self.opts.served_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "jaxllm",
            "max_model_len": self.opts.max_model_len,
        }

    async def models(self, request: Request):
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request):
        self.check_auth(request)
        name = request.path_params["model_id"]
        if name != self.opts.served_name:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.opts.served_name}'",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self.model_card())

    async def metrics_text(self, request: Request):
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request):
        body = await self.read_json(request)
        return JSONResponse(
            await self.parsed(
                request, tokenize, body, self.engine, self.opts.served_name, self.opts.max_model_len, self.features
            )
        )

    async def detokenize(self, request: Request):
        body = await self.read_json(request)
        return JSONResponse(await self.parsed(request, detokenize, body, self.engine, self.opts.served_name))

    async def completions(self, request: Request):
        return await self.generate(request, "completion")

    async def chat_completions(self, request: Request):
        return await self.generate(request, "chat")

    async def generate(self, request: Request, kind: str):
        body = await self.read_json(request)
        parse = functools.partial(
            parse_request,
            kind,
            body,
            self.engine,
            self.opts.served_name,
            self.opts.max_model_len,
            self.features,
            self.opts.max_num_seqs,
        )
        return await self.run(request, parse, self.collect, self.stream)

    async def run(self, request: Request, parse, collect, stream):
        """A generation request, whatever its route: `parse()` (on the parse thread) gives the
        request, which the scheduler runs; `collect(request, req, job, inbox, deadline)` answers
        it whole, `stream(req, job, inbox, deadline)` as an SSE stream."""
        inbox = self.inbox()
        try:
            req, job = await self.parsed(request, self.parse_and_submit, parse, inbox)
            if job is None:  # its grammar compiled here, never on the engine thread
                if self.grammars is None:
                    raise bad("this model has no tokenizer, so its answers cannot be constrained", req.constraint.field)
                matcher = await run_in_threadpool(self.grammars.matcher, req.constraint)
                job = self.submit(req, inbox, matcher)
        except QueueFull as e:
            if self.scheduler.stopping:
                raise ApiError(503, str(e), type="server_error") from None
            raise ApiError(
                429, f"{e}; retry later", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        deadline = self.deadline()
        if req.stream:
            # the background cancel also covers a client gone before the stream's first chunk
            return StreamingResponse(
                stream(req, job, inbox, deadline),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(_cancel, job),
            )
        try:
            return await collect(request, req, job, inbox, deadline)
        except ClientGone:
            self.metrics.failed("abort")
            return Response(status_code=499)  # nobody reads it; the slot is freed below
        finally:
            job.cancel()  # frees the slot if the client left or the deadline passed

    async def collect(self, request: Request, req: GenRequest, job: Job, inbox: Inbox, deadline: float):
        """The request's answers (events tagged with their index) -> one response. A client that
        went away is noticed within about `DISCONNECT_CHECK` seconds, whether or not events keep
        coming (tokens whose text is held back, a special token skipped, still send events), and
        its slot given back."""
        texts, logprobs, prompts = [[] for _ in range(req.n)], [[] for _ in range(req.n)], [None] * req.n
        finished: dict[int, Finished] = {}
        checked = time.monotonic()
        while len(finished) < req.n:
            if time.monotonic() - checked >= DISCONNECT_CHECK:
                if await request.is_disconnected():
                    raise ClientGone
                checked = time.monotonic()
            try:
                i, ev = await self.next_event(inbox, deadline, request)
            except TimedOut:
                self.metrics.failed("timeout")
                raise self.timeout_error() from None
            if isinstance(ev, Prompt):  # the prompt read: echoed first, its scores where asked
                prompts[i] = ev.logprobs
                if req.echo:
                    texts[i].insert(0, req.prompt_text)
                    logprobs[i][:0] = ev.logprobs or []
            elif isinstance(ev, Delta):
                texts[i].append(ev.text)
                logprobs[i] += ev.logprobs or []
            elif isinstance(ev, Finished):
                finished[i] = ev
            elif isinstance(ev, Failed):
                self.metrics.failed("error")
                raise ApiError(ev.status, ev.message, type=ev.type)
        choices = []
        for i in range(req.n):
            text, parts = "".join(texts[i]), None
            if req.output is not None:  # reasoning and tool calls read out of the answer
                reader = req.output.reader()
                parts = reader.push(text)
                parts.add(reader.finish())
            lp = None if req.logprobs is None else LogprobWriter(req, self.engine.tokenizer)(logprobs[i])
            choices.append(choice(req, i, text, finished[i].finish_reason, parts, lp))
            if req.shown_prompt_logprobs is not None:
                choices[i]["prompt_logprobs"] = prompt_logprobs_json(req, prompts[i] or [], self.engine.tokenizer)
        body = full_response(
            req,
            choices,
            sum(f.completion_tokens for f in finished.values()),
            max(f.cached_tokens for f in finished.values()),
        )
        if req.kind == "chat" and req.shown_prompt_logprobs is not None:  # vLLM's place for a chat's
            body["prompt_logprobs"] = [c.pop("prompt_logprobs") for c in choices][0]
        self.metrics.finished(job, choices[0]["finish_reason"])
        return JSONResponse(body)

    async def stream(self, req: GenRequest, job: Job, inbox: Inbox, deadline: float):
        """The request's answers as SSE chunks, each chunk one answer's with its index (OpenAI's
        shape for n > 1), the usage after the last answer ends. The chunks of the events waiting
        in the inbox go out in one write."""
        out: list[str] = []

        def sse(obj):
            out.append(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n")

        answers = [AnswerStream(req, i, self.engine.tokenizer) for i in range(req.n)]
        reasons: dict[int, str] = {}
        n_completion = cached = 0
        ended = False
        try:
            if req.kind == "chat":
                for a in answers:
                    sse(a.role())
            while True:
                if out and (not inbox.events or len(out) >= 64):
                    yield "".join(out)
                    out.clear()
                try:
                    i, ev = await self.next_event(inbox, deadline)
                except TimedOut:
                    ended = True
                    self.metrics.failed("timeout")
                    sse(self.timeout_error().body())
                    break
                if isinstance(ev, Prompt) and req.shown_prompt_logprobs is not None:
                    sse(answers[i].prompt_scores(prompt_logprobs_json(req, ev.logprobs or [], self.engine.tokenizer)))
                if isinstance(ev, Delta) or (isinstance(ev, Prompt) and req.echo):
                    text = ev.text if isinstance(ev, Delta) else req.prompt_text
                    for c in answers[i].text(
                        text, ev.logprobs if isinstance(ev, Delta) or req.logprobs is not None else None
                    ):
                        sse(c)
                elif isinstance(ev, Finished):
                    last, reasons[i] = answers[i].finish(ev.finish_reason)
                    n_completion += ev.completion_tokens
                    cached = max(cached, ev.cached_tokens)
                    if len(reasons) == req.n:
                        ended = True
                        self.metrics.finished(job, reasons[0])
                    for c in last:
                        sse(c)
                    if ended:
                        if req.include_usage:
                            sse(usage_chunk(req, n_completion, cached))
                        break
                elif isinstance(ev, Failed):
                    ended = True
                    self.metrics.failed("error")
                    sse(ApiError(ev.status, ev.message, type=ev.type).body())
                    break
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            if not ended:  # the client went away mid-stream
                self.metrics.failed("abort")
            job.cancel()

    # -- the Responses API (responses.py): the chat route's request and scheduling ----------------
    async def create_response(self, request: Request):
        turn = Turn.read(await self.read_json(request), self.stored)
        parse = functools.partial(
            turn.request,
            self.engine,
            self.opts.served_name,
            self.opts.max_model_len,
            self.features,
            self.opts.max_num_seqs,
        )
        try:
            return await self.run(
                request,
                parse,
                functools.partial(self.whole_response, turn),
                functools.partial(self.response_events, turn),
            )
        except ApiError as e:
            raise turn.renamed(e) from None

    async def get_response(self, request: Request):
        self.check_auth(request)
        return JSONResponse(self.stored.response(request.path_params["response_id"]))

    async def whole_response(
        self, turn: Turn, request: Request, req: GenRequest, job: Job, inbox: Inbox, deadline: float
    ):
        """The Response object, built from the engine's events as its stream would be."""
        answer = turn.answer(req, self.engine.tokenizer)
        checked = time.monotonic()
        while not answer.ended:
            if time.monotonic() - checked >= DISCONNECT_CHECK:
                if await request.is_disconnected():
                    raise ClientGone
                checked = time.monotonic()
            try:
                _, ev = await self.next_event(inbox, deadline, request)
            except TimedOut:
                self.metrics.failed("timeout")
                raise self.timeout_error() from None
            answer.on(ev)
        if answer.error is not None:
            self.metrics.failed("error")
            raise answer.error
        self.metrics.finished(job, answer.finish_reason)
        self.stored.keep(answer)
        return JSONResponse(answer.response())

    async def response_events(self, turn: Turn, req: GenRequest, job: Job, inbox: Inbox, deadline: float):
        """The Responses stream: response.created and .in_progress at once, the output items'
        events as the answer comes, then response.completed (or .incomplete, or .failed)."""
        answer = turn.answer(req, self.engine.tokenizer)
        out = [sse(e) for e in answer.start()]
        try:
            while not answer.ended:
                if out and (not inbox.events or len(out) >= 64):
                    yield "".join(out)
                    out.clear()
                try:
                    _, ev = await self.next_event(inbox, deadline)
                except TimedOut:
                    self.metrics.failed("timeout")
                    out += [sse(e) for e in answer.fail(self.timeout_error())]
                    break
                out += [sse(e) for e in answer.on(ev)]
                if answer.error is not None:
                    self.metrics.failed("error")
                elif answer.finished is not None:
                    self.metrics.finished(job, answer.finish_reason)
                    self.stored.keep(answer)
            yield "".join(out)
        finally:
            if not answer.ended:  # the client went away mid-stream
                self.metrics.failed("abort")
            job.cancel()


SECRET_PARAM = re.compile(r"key|token|secret|passw|auth", re.I)


class RedactSecrets(logging.Filter):
    """uvicorn's access log prints each request's path with its query string as sent: the value of
    a parameter whose name speaks of a secret (`?api_key=...`, `?access_token=...`) is written as
    `[redacted]`, its name read percent-decoded (`api%5Fkey`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def redact_query(path: str) -> str:
    path, _, query = path.partition("?")
    parts = re.split(r"([&;])", query)
    for i in range(0, len(parts), 2):
        name, eq, _ = parts[i].partition("=")
        if SECRET_PARAM.search(urllib.parse.unquote_plus(name)):
            parts[i] = f"{name}{eq or '='}[redacted]"
    return f"{path}?{''.join(parts)}"


# -- the application ------------------------------------------------------------------------------
async def _api_error(request: Request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException):
    msg = {
        404: f"no route {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, exc.detail)
    return JSONResponse(
        ApiError(exc.status_code, msg).body(), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _client_gone(request: Request, exc: ClientGone):
    log.info("%s %s: the client left before its request was read", request.method, request.url.path)
    return Response(status_code=499)  # nobody reads it


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), status_code=500)


async def _cancel(job: Job):
    """A stream's end, whatever ended it: on the event loop, where a plain function would take a
    thread of Starlette's pool for each request."""
    job.cancel()


def build_app(engine, opts: ServeOptions) -> Starlette:
    server = Server(engine, opts)

    @asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(server.start)
        ready = "" if opts.started is None else f"; ready {time.monotonic() - opts.started:.1f} s after start"
        plan = server.scheduler.core.plan
        log.info(
            "serving %s: %d slots; a KV pool (%s) of %s tokens, %d sequences of --max-model-len %d; prefix "
            "caching %s; prefill forwards of up to %d tokens%s",
            opts.served_name,
            opts.max_num_seqs,
            engine.kv_layout.name,
            f"{plan.tokens:,}",
            plan.sequences(opts.max_model_len),
            opts.max_model_len,
            "on" if server.scheduler.core.blocks.prefix_caching else "off",
            server.scheduler.shapes.budget,
            ready + ("; deterministic" if opts.deterministic else ""),
        )
        yield
        server.scheduler.shutdown(timeout=SHUTDOWN_JOIN_S)
        server.parser.shutdown(wait=False)
        server.big_parser.shutdown(wait=False)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/responses", server.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", server.get_response, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            ClientGone: _client_gone,
            Exception: _internal_error,
        },
    )
    app.state.server = server
    return app
