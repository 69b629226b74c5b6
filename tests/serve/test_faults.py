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
                sched._collect = lambda call: (_ for _ in ()).throw(Fault("output loop broken"))
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
    """`tests/helpers/scripted_serve.py` as a process: the server's command line on the tiny Qwen3."""

    def __init__(self, model_dir, log_path: Path, step_s: float, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "scripted_serve.py"),
                                      str(model_dir), str(step_s), "--", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

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
