"""Server-sent events: one `data: {json}` frame per chunk, then `data: [DONE]`.

An error after the 200 header has gone out cannot change the status any more, so it is sent as
a frame holding OpenAI's error body, followed by `[DONE]` as usual.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ...errors import LlmoptError
from ..engine.async_engine import EngineDeadError
from .common import dumps
from .errors import APIError, error_body

log = logging.getLogger("llmopt.serve")
DONE = b"data: [DONE]\n\n"


def sse_response(events: AsyncIterator[dict], generation) -> StreamingResponse:
    # The background task also runs when the client disconnects mid-stream: the request is
    # aborted even if the event generator never gets to run its own cleanup.
    return StreamingResponse(_frames(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(generation.close))


def frame(event: dict) -> bytes:
    return b"data: " + dumps(event) + b"\n\n"


async def _frames(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield frame(event)
    except APIError as e:
        yield frame(error_body(e.status_code, e.message, e.type, e.param, e.code))
    except EngineDeadError as e:
        yield frame(error_body(503, str(e), code="engine_dead"))  # the message says the engine stopped
    except LlmoptError as e:
        yield frame(error_body(400, str(e)))
    except Exception as e:  # a bug: the client still gets a well-formed end of stream
        log.exception("error while streaming")
        yield frame(error_body(500, f"internal server error ({e.__class__.__name__}); see the server log",
                               code="internal_error"))
    yield DONE
