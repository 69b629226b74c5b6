"""Faults inside the server: an engine or output thread that stops on its own, or a device that
stops making progress. `/health` says so with a 503 and the reason, every request in flight or
waiting ends at once with a 503 (not at its timeout), and new requests are refused the same way.

The model is the tiny Qwen3 with scripted answers (`tiny_chat.ScriptedEngine`), served in this
process, its decode steps slowed so that requests are still running and waiting when the fault
comes.
"""
from __future__ import annotations

import concurrent.futures
import time

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
