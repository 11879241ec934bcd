"""Fire attack shapes (``attacks.py``) at a running server all at once while greedy neighbour
streams run and a poller asks ``/health`` every 0.2 s; report what every request got.

Everything here is plain HTTP (httpx), so the same storm runs against one engine or a
data-parallel endpoint, in the test process or in a child process. The result is JSON-ready.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.adversarial_e2e.attacks import (
    ABORT_AFTER_S,
    NEIGHBOUR_MAX_TOKENS,
    NEIGHBOUR_PROMPTS,
    Attack,
    body_text,
)

HEALTH_INTERVAL_S = 0.2
#: Generous bound on one /health answer (s): a shared 2-core machine under the storm is slow
#: (speed is not what the tests measure), but a /health held behind the engine would take as
#: long as the whole storm.
HEALTH_LATENCY_BOUND_S = 5.0
#: Generous per-request limit (s): a loaded 2-core machine is slow, but nothing may hang.
REQUEST_TIMEOUT_S = 120.0
JSON = {"content-type": "application/json"}


def _headers(api_key: str | None) -> dict:
    return {**JSON, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _error(r: httpx.Response) -> dict:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return {"malformed": r.text[:300]}
    return err if isinstance(err, dict) else {"malformed": r.text[:300]}


def _sse_events(lines) -> tuple[list[dict], bool]:
    """The JSON events of an SSE stream and whether it ended with ``data: [DONE]``."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    return events, done


def send(url: str, attack: Attack, api_key: str | None = None) -> dict:
    """Send one attack on its own connection; returns ``status`` (None: the client gave up
    first, for an ``abort``), the error's ``param`` / ``type`` / ``message`` for a rejection,
    ``finish_reasons`` of a 200, and ``first_chunk`` for a ``disconnect``."""
    out: dict = {
        "name": attack.name,
        "route": attack.route,
        "mode": attack.mode,
        "expect": attack.status,
        "param_expected": attack.param,
    }
    timeout = (
        httpx.Timeout(REQUEST_TIMEOUT_S, read=ABORT_AFTER_S) if attack.mode == "abort" else REQUEST_TIMEOUT_S
    )
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=timeout) as h:
        content = body_text(attack).encode()
        if attack.mode == "disconnect":
            with h.stream("POST", attack.route, content=content) as r:
                out["status"] = r.status_code
                if r.status_code == 200:
                    # the first event, then the client goes away with the rest unread
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            out["first_chunk"] = "error" not in json.loads(line[6:])
                            break
                else:
                    r.read()
                    out.update(_rejection(r))
            return out
        try:
            r = h.post(attack.route, content=content)
        except httpx.ReadTimeout:
            out["status"] = None  # gave up: the server sees the connection close
            return out
        out["status"] = r.status_code
        if r.status_code >= 400:
            out.update(_rejection(r))
        else:
            body = r.json()
            out["num_choices"] = len(body.get("choices", []))
            out["finish_reasons"] = [c.get("finish_reason") for c in body.get("choices", [])]
            if any(c.get("prompt_logprobs") for c in body.get("choices", [])):
                out["prompt_logprob_rows"] = [len(c["prompt_logprobs"] or []) for c in body["choices"]]
    return out


def _rejection(r: httpx.Response) -> dict:
    err = _error(r)
    return {
        "param": err.get("param"),
        "type": err.get("type"),
        "message": (err.get("message") or "")[:300],
        "malformed": err.get("malformed"),
        "body_bytes": len(r.content),
    }


def judge(result: dict) -> str | None:
    """What is wrong with an attack's answer, or None: the expected status (or, for an
    ``abort``, the client giving up first or a 200), an OpenAI-style error body naming the
    expected ``param`` for a rejection, no ``error`` finish for a 200."""
    status, expect = result["status"], result["expect"]
    if status is None:
        return None if result["mode"] == "abort" else "no answer"
    if status >= 500:
        return f"5xx: {status} {result.get('message')!r}"
    if status != expect:
        return f"status {status}, expected {expect}: {result.get('message')!r}"
    if status >= 400:
        if result.get("malformed") is not None or not result.get("message") or not result.get("type"):
            return f"not an OpenAI-style error body: {result}"
        if result["param_expected"] is not None and result["param"] != result["param_expected"]:
            return f"param {result['param']!r}, expected {result['param_expected']!r}: {result['message']!r}"
    elif "error" in (result.get("finish_reasons") or []) or result.get("first_chunk") is False:
        return f"a 200 that failed: {result}"
    return None


def send_raw(url: str, route: str, body: str, api_key: str | None = None) -> dict:
    """Post JSON text (a fuzz body); the status and, for a 4xx, whether the body is an
    OpenAI-style error with a message. A 200 stream must end with ``data: [DONE]``."""
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=REQUEST_TIMEOUT_S) as h:
        r = h.post(route, content=body.encode())
    out: dict = {"route": route, "status": r.status_code, "body": body[:200]}
    if r.status_code >= 400:
        err = _error(r)
        out["error_ok"] = bool(err.get("message")) and isinstance(err.get("message"), str) and "type" in err
        out["message"] = str(err.get("message") or err.get("malformed"))[:300]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        out["stream_ok"] = r.text.rstrip().endswith("data: [DONE]") and "internal_server_error" not in r.text
    return out


def judge_raw(result: dict) -> str | None:
    """What is wrong with a fuzz body's answer, or None: never a 5xx, a 4xx is an OpenAI-style
    error with a message, a 200 stream ends cleanly."""
    if result["status"] >= 500:
        return f"5xx: {result['status']} {result.get('message')!r} for {result['body']!r}"
    if result["status"] >= 400 and not result["error_ok"]:
        return f"not an OpenAI-style error: {result.get('message')!r} for {result['body']!r}"
    if result.get("stream_ok") is False:
        return f"a stream that did not end with [DONE] for {result['body']!r}"
    return None


def stream_greedy(url: str, prompt: str, api_key: str | None = None, model: str | None = None) -> dict:
    """One greedy completion of ``prompt`` as a stream: ``text``, ``finish_reason`` and any
    ``error`` event."""
    body = {"prompt": prompt, "max_tokens": NEIGHBOUR_MAX_TOKENS, "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=REQUEST_TIMEOUT_S) as h:
        with h.stream("POST", "/v1/completions", content=json.dumps(body).encode()) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "error": r.text[:300]}
            events, done = _sse_events(r.iter_lines())
    text, reason, errors = "", None, [e["error"] for e in events if "error" in e]
    for e in events:
        for c in e.get("choices", []):
            text += c.get("text") or ""
            reason = c.get("finish_reason") or reason
    return {"status": 200, "text": text, "finish_reason": reason, "done": done, "error": errors or None}


class HealthPoller(threading.Thread):
    """GET ``/health`` every ``HEALTH_INTERVAL_S`` until stopped; records each latency (s) and
    every failure (not a 200, or no answer within 30 s)."""

    def __init__(self, url: str):
        super().__init__(daemon=True, name="health-poller")
        self.url, self.stop_event = url, threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as h:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                try:
                    r = h.get("/health")
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}: {r.text[:100]}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self.latencies.append(time.monotonic() - t0)
                self.stop_event.wait(max(0.0, HEALTH_INTERVAL_S - (time.monotonic() - t0)))

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(60)
        return {
            "polls": len(self.latencies),
            "max_latency_s": max(self.latencies, default=None),
            "failures": self.failures,
        }


class Neighbours:
    """One thread per prompt streaming it greedily, over and over, until ``stop``; every
    completed stream's output is kept with the prompt."""

    def __init__(self, url: str, prompts: list[str], api_key: str | None = None, model: str | None = None):
        self.url, self.api_key, self.model = url, api_key, model
        self.stop_event = threading.Event()
        self.runs: dict[str, list[dict]] = {p: [] for p in prompts}
        self.threads = [threading.Thread(target=self._loop, args=(p,), daemon=True) for p in prompts]

    def _loop(self, prompt: str) -> None:
        while not self.stop_event.is_set():
            try:
                self.runs[prompt].append(stream_greedy(self.url, prompt, self.api_key, self.model))
            except httpx.HTTPError as e:
                self.runs[prompt].append({"status": None, "error": f"{type(e).__name__}: {e}"})

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> dict[str, list[dict]]:
        self.stop_event.set()
        for t in self.threads:
            t.join(REQUEST_TIMEOUT_S)
        return self.runs


def solo(url: str, api_key: str | None = None, model: str | None = None) -> dict[str, dict]:
    """Each neighbour prompt's greedy stream, alone on the server."""
    return {p: stream_greedy(url, p, api_key, model) for p in NEIGHBOUR_PROMPTS}


def run_storm(
    url: str,
    attacks: list[Attack],
    raw_bodies: list[tuple[str, str]] = (),
    *,
    api_key: str | None = None,
    model: str | None = None,
    workers: int = 12,
) -> dict:
    """Start the neighbours and the health poller, fire every attack and raw body at once
    (``workers`` connections at a time), stop the neighbours and the poller when the last
    answer is in. Returns ``attacks`` (``send`` results with ``problem``), ``raw`` (the fuzz
    bodies' results with ``problem``), ``neighbours`` (prompt -> streams), ``health`` and
    ``seconds`` (the storm's wall time)."""
    poller = HealthPoller(url)
    poller.start()
    neighbours = Neighbours(url, NEIGHBOUR_PROMPTS, api_key, model)
    neighbours.start()
    t0 = time.monotonic()

    def one_attack(a: Attack) -> dict:
        start = time.monotonic()
        try:
            res = send(url, a, api_key)
            res["seconds"] = time.monotonic() - start
        except httpx.HTTPError as e:
            return {"name": a.name, "route": a.route, "status": None, "problem": f"no answer: {e!r}"}
        res["problem"] = judge(res)
        return res

    def one_raw(item: tuple[str, str]) -> dict:
        try:
            res = send_raw(url, *item, api_key)
        except httpx.HTTPError as e:
            return {"route": item[0], "status": None, "problem": f"no answer: {e!r}", "body": item[1][:200]}
        res["problem"] = judge_raw(res)
        return res

    with ThreadPoolExecutor(workers) as pool:
        attack_futs = [pool.submit(one_attack, a) for a in attacks]
        raw_futs = [pool.submit(one_raw, b) for b in raw_bodies]
        attack_results = [f.result() for f in attack_futs]
        raw_results = [f.result() for f in raw_futs]
    seconds = time.monotonic() - t0
    runs = neighbours.stop()
    health = poller.stop()
    return {
        "attacks": attack_results,
        "raw": raw_results,
        "neighbours": runs,
        "health": health,
        "seconds": seconds,
    }


def neighbour_problems(runs: dict[str, list[dict]], reference: dict[str, dict]) -> list[str]:
    """Every neighbour stream that did not give its solo output (or did not end cleanly), and
    every neighbour that completed no stream during the storm."""
    problems = []
    for prompt, got in runs.items():
        if not got:
            problems.append(f"{prompt!r}: no stream completed during the storm")
        ref = reference[prompt]
        for run in got:
            if (run.get("status"), run.get("text"), run.get("finish_reason"), run.get("error")) != (
                200,
                ref["text"],
                ref["finish_reason"],
                None,
            ) or not run.get("done"):
                problems.append(f"{prompt!r}: {run} != solo {ref}")
    return problems


def counts(storm: dict) -> dict:
    """Requests sent and answers by class over the storm (health polls apart)."""
    statuses = [r["status"] for r in storm["attacks"] + storm["raw"]]
    statuses += [run.get("status") for runs in storm["neighbours"].values() for run in runs]
    return {
        "requests": len(statuses),
        "2xx": sum(1 for s in statuses if s is not None and s < 300),
        "4xx": sum(1 for s in statuses if s is not None and 400 <= s < 500),
        "5xx": sum(1 for s in statuses if s is not None and s >= 500),
        "client_gave_up": sum(1 for s in statuses if s is None),
        "health_polls": storm["health"]["polls"],
    }
