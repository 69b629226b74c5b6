"""A request's way in: its API key, and its body, read within the server's limits (its size and
media type, a deadline between two reads and one for the whole) and parsed as JSON. Each refusal is
an `ApiError`; a client that leaves mid-upload is a `ClientGone`."""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.requests import ClientDisconnect, Request

from jaxllm.serve.fields import MAX_DEPTH, ApiError, bad, short, too_deep

DISCARD_LIMIT = 64 << 20  # bytes of a refused request's body read and thrown away, so the client reads the refusal


class ClientGone(Exception):
    pass


def check_key(request: Request, key: str | None):
    """The request's API key, where the server has one (`Authorization: Bearer <key>`; else 401)."""
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def json_body(request: Request, key: str | None, limit: int, gap: float, whole: float):
    """The request's JSON body, after its API `key` is checked. A request refused before its body
    is read (a wrong key, a body over `limit` bytes) still has its body read, up to DISCARD_LIMIT
    bytes, and thrown away: the client then reads the 401 or 413 rather than a connection reset.
    A body must arrive within `gap` seconds of each read and `whole` seconds in all (408); a client
    that leaves mid-upload ends the request quietly (`ClientGone`)."""
    refused = None
    try:
        check_key(request, key)
    except ApiError as e:
        refused = e
    too_big = ApiError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        if int(length) > DISCARD_LIMIT:
            raise refused or too_big  # too much to read for nothing: the client sees a reset
        refused = refused or too_big
    # JSON only: a browser's cross-origin POST that needs no preflight can only send text/plain,
    # a form or multipart, so another site's page cannot make a keyless server generate
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        refused = refused or ApiError(
            415,
            f"the request body must be sent with 'Content-Type: application/json', not {short(media or 'none')}",
            code="unsupported_media_type",
        )
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    end = loop.time() + whole
    try:  # a deadline on this task, moved at each read (`wait_for` would start a task a read)
        async with asyncio.timeout(min(gap, whole)) as stalled:
            async for chunk in request.stream():
                size += len(chunk)
                if refused is None and size > limit:
                    refused = too_big
                if refused is None:
                    chunks.append(chunk)
                elif size > DISCARD_LIMIT:
                    break
                stalled.reschedule(min(loop.time() + gap, end))
    except TimeoutError:
        if refused is not None:
            raise refused from None
        why = f"took more than {whole:g} s" if loop.time() >= end - 0.01 else f"stalled for more than {gap:g} s"
        raise ApiError(
            408,
            f"the request body {why}",
            type="timeout_error",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None  # the rest of it is not read
    except ClientDisconnect:
        raise ClientGone from None
    if refused is not None:
        raise refused
    raw = b"".join(chunks)
    request.state.body_bytes = len(raw)
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if isinstance(body, (dict, list)) and too_deep(body):
        raise bad(f"the request body is nested too deeply (more than {MAX_DEPTH} levels)")
    try:  # "\ud800" escapes parse, but no tokenizer can take them
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad("the request body holds an unpaired UTF-16 surrogate escape") from None
    return body
