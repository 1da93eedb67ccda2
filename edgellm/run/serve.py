"""`edgellm serve OUT`: an OpenAI-compatible HTTP server for an exported program, on FastAPI and
uvicorn (`pip install 'edgellm[serve]'`).

`GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (with
`stream: true`, server-sent events ending in `data: [DONE]`). The program runs one sequence at a
time: requests wait their turn in a bounded queue (full: 503 with Retry-After); a streamed
request whose client leaves stops its generation at the next token; and since the program's
caches keep the last sequence (session.py), a conversation that extends it prefills only its
new turn. A bad request gets a 4xx with an OpenAI-style error body, and the server goes on.
"""

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Literal, Union

from ..errors import InputError
from .sampling import Sampling
from .session import Session

MAX_BODY = 1 << 20  # bytes of a request body at most
RETRY_AFTER_S = 1


def _models():
    """The request bodies, as pydantic models (imported with the server's extra)."""
    from pydantic import BaseModel, ConfigDict, Field

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore")  # other OpenAI fields: accepted, unused
        model: Union[str, None] = None
        max_tokens: Union[int, None] = Field(None, ge=1)
        max_completion_tokens: Union[int, None] = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=0)
        min_p: float = Field(0.0, ge=0, le=1)
        repetition_penalty: float = Field(1.0, gt=0, le=10)
        seed: Union[int, None] = Field(None, ge=0, lt=1 << 63)
        stop: Union[str, list[str], None] = None
        n: int = Field(1, ge=1, le=1)
        stream: bool = False
        stream_options: Union[dict, None] = None

    class Part(BaseModel):
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: Literal["system", "user", "assistant", "developer"]
        content: Union[str, list[Part]]

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)

    class Completion(Common):
        prompt: Union[str, list[int]]

    return Chat, Completion


class Server:
    """The app's state: the session, a lock that gives the program to one request at a time,
    and the count of requests admitted (running or waiting)."""

    def __init__(self, target, queue: int = 16, tokenizer=None):
        self.session = Session(target, tokenizer)
        folder = self.session.program.path.parent
        self.model_id = folder.name or "edgellm"
        self.created = int(folder.stat().st_mtime)
        self.queue, self.admitted, self.running = queue, 0, False
        self.lock = asyncio.Lock()  # requests take turns in order
        self.program = threading.Lock()  # held by the thread running the program
        self.vocab = int(self.session.program.meta.get("get_vocab_size", 0)) or None

    def admit(self) -> "_Ticket":
        if self.admitted >= 1 + self.queue:
            raise _Busy()
        self.admitted += 1
        return _Ticket(self)

    def ids(self, body, chat: bool) -> list[int]:
        s = self.session
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.content if isinstance(m.content, str)
                         else "".join(p.text for p in m.content)} for m in body.messages]
            from jinja2 import TemplateError

            try:
                return s.chat_ids(messages)
            except (TemplateError, TypeError, ValueError) as e:  # the template's own refusal
                raise _Refused(f"the model's chat template refused these messages: {e}",
                               "messages") from None
        if isinstance(body.prompt, list):
            bad = [i for i in body.prompt if i < 0 or (self.vocab and i >= self.vocab)]
            if bad:
                raise _Refused(f"prompt: token ids {bad[:4]} are outside the vocabulary "
                               f"(0..{self.vocab - 1})", "prompt")
            return list(body.prompt)
        return s.encode(body.prompt)

    def sampling(self, body, prompt: int) -> Sampling:
        context = self.session.context
        asked = body.max_completion_tokens or body.max_tokens
        if context is not None and prompt >= context:
            raise _Refused(f"the prompt is {prompt} tokens; this model's context is {context} "
                           "positions, and the reply needs at least one",
                           "messages" if hasattr(body, "messages") else "prompt")
        if context is not None and asked is not None and prompt + asked > context:
            raise _Refused(f"max_tokens {asked} and the prompt's {prompt} tokens are past "
                           f"this model's context of {context} positions; ask for at most "
                           f"{context - prompt}", "max_tokens")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > 4 or not all(stop):
            raise _Refused("stop: up to 4 non-empty strings", "stop")
        same = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
        return Sampling(**{k: getattr(body, k) for k in same}, stop=stop,
                        max_tokens=asked or (context - prompt if context else 256))


class _Busy(Exception):
    pass


class _Refused(InputError):
    """A bad request, naming the request field at fault (`param`, OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _TooLarge(Exception):
    pass


class _BodyLimit:
    """ASGI middleware: a request body over MAX_BODY bytes (by its Content-Length, or as it
    arrives) is refused with 413 before it is read whole."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = dict(scope["headers"]).get(b"content-length", b"0")
        if not size.isdigit() or int(size) > MAX_BODY:
            return await _error(413, f"the request body is over {MAX_BODY} bytes", None)(
                scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY:
                raise _TooLarge()
            return message

        await self.app(scope, counted, send)


class _Ticket:
    """A request's place: released once, whichever of the stream or the response's background
    task gets there first (a client gone before its stream started never runs the stream)."""

    def __init__(self, server: Server):
        self.server, self.done = server, False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.server.admitted -= 1


async def _pieces(server: Server, ids: list[int], sampling: Sampling):
    """Yield the generation's text pieces, then the finished Generation. The program runs in a
    worker thread under `server.program` (a thread lock: a request whose task was cancelled
    leaves the asyncio lock at once, and the next one's thread waits there until this one's is
    out), which stops at the next token once this generator is closed."""
    loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    run = server.session.generate(ids, sampling, cancelled=stop.is_set)

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (the server stopped): stop too
            stop.set()

    def produce():
        with server.program:
            server.running = True
            try:
                for piece in run:
                    put(piece)
                put(run)
            except BaseException as e:  # to the request's task, which raises it
                put(e)
            finally:
                server.running = False

    async with server.lock:
        loop.run_in_executor(None, produce)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if not isinstance(item, str):
                    return
        finally:
            stop.set()


def app(target, queue: int = 16, tokenizer=None):
    """The ASGI app serving the program at `target` (an export folder or its model.pte)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    Chat, Completion = _models()
    server = Server(target, queue, tokenizer)
    api = FastAPI(title="edgellm", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error')})",
                          None)
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid body')}",
                      where or None)

    @api.exception_handler(InputError)
    async def refused(request, e: InputError):
        return _error(400, str(e), getattr(e, "param", None))

    @api.exception_handler(_TooLarge)
    async def too_large(request, e):
        return _error(413, f"the request body is over {MAX_BODY} bytes", None)

    @api.exception_handler(_Busy)
    async def busy(request, e):
        return _error(503, f"the program is busy and {server.queue} requests are waiting; "
                      "retry later", None, "server_busy", {"Retry-After": str(RETRY_AFTER_S)})

    @api.get("/health")
    async def health():
        return {"status": "ok", "running": server.running,
                "waiting": server.admitted - server.running}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model",
                                            "created": server.created, "owned_by": "edgellm"}]}

    async def respond(body, chat: bool):
        ids = server.ids(body, chat)
        sampling = server.sampling(body, len(ids))
        ticket = server.admit()
        head = _head(server, chat)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_events(server, ids, sampling, head, chat, usage, ticket),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(ticket.release))
        try:
            async for item in _pieces(server, ids, sampling):
                run = item
        finally:
            ticket.release()
        choice = {"index": 0, "finish_reason": run.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": run.text}
        else:
            choice.update(text=run.text, logprobs=None)
        return {**head, "choices": [choice], "usage": _usage(run)}

    @api.post("/v1/chat/completions")
    async def chat(body: Chat):
        return await respond(body, True)

    @api.post("/v1/completions")
    async def completions(body: Completion):
        return await respond(body, False)

    api.add_middleware(_BodyLimit)
    api.state.server = server
    return api


async def _events(server, ids, sampling, head, chat: bool, usage: bool, ticket):
    """The streamed reply as server-sent events: a chunk per piece of text, one with the finish
    reason, the usage if asked, then `[DONE]`."""
    def event(choice: dict | None, **extra) -> str:
        kind = "chat.completion.chunk" if chat else "text_completion"
        return "data: " + json.dumps({**head, "object": kind,
                                      "choices": [choice] if choice else [], **extra}) + "\n\n"

    def piece(text: str | None, finish=None) -> dict:
        if chat:
            return {"index": 0, "delta": {} if text is None else {"content": text},
                    "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    try:
        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None})
        async for item in _pieces(server, ids, sampling):
            if isinstance(item, str):
                yield event(piece(item))
            else:
                yield event(piece(None, item.finish_reason))
                if usage:
                    yield event(None, usage=_usage(item))
        yield "data: [DONE]\n\n"
    finally:
        ticket.release()


def _head(server: Server, chat: bool) -> dict:
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": server.model_id}


def _usage(run) -> dict:
    u = run.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _error(status: int, message: str, param, kind: str = "invalid_request_error",
           headers: dict | None = None):
    from fastapi.responses import JSONResponse

    if status == 413:
        kind = "request_too_large"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status, headers=headers)


def serve(target, host: str = "127.0.0.1", port: int = 8080, queue: int = 16,
          tokenizer=None) -> None:
    """Serve the program until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise InputError("edgellm serve needs FastAPI and uvicorn: pip install "
                         "'edgellm[serve]'") from None
    api = app(target, queue, tokenizer)
    print(f"edgellm: serving {Path(target)} on http://{host}:{port}/v1", flush=True)
    uvicorn.run(api, host=host, port=port, log_level="warning")
