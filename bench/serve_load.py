"""`edgellm serve` under load, and what reusing the caches saves a chat's second turn (issue 24).

usage: python bench/serve_load.py OUT [--clients 16] [--requests 4] [--max-tokens 32]

Starts `edgellm serve OUT` in its own process on a free port, then:
- load: CLIENTS threads, each sending REQUESTS chat completions in turn (greedy, MAX_TOKENS
  tokens, four different questions in rotation): latency p50 and p99 per request, completion
  tokens per second of wall time, and every reply checked against the same question's reply
  when asked alone (none mixed with another's);
- turns: a conversation streamed turn by turn: time to first token of turn one, of turn two
  (the caches hold turn one and its reply: only turn two's own tokens are prefilled), and of
  the same turn two after an unrelated request replaced what the caches held.
Prints a table; the last line is one JSON object.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

QUESTIONS = ["What is the capital of France?", "Name three colors.",
             "What is two plus two?", "Say hello in Spanish."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(http, messages, max_tokens, stream=False):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True}}
    if not stream:
        return http.post("/v1/chat/completions", json=body).json()
    t0, first, text, usage = time.perf_counter(), None, "", None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                piece = choice["delta"].get("content")
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece or ""
    return {"ttft_s": first, "text": text, "usage": usage}


def load(url, clients: int, requests: int, max_tokens: int) -> dict:
    with httpx.Client(base_url=url, timeout=600) as http:
        alone = {q: chat(http, [{"role": "user", "content": q}], max_tokens)
                 ["choices"][0]["message"]["content"] for q in QUESTIONS}
    latencies, tokens, wrong = [], [], []

    def client(k):
        with httpx.Client(base_url=url, timeout=600) as http:
            for i in range(requests):
                q = QUESTIONS[(k + i) % len(QUESTIONS)]
                t = time.perf_counter()
                r = chat(http, [{"role": "user", "content": q}], max_tokens)
                latencies.append(time.perf_counter() - t)
                tokens.append(r["usage"]["completion_tokens"])
                if r["choices"][0]["message"]["content"] != alone[q]:
                    wrong.append(q)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"requests": len(latencies), "wrong": len(wrong), "wall_s": round(wall, 2),
            "p50_s": round(statistics.median(latencies), 3), "p99_s": round(p99, 3),
            "tok_s": round(sum(tokens) / wall, 1)}


def turns(url, max_tokens: int) -> dict:
    one = [{"role": "user", "content": "What is the capital of France?"}]
    with httpx.Client(base_url=url, timeout=600) as http:
        chat(http, [{"role": "user", "content": "Warm up."}], 4, stream=True)
        first = chat(http, one, max_tokens, stream=True)
        two = one + [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "And of Germany?"}]
        second = chat(http, two, max_tokens, stream=True)
        chat(http, [{"role": "user", "content": "Something else entirely."}], 4, stream=True)
        cold = chat(http, two, max_tokens, stream=True)
    return {"turn1_ttft_ms": round(first["ttft_s"] * 1e3, 1),
            "turn1_prompt_tokens": first["usage"]["prompt_tokens"],
            "turn2_ttft_ms": round(second["ttft_s"] * 1e3, 1),
            "turn2_prompt_tokens": second["usage"]["prompt_tokens"],
            "turn2_cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"],
            "turn2_uncached_ttft_ms": round(cold["ttft_s"] * 1e3, 1),
            "turn2_uncached_cached_tokens":
                cold["usage"]["prompt_tokens_details"]["cached_tokens"],
            "same_reply": cold["text"] == second["text"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    port = free_port()
    edgellm = Path(sys.executable).parent / "edgellm"
    server = subprocess.Popen([str(edgellm), "serve", a.out, "--port", str(port),
                               "--queue", str(a.clients)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        result = {"load": load(url, a.clients, a.requests, a.max_tokens),
                  "turns": turns(url, a.max_tokens)}
    finally:
        server.terminate()
        server.wait()
    ld, tn = result["load"], result["turns"]
    print(f"load: {ld['requests']} requests from {a.clients} clients, {ld['wrong']} mixed; "
          f"p50 {ld['p50_s']} s, p99 {ld['p99_s']} s, {ld['tok_s']} tok/s")
    print(f"turns: TTFT turn 1 {tn['turn1_ttft_ms']} ms ({tn['turn1_prompt_tokens']} tokens), "
          f"turn 2 {tn['turn2_ttft_ms']} ms ({tn['turn2_prompt_tokens']} tokens, "
          f"{tn['turn2_cached_tokens']} cached), turn 2 uncached {tn['turn2_uncached_ttft_ms']} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
