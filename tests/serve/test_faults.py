"""Faults inside the server: an engine or output thread that stops on its own, or a device that
stops making progress. `/health` says so with a 503 and the reason, every request in flight or
waiting ends at once with a 503 (not at its timeout), and new requests are refused the same way.
And the process's shutdown: SIGTERM under load, a second SIGTERM, SIGTERM during warm-up, each an
exit 0 within --shutdown-timeout with every request ended cleanly and no traceback.

The model is the tiny Qwen3 with scripted answers (`tiny_chat.ScriptedEngine`), served in this
process, its decode steps slowed so that requests are still running and waiting when the fault
comes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tiny_chat

import jaxllm

MAX_LEN = 1024


class Fault(BaseException):
    """Raised where no step's own error handling catches it: the thread's loop itself ends."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return jaxllm.load(str(tiny_chat.make_qwen3(tmp_path_factory.mktemp("faults_qwen3"))), quant="none",
                       dtype="float32", max_ctx=MAX_LEN)


def serve(engine, step_s: float, **opts) -> tiny_chat.LiveServer:
    double = tiny_chat.ScriptedEngine(engine, lambda ids: engine.tokenizer.encode("word " * 40), step_s=step_s)
    return tiny_chat.LiveServer(double, max_model_len=MAX_LEN, max_num_seqs=2, **opts)


def ask(url: str) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 40, "ignore_eos": True},
                   timeout=120)
    return r.status_code, r.json(), time.monotonic() - t0


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def loaded(server, running: int, waiting: int, timeout: float = 30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        load = server.scheduler.load()
        if load["running"] >= running and load["waiting"] >= waiting:
            return
        time.sleep(0.02)
    raise AssertionError(f"the load never reached {running} running and {waiting} waiting: {load}")


@pytest.mark.parametrize("thread", ["engine", "output"])
def test_a_thread_that_stops_fails_every_request_at_once_and_health_says_503(engine, thread):
    server = serve(engine, step_s=0.05)
    try:
        sched = server.scheduler
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            first = [pool.submit(ask, server.url) for _ in range(5)]
            loaded(server, running=2, waiting=3)
            t0 = time.monotonic()
            if thread == "engine":           # the loop's own bookkeeping, outside any step's handler
                sched._free_ended = lambda: (_ for _ in ()).throw(Fault("engine loop broken"))
                with sched.cond:
                    sched.cond.notify()
            else:
                sched.results._collect = lambda call: (_ for _ in ()).throw(Fault("output loop broken"))
            results = [f.result() for f in first]
        assert all(status == 503 for status, _, _ in results), results
        assert time.monotonic() - t0 < 5          # at once, not at the request timeout
        assert all(f"{thread} thread stopped" in body["error"]["message"] for _, body, _ in results)
        r = health(server.url)
        assert r.status_code == 503 and f"{thread} thread stopped" in r.json()["error"]["message"]
        status, body, dt = ask(server.url)
        assert status == 503 and f"{thread} thread stopped" in body["error"]["message"] and dt < 5
    finally:
        server.stop()


def test_a_stalled_device_turns_health_to_503(engine):
    server = serve(engine, step_s=1.0, stall_timeout=0.5)      # decode blocks far past the stall limit
    try:
        assert health(server.url).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(httpx.post, server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                        timeout=5)
            t0 = time.monotonic()
            while health(server.url).status_code == 200:
                assert time.monotonic() - t0 < 10, "health never noticed the stall"
                time.sleep(0.1)
        r = health(server.url)
        assert r.status_code == 503 and "no progress" in r.json()["error"]["message"]
    finally:
        server.scheduler.done = True            # do not wait for the stalled step to end
        server.stop()


# -- shutdown: SIGTERM under load, a second SIGTERM, SIGTERM during warm-up --------------------------
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class Process:
    """`tests/helpers/scripted_serve.py` as a process: the server's command line on the tiny Qwen3.
    Every one started is killed when the module's tests end (`reap`), whatever ended them."""
    started: list = []

    def __init__(self, model_dir, log_path: Path, step_s: float, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "scripted_serve.py"),
                                      str(model_dir), str(step_s), "--", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        Process.started.append(self.proc)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float = 300.0):
        t0 = time.monotonic()
        while text not in self.output():
            assert self.proc.poll() is None, self.output()[-3000:]
            assert time.monotonic() - t0 < timeout, self.output()[-3000:]
            time.sleep(0.05)

    def signal_and_wait(self, *delays: float) -> tuple[int, float]:
        """SIGTERM now, and again after each of `delays` seconds -> (exit status, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        for d in delays:
            time.sleep(d)
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        return code, time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(url: str, i: int) -> str:
    """One of the load's requests, streamed when i is odd -> how it ended: "complete", "503" (an
    OpenAI error body), "stream-error" (an error event, then [DONE]), or what went wrong."""
    body = {"prompt": f"request {i}", "max_tokens": 200, "ignore_eos": True, "stream": i % 2 == 1}
    async with httpx.AsyncClient(timeout=120) as http:
        try:
            if not body["stream"]:
                r = await http.post(url + "/v1/completions", json=body)
                if r.status_code == 200:
                    return "complete" if r.json()["choices"][0]["finish_reason"] else f"200 {r.text[:200]}"
                err = r.json().get("error", {})
                return "503" if r.status_code == 503 and err.get("message") else f"{r.status_code} {r.text[:200]}"
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return "503" if r.status_code == 503 else f"{r.status_code}"
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            if events[-1] != "[DONE]":
                return f"cut: {events[-2:]}"
            last = json.loads(events[-2])
            if "error" in last:
                return "stream-error"
            return "complete" if last["choices"][0]["finish_reason"] else f"open: {events[-2:]}"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module", autouse=True)
def reap():
    yield
    for proc in Process.started:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny_chat.make_qwen3(tmp_path_factory.mktemp("shutdown_qwen3"))


@pytest.mark.parametrize("timeout,again", [(30, ()), (5, ()), (30, (1.0,))],
                         ids=["default-timeout", "timeout-5", "second-sigterm"])
def test_sigterm_under_load_ends_every_request_cleanly_and_exits_0(qwen3_dir, tmp_path, timeout, again):
    """16 running and 24 waiting on 16 slots, decode slowed so that none can finish: every request
    ends with a clean 503 or an error event and [DONE], the process exits 0 within the timeout
    plus 5 s (a second SIGTERM: within 5 s of it), and its log holds no traceback."""
    p = Process(qwen3_dir, tmp_path / "server.log", 0.25, "--no-warmup", "--max-num-seqs", "16", "--max-queue", "40",
                "--max-model-len", "1024", "--shutdown-timeout", str(timeout))
    p.wait_for("Application startup complete")

    async def run():
        tasks = [asyncio.create_task(one_request(p.url, i)) for i in range(40)]
        t0 = time.monotonic()
        seen = []
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                load = (await http.get(p.url + "/health")).json()
                seen.append((load["running"], load["waiting"]))
                if load["running"] == 16 and load["waiting"] == 24:
                    break
                assert time.monotonic() - t0 < 60 and load["finished"] == 0, seen
                await asyncio.sleep(0.05)
        code, took = await asyncio.to_thread(p.signal_and_wait, *again)
        return code, took, await asyncio.gather(*tasks)
    code, took, ends = asyncio.run(run())
    log = p.output()
    assert code == 0, log[-3000:]
    assert took < (again[0] + 5 if again else timeout + 5), (took, log[-2000:])
    assert "Traceback" not in log, log[-3000:]
    assert all(e in ("503", "stream-error") for e in ends), ends
    assert (ends.count("503"), ends.count("stream-error")) == (20, 20)      # the unstreamed half, the streamed


def test_sigterm_during_warmup_exits_0_within_the_timeout(qwen3_dir, tmp_path):
    p = Process(qwen3_dir, tmp_path / "server.log", 0, "--max-num-seqs", "4", "--max-model-len", "1024",
                "--shutdown-timeout", "5")
    p.wait_for("Waiting for application startup")      # the warm-up has begun
    time.sleep(1.0)
    assert "Application startup complete" not in p.output()       # and not ended
    code, took = p.signal_and_wait()
    log = p.output()
    assert code == 0 and took < 10, (code, took, log[-3000:])
    assert "Traceback" not in log, log[-3000:]


# -- clients: gone mid-upload or mid-stream, trickling, slow headers, oversized, unauthorized -----------
def raw(port: int, data: bytes, then=None, timeout: float = 30.0) -> tuple[bytes, float]:
    """`data` sent on a fresh connection (`then(sock)` sends the rest) -> (what came back until the
    server closed it, seconds from the first byte to the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(data)
        if then is not None:
            then(s)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        return got, time.monotonic() - t0


def trickle(s: socket.socket, pieces: list[bytes], every: float):
    for p in pieces:
        time.sleep(every)
        try:
            s.sendall(p)
        except OSError:                 # the server closed it: what it answered is read next
            return


def test_hostile_clients_are_cut_within_their_deadlines_without_tracebacks(qwen3_dir, tmp_path):
    """20 clients leave mid-upload and 20 mid-stream, a body trickles a byte a second (cut at the
    whole-body deadline though no gap reaches the gap limit), headers trickle (cut at the header
    deadline), a 10 MB body over a 5 MB limit and a body sent with a wrong key get their 413 and
    401 (not a reset): the log holds no traceback and the server answers correctly after."""
    key = "k-123"
    p = Process(qwen3_dir, tmp_path / "server.log", 0.05, "--no-warmup", "--max-num-seqs", "4", "--max-queue", "64",
                "--max-model-len", "1024", "--api-key", key, "--max-request-bytes", str(5 << 20),
                "--body-timeout", "2", "--body-deadline", "4", "--header-timeout", "2")
    auth = {"Authorization": f"Bearer {key}"}
    try:
        p.wait_for("Application startup complete")
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {key}\r\n").encode()

        def leave_mid_upload(_):
            with socket.create_connection(("127.0.0.1", p.port)) as s:
                s.sendall(head + b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)

        async def leave_mid_stream(_):
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with http.stream("POST", p.url + "/v1/completions", json=body, headers=auth) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 2:
                            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            list(pool.map(leave_mid_upload, range(20)))

        async def streams():
            return await asyncio.gather(*(leave_mid_stream(i) for i in range(20)))
        assert asyncio.run(streams()) == [200] * 20

        body = b'{"prompt": "hello", "max_tokens": 2}'
        got, took = raw(p.port, head + f"Content-Length: {len(body)}\r\n\r\n".encode(),
                        lambda s: trickle(s, [bytes([c]) for c in body], 1.0))
        assert got.startswith(b"HTTP/1.1 408") and b"took more than 4 s" in got and took < 8, (got[:300], took)

        got, took = raw(p.port, b"POST /v1/completions HTTP/1.1\r\n",
                        lambda s: trickle(s, [b"X-Slow: ", b"1", b"2", b"3", b"4", b"5", b"6", b"\r\n"], 1.0))
        assert got == b"" and took < 5, (got[:300], took)

        r = httpx.post(p.url + "/v1/completions", content=b"{" + b" " * (10 << 20) + b"}", headers=auth, timeout=60)
        assert r.status_code == 413 and "larger than the limit" in r.json()["error"]["message"]
        r = httpx.post(p.url + "/v1/completions", content=b"{" + b" " * (3 << 20) + b"}",
                       headers={"Authorization": "Bearer wrong"}, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        r = httpx.post(p.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        load = httpx.get(p.url + "/health", timeout=10).json()
        assert load["running"] == 0 and load["waiting"] == 0, load
    finally:
        code, _ = p.signal_and_wait()
    log = p.output()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert log.count("the client left before its request was read") == 20, log[-3000:]
