"""A stand-in LLM judge: an OpenAI-compatible `/v1/chat/completions` server that scores by a rule,
not a model. It reads the prompts `posttrain.tasks.Judge` sends and answers in the format the
judge parses, so a judge job can be tried, and tested, on a laptop without a judge model. Use a
real model (`posttrain serve`, vLLM, a hosted API) for real work.

The rule: a completion's score is its similarity to the reference answer, difflib's
`SequenceMatcher(None, completion.strip(), answer).ratio()` in [0, 1] (1 only for the answer
itself); with no reference answer in the prompt, 0. Pointwise prompts get "SCORE: x", group
prompts the JSON of every completion's score.

    python recipes/judge_standin.py --port 8100     # then [judge] base_url = "http://127.0.0.1:8100/v1"

`--fail-first N` answers HTTP 503 to the first N requests (a flaky endpoint, for tests).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from difflib import SequenceMatcher
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ANSWER = re.compile(r"Reference answer: (.*?)(?:\n\n|$)", re.S)
_POINTWISE = "\n\nCompletion to score:\n"
_GROUP = re.compile(r"\n\nCompletion (\d+):\n")


def similarity(completion: str, answer: str | None) -> float:
    """The stand-in's score of one completion (see the module docstring)."""
    if answer is None:
        return 0.0
    return SequenceMatcher(None, completion.strip(), answer).ratio()


def verdict(user: str) -> str:
    """The answer to one judge prompt (its user message)."""
    found = _ANSWER.search(user)
    answer = found.group(1) if found else None
    if _POINTWISE in user:
        completion = user.split(_POINTWISE, 1)[1]
        return f"Compared with the reference.\nSCORE: {similarity(completion, answer):.6f}"
    parts = _GROUP.split(user)[1:]  # id, text, id, text, ...
    scores = [
        {"id": int(ident), "score": round(similarity(text, answer), 6)}
        for ident, text in zip(parts[::2], parts[1::2], strict=True)
    ]
    return json.dumps({"scores": scores})


class StandinJudge(ThreadingHTTPServer):
    """The server; `requests` counts the chat completions asked of it."""

    daemon_threads = True
    # socketserver's default backlog of 5 drops the 6th of a burst of connections, which the
    # client's TCP resends only after 1 s: a judge sends up to max_concurrency (8) at once.
    request_queue_size = 64

    def __init__(self, port: int = 0, *, fail_first: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.fail_first, self.requests = fail_first, 0
        self.delay_s = 0.0  # seconds before each answer (a slow endpoint, for tests)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> StandinJudge:
        """Serve on a daemon thread (tests); `shutdown()` stops it."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        assert isinstance(server, StandinJudge)
        with server.lock:
            server.requests += 1
            failing = server.requests <= server.fail_first
        time.sleep(server.delay_s)
        if failing or not self.path.endswith("/chat/completions"):
            self._send(503 if failing else 404, {"error": {"message": "unavailable"}})
            return
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        message = {"role": "assistant", "content": verdict(user)}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        self._send(200, {"object": "chat.completion", "model": body["model"], "choices": [choice]})

    def _send(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: a job's judge asks hundreds of times


def main() -> None:
    parser = argparse.ArgumentParser(description="A stand-in LLM judge that scores by a rule.")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args()
    server = StandinJudge(args.port, fail_first=args.fail_first)
    print(f"stand-in judge on {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
