"""What the router does to bodies and streams (lesson 18): a completion of several prompts split into one body per
prompt and their answers merged back, the JSON objects of a stream of server-sent events, a backend's refusal of a
stream, and work that ends when the client goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from .router_policy import BackendFailed

T = TypeVar("T")


def split_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion body of several prompts as one body per prompt (a chat, or one prompt: the body alone). A
    prompt is a string or a list of token ids; several are a list of those."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    return [{**body, "prompt": one} for one in prompt] if several else [body]


def merge_answers(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Completions of one prompt each as one completion of them all: choices in prompt order, usage summed."""
    merged = {**answers[0], "choices": []}
    for index, answer in enumerate(answers):
        merged["choices"] += [{**choice, "index": index} for choice in answer.get("choices", [])]
    usages = [answer["usage"] for answer in answers if isinstance(answer.get("usage"), dict)]
    if usages:
        merged["usage"] = {name: sum(u.get(name) or 0 for u in usages)
                           for name in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return merged


class Refused(Exception):
    """A backend answered a stream request with an error status (its JSON body, whole)."""

    def __init__(self, status: int, content: bytes) -> None:
        super().__init__(status)
        self.status, self.content = status, content

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, media_type="application/json")

    def json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.content)
        except ValueError:
            value = None
        return value if isinstance(value, dict) else {"error": {"message": f"status {self.status}",
                                                                 "type": "server_error"}}


async def sse_objects(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a stream of server-sent events (`data: {...}` lines), without the final `[DONE]`."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                try:
                    value = json.loads(line[6:])
                except ValueError:
                    continue
                if isinstance(value, dict):
                    yield value


async def unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """`work`'s result, or None if the client disconnected first (the work is cancelled then: closing the
    router's connections aborts the requests upstream)."""
    working = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watching = asyncio.ensure_future(gone())
    await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if not working.done():
        working.cancel()
        with contextlib.suppress(asyncio.CancelledError, BackendFailed):
            await working
        return None
    try:
        return working.result()
    except BackendFailed as error:
        return error  # type: ignore[return-value]


async def merged_events(streams: Sequence[Callable[[], Awaitable[AsyncIterator[bytes]]]], max_queued: int,
                        include_usage: bool) -> AsyncIterator[str]:
    """Several prompts' streams as one (each opened by calling its entry): each event's choices renumbered by
    prompt, in the order they come, the usage summed into one last event, then one `[DONE]`. At most `max_queued`
    events wait for a slow reader before the streams do."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue(max_queued)

    async def pump(index: int, open_stream: Callable[[], Awaitable[AsyncIterator[bytes]]]) -> None:
        try:
            async for event in sse_objects(await open_stream()):
                await queue.put((index, event))
        except BackendFailed as error:
            await queue.put((index, {"error": {"message": str(error), "type": "server_error"}}))
        except Refused as refused:
            await queue.put((index, refused.json()))
        finally:
            await queue.put((index, None))

    pumps = [asyncio.create_task(pump(i, open_stream)) for i, open_stream in enumerate(streams)]
    usage: dict[str, int] = {}
    last: dict[str, Any] = {}
    try:
        for _ in range(len(pumps)):
            while (item := await queue.get())[1] is not None:
                index, event = item
                if event.get("choices"):
                    event["choices"] = [{**choice, "index": index} for choice in event["choices"]]
                    event.pop("usage", None)
                    last = event
                    yield f"data: {json.dumps(event)}\n\n"
                elif isinstance(event.get("usage"), dict):
                    for name, value in event["usage"].items():
                        usage[name] = usage.get(name, 0) + (value if isinstance(value, int) else 0)
                else:
                    yield f"data: {json.dumps(event)}\n\n"
        if include_usage and usage:
            yield f"data: {json.dumps({**last, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
