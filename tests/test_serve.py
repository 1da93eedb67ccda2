"""`edgellm serve` (edgellm/run/serve.py) driven through real HTTP on 127.0.0.1: the official
`openai` client, bad requests, a full queue, a client that leaves, 16 concurrent clients, and
random bodies that must never get a 5xx."""

import contextlib
import json
import statistics
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.program import Program
from edgellm.run.sampling import Sampling
from edgellm.run.session import Session


@contextlib.contextmanager
def serving(folder, endless=False, **options):
    """The server on a free port of 127.0.0.1, in a thread of this process; yields its URL.
    `endless`: the program's end-of-sequence ids are not stops (a reply runs its max_tokens)."""
    import uvicorn

    from edgellm.run.serve import app

    api = app(folder, **options)
    if endless:
        api.state.server.session.eos = set()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def tiny(exported):
    folder, _ = exported("llama")
    with serving(folder) as url:
        yield folder, url


@pytest.fixture
def slow_steps(monkeypatch):
    """Each decode step of the program takes 50 ms more (the tiny model's are too quick to
    catch a request in the middle); returns the positions stepped."""
    steps, real = [], Program.forward

    def forward(self, tokens, input_pos):
        steps.append(int(input_pos[0]))
        time.sleep(0.05)
        return real(self, tokens, input_pos)

    monkeypatch.setattr(Program, "forward", forward)
    return steps


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def greedy(folder, ids, n):
    return Session(folder).generate(ids, Sampling(max_tokens=n)).run()


def test_the_openai_client_chats_streams_and_completes(tiny):
    folder, url = tiny
    openai = client(url)
    [model] = openai.models.list().data
    assert model.id == folder.name and httpx.get(f"{url}/health").json()["status"] == "ok"
    messages = [{"role": "user", "content": "hello world"}]
    ids = Session(folder).chat_ids(messages)
    want = greedy(folder, ids, 6)
    reply = openai.chat.completions.create(model=model.id, messages=messages, temperature=0,
                                           max_tokens=6)
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == len(ids) and reply.object == "chat.completion"
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(openai.chat.completions.create(
        model=model.id, messages=messages, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == reply.choices[0].finish_reason
    text = openai.completions.create(model=model.id, prompt="the quick", temperature=0,
                                     max_tokens=6)
    assert text.choices[0].text == greedy(folder, Session(folder).encode("the quick"), 6)


def test_a_stream_ends_with_done_as_server_sent_events(tiny):
    _, url = tiny
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "prompt": "the quick", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize("body, status, param, says", [
    (b"{not json", 400, None, "JSON"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"prompt": "hi", "max_tokens": 40}, 400, "max_tokens", "past this model's context of 32"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"prompt": "the quick brown fox " * 20}, 400, "prompt", "this model's context is 32"),
    ({"messages": [{"role": "user", "content": "the quick brown fox " * 20}]}, 400, "messages",
     "this model's context is 32"),
    ({"prompt": "hi", "n": 2}, 400, "n", "less than or equal to 1"),
    ({"prompt": [5, 1000000]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": "x" * (2 << 20)}, 413, None, "over 1048576 bytes"),
])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(tiny, body, status, param,
                                                                 says):
    _, url = tiny
    path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == status and says in error["message"], r.text
    assert error["param"] == param and error["type"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "the", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_full_queue_answers_503_with_retry_after(exported, slow_steps):
    folder, _ = exported("llama")
    with serving(folder, endless=True, queue=0) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "prompt": "the", "max_tokens": 20, "stream": True, "temperature": 0}) as r:
            lines = r.iter_lines()  # (an iterator dropped would close the stream)
            next(lines)  # the program is running this one
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": "the"})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "server_busy"
            list(lines)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "the",
                                                         "max_tokens": 2}).status_code == 200


def test_a_client_that_leaves_mid_stream_frees_the_program_at_once(exported, slow_steps):
    folder, _ = exported("llama")
    with serving(folder, endless=True) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "prompt": "the", "max_tokens": 25, "stream": True, "temperature": 0}) as r:
            lines = r.iter_lines()
            next(lines), next(lines)
        left, deadline = len(slow_steps), time.monotonic() + 1
        while httpx.get(f"{url}/health").json()["running"]:
            assert time.monotonic() < deadline, "the program still runs for a client that left"
            time.sleep(0.02)
        assert len(slow_steps) <= left + 2 < 24  # stopped within a step or two, not at 25


def test_sixteen_clients_at_once_each_get_their_own_whole_reply(tiny):
    """16 clients, 4 requests each, prompts of four kinds in turn: every reply is complete,
    well-formed and the greedy text of its own prompt (nothing mixed in from another's)."""
    folder, url = tiny
    session = Session(folder)
    prompts = ["the quick", "hello world", "edge devices", "one two three"]
    want = {p: greedy(folder, session.encode(p), 8) for p in prompts}
    results, latencies = [], []

    def one_client(k):
        with httpx.Client(base_url=url, timeout=60) as http:
            for i in range(4):
                prompt = prompts[(k + i) % 4]
                t = time.perf_counter()
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0})
                latencies.append(time.perf_counter() - t)
                results.append((prompt, r.status_code, r.json()))

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(16)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    assert len(results) == 64
    for prompt, status, body in results:
        assert status == 200 and body["choices"][0]["text"] == want[prompt], (prompt, body)
        assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                                 + body["usage"]["completion_tokens"])
    tokens = sum(body["usage"]["completion_tokens"] for _, _, body in results)
    latencies.sort()
    print(f"p50 {statistics.median(latencies) * 1e3:.1f} ms, p99 {latencies[-1] * 1e3:.1f} ms, "
          f"{tokens / wall:.1f} tok/s")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "n", "stream", "repetition_penalty", "max_completion_tokens"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.text(max_size=30) | JSON})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6)
       | st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3)},
                               optional={"max_tokens": st.integers(-2, 40),
                                         "temperature": st.floats(-1, 3),
                                         "stop": JSON, "seed": st.integers()})
       | st.fixed_dictionaries({"prompt": st.text(max_size=40) | st.lists(st.integers())},
                               optional={"max_tokens": st.integers(-2, 40), "top_k": JSON}),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bodies_never_get_a_5xx(tiny, body, path):
    _, url = tiny
    r = httpx.post(url + path, content=json.dumps(body), timeout=60,  # NaN, Infinity as well
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    assert r.status_code == 200 or "message" in r.json()["error"]


@pytest.mark.heavy
def test_the_default_model_says_paris_through_the_openai_client(default_export):
    folder, _ = default_export
    with serving(folder) as url:
        reply = client(url).chat.completions.create(
            model="smollm2", temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content, reply
