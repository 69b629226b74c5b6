"""`python -m jaxllm.serve`: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import jaxllm
from jaxllm.config.engine import RUNTIME, SPECULATION, Parser, add_flags, from_args, settle
from jaxllm.config.runtime import env
from jaxllm.engine.memory import KVMemory
from jaxllm.errors import JaxllmError, ModelError, warnings_as_lines
from jaxllm.model.presets import read
from jaxllm.weights import read_config

STARTED = time.monotonic()
KEEP_ALIVE_S = 30.0  # seconds an idle HTTP connection stays open


def number(kind=int, ok=lambda v: v > 0, rule: str = "be > 0", what: str = "a number"):
    """An argparse type: `kind` of the flag's text, refused unless `ok(value)` (the message says it
    must `rule`)."""

    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must {rule}, got {s}")
        return v

    return parse


def positive(kind=int):
    return number(kind)


fraction = number(float, lambda v: 0 < v <= 1, "lie in (0, 1]")
port = number(int, lambda v: 0 <= v <= 65535, "lie in [0, 65535]", "a port number")
seconds = number(float, lambda v: v >= 0, "be >= 0", "a number of seconds")


UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def size(s):
    """A size in bytes: 2147483648, 2GiB, 1.5G, 512MiB."""

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", s)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2147483648, 2GiB or 512MiB, got {s!r}")
    v = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


SCHEDULER_DEFAULTS = {
    "max_num_seqs": 8,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": True,
    "deterministic": False,
    "decode_steps": 8,
}


def add_scheduler_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The flags of the engine's scheduler and KV pool; without `defaults` each is None unless
    given (the serving bench passes on only what its user gave)."""
    d = SCHEDULER_DEFAULTS if defaults else dict.fromkeys(SCHEDULER_DEFAULTS)
    g = p.add_argument_group("scheduler and KV pool")
    g.add_argument(
        "--max-num-seqs",
        type=positive(),
        default=d["max_num_seqs"],
        help="decode slots (requests run together) (default 8)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=d["gpu_memory_utilization"],
        help="fraction of the memory the device's allocator may use that the server fills, weights "
        "and the KV pool included (default 0.9); on a CPU the pool holds every slot at "
        "--max-model-len unless --kv-cache-memory says otherwise",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=size,
        default=None,
        help="bytes of the KV pool (e.g. 20GiB), instead of --gpu-memory-utilization",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d["enable_prefix_caching"],
        help="reuse the KV blocks of prompts' common prefixes across requests (default on)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        default=d["deterministic"],
        help="a request's answer (greedy, or sampled with its seed) is the same whatever runs beside "
        "it: one prefill shape (prompts cut every 256 tokens), decode blocks over every slot, "
        "no prefix caching, no preemption, no speculation (slower: docs/server.md)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive(),
        default=None,
        help="prompt tokens one prefill forward takes; longer prompts go in chunks of it "
        "(default: 8192 on a GPU whose allocator may hold 40 GiB or more, else 2048)",
    )
    g.add_argument(
        "--decode-steps",
        type=positive(),
        default=d["decode_steps"],
        help="decode steps per host round trip (more: higher throughput, later admission) (default 8)",
    )


def scheduler_flags(args: argparse.Namespace) -> list[str]:
    """The command line of the scheduler flags `args` holds a value for (`add_scheduler_args`)."""
    out = []
    for name in (*SCHEDULER_DEFAULTS, "kv_cache_memory", "max_num_batched_tokens"):
        v = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if v is None:
            continue
        if name == "enable_prefix_caching":
            out += [] if v else ["--no-enable-prefix-caching"]
        elif isinstance(v, bool):
            out += [flag] if v else []
        else:
            out += [flag, str(v)]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m jaxllm.serve", description=__doc__)
    src = p.add_mutually_exclusive_group()
    add_flags(src, ("model_dir", "shape"))
    add_flags(
        p,
        ("tokenizer", "dtype", "quant", "kv_quant", "max_ctx", "tp", "block_size", "compilation_cache"),
        "model",
        first={"max_ctx": "--max-model-len"},
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-model-name", help="model id clients send (default: the model's name)")
    p.add_argument(
        "--api-key",
        default=env("JAXLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (or set JAXLLM_API_KEY)",
    )
    p.add_argument(
        "--max-queue", type=positive(), default=64, help="requests waiting for a slot before new ones get 429"
    )
    p.add_argument(
        "--max-stored-responses",
        type=positive(),
        default=1000,
        help="/v1/responses answers kept in memory for previous_response_id and GET /v1/responses/ID, "
        "the oldest dropped first",
    )
    p.add_argument(
        "--request-timeout",
        type=seconds,
        default=600.0,
        help="seconds a request may take, queueing included; 0 = no limit",
    )
    p.add_argument("--max-request-bytes", type=positive(), default=4 << 20, help="request body size limit")
    p.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=30.0,
        help="on SIGTERM, seconds to let running requests finish before ending them with a 503",
    )
    p.add_argument(
        "--body-timeout",
        type=seconds,
        default=30.0,
        help="seconds a request body may stall before the request gets a 408",
    )
    p.add_argument(
        "--body-deadline",
        type=seconds,
        default=60.0,
        help="seconds a whole request body may take before the request gets a 408",
    )
    p.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        help="seconds a new connection may take to send its request's headers before it is closed",
    )
    p.add_argument(
        "--max-connections",
        type=positive(),
        default=1024,
        help="open connections (and requests) beyond which new requests get a 503",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip compiling before reporting ready")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_scheduler_args(p)
    add_flags(p, SPECULATION, "speculative decoding")
    add_flags(p, RUNTIME, "runtime")
    args = p.parse_args(argv)
    try:
        args.config = from_args(args)
    except JaxllmError as e:
        p.error(str(e))
    settle(args, args.config)
    if args.deterministic and args.speculative:
        p.error("--deterministic does not go with --speculative (drafts and verify cycles depend on the load)")
    return args


def check_model(args) -> None:
    """The model (a preset or a model path) from its config alone (JAX loads for the family's
    mapping, no weight is read): an unknown name or path is refused before the weights load."""
    c = args.config
    if c.shape:
        read(c.shape)  # an unknown name is refused before JAX loads
        if c.tokenizer and not Path(c.tokenizer).expanduser().is_dir():
            raise ModelError(f"--tokenizer {c.tokenizer}: no such directory")
    else:
        read_config(c.model_dir)


def bind(host: str, port: int) -> socket.socket:
    """Claim the address before the model loads, so that a busy port fails at once, not minutes later."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(info[4])
    return sock


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_model(args)
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    setup_logging(args)
    # Three threads share the GIL (HTTP, the engine's launches, reading results back): with the default
    # 5 ms switch interval one thread's Python could hold the next device launch back by that long.
    sys.setswitchinterval(0.0005)

    log = logging.getLogger("jaxllm.serve")
    log.info("compilation cache: %s", args.config.caches.compilation or "off")
    try:
        with warnings_as_lines():
            engine = jaxllm.load(config=args.config)
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log.info("model loaded %.1f s after start", time.monotonic() - STARTED)
    return serve(engine, args, sock)


def setup_logging(args: argparse.Namespace):
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")


def serve(engine, args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve `engine` on the bound socket `sock` with the flags `args` until a signal ends it, then
    exit within --shutdown-timeout (`draining_server`). -> the exit status."""
    from jaxllm.serve.app import RedactSecrets, ServeOptions, build_app  # JAX: the engine is loaded by now

    log = logging.getLogger("jaxllm.serve")
    opts = ServeOptions(
        served_name=args.served_model_name or engine.name,
        max_model_len=engine.max_ctx,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout if args.request_timeout > 0 else None,
        body_timeout=args.body_timeout,
        body_deadline=args.body_deadline,
        shutdown_timeout=args.shutdown_timeout,
        decode_steps=args.decode_steps,
        warmup=not args.no_warmup,
        started=STARTED,
        freeze_heap=True,
        kv_memory=KVMemory(args.gpu_memory_utilization, args.kv_cache_memory, args.enable_prefix_caching),
        max_stored_responses=args.max_stored_responses,
        deterministic=args.deterministic,
    )
    # The event loop, the engine thread, the output thread and the parse thread take turns at the
    # GIL; a thread that wakes for a moment's work (a request parsed, a call launched) waits for the
    # one holding it to reach its switch interval. At 1 ms rather than Python's 5 the Gemma 3 270M
    # shape's server gave 40,009 tok/s at 64 clients against 36,253 (one H200, the same code).
    sys.setswitchinterval(0.001)
    try:
        app = build_app(engine, opts)
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # uvicorn's own wait for open connections outlasts ours, so it never cuts a stream itself. An
    # idle connection is kept for longer than the OpenAI SDK keeps it (5 s, uvicorn's default
    # too): at equal times a client could send on a connection as the server closes it, and get
    # a connection error with no answer.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=args.shutdown_timeout + 30,
        lifespan="on",
        http=headers_within(args.header_timeout),
        limit_concurrency=args.max_connections,
    )
    logging.getLogger("uvicorn.access").addFilter(RedactSecrets())  # after uvicorn set up its loggers
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal; ignoring it then makes the
    # drained shutdown an ordinary exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    scheduler = app.state.server.scheduler
    server = draining_server(config, scheduler, args.shutdown_timeout)
    log.info("listening on http://%s:%d", args.host, args.port)
    server.run(sockets=[sock])
    status = 0 if server.started or server.should_exit else 1
    if scheduler.thread.is_alive() or scheduler.output.is_alive():
        log.info("a device call is still running; exiting without waiting for it")
    # Nothing is left to answer. A thread may still be inside a device call or a compile (a long
    # prefill, warm-up's background compiles): the interpreter's teardown beneath it aborts the
    # process, so it ends here, its log flushed.
    exit_now(status)


def headers_within(seconds: float):
    """uvicorn's HTTP protocol (httptools, a dependency) with a deadline on a new connection's first
    request headers: a client that sends them slowly (or never) is disconnected after `seconds`,
    rather than holding the connection for as long as it trickles. (An idle kept-alive connection
    is uvicorn's keep-alive timeout; a slow body is the app's --body-timeout and --body-deadline.)"""

    log = logging.getLogger("jaxllm.serve")

    class HeadersWithin(HttpToolsProtocol):
        timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.timer = self.loop.call_later(seconds, self.headers_late)

        def on_headers_complete(self):
            self.stop_timer()
            super().on_headers_complete()

        def headers_late(self):
            self.timer = None
            if not self.transport.is_closing():
                log.info(
                    "closed a connection from %s whose request headers took more than %g s",
                    "%s:%d" % self.client if self.client else "?",
                    seconds,
                )
                self.transport.close()

        def stop_timer(self):
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def connection_lost(self, exc):
            self.stop_timer()
            super().connection_lost(exc)

    return HeadersWithin


SHUTDOWN_GRACE_S = 3.0  # past --shutdown-timeout, for the last answers to reach their clients


def exit_now(status: int):
    """End the process at once, its log flushed, without the interpreter's teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def draining_server(config, scheduler, timeout: float):
    """A uvicorn server whose SIGTERM/SIGINT first stops the scheduler's admission (queued requests
    get a 503) and gives running requests `timeout` seconds to finish before they get one too
    (`Scheduler.drain`, on a timer of its own, so a long device call cannot hold them); meanwhile
    uvicorn closes the listening socket and waits for the open responses to end. A second signal
    ends every request at once. Either way the process exits 0 by the deadline plus
    SHUTDOWN_GRACE_S, even if the engine is inside a device call or still warming up then."""

    log = logging.getLogger("jaxllm.serve")

    class Draining(uvicorn.Server):
        watchdog: threading.Timer | None = None

        def handle_exit(self, sig, frame):
            first = not self.should_exit
            scheduler.drain(timeout if first else 0.0)
            self.arm(timeout + SHUTDOWN_GRACE_S if first else SHUTDOWN_GRACE_S)
            self.should_exit = True  # a second signal drains at once instead of cutting the streams

        def arm(self, seconds: float):
            if self.watchdog is not None:
                self.watchdog.cancel()
            self.watchdog = threading.Timer(seconds, self.deadline)
            self.watchdog.daemon = True
            self.watchdog.start()

        def deadline(self):
            log.warning("the server did not stop within --shutdown-timeout; exiting")
            exit_now(0)

    return Draining(config)


if __name__ == "__main__":
    sys.exit(main())
