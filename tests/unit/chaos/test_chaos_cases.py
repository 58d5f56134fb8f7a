"""How a soak request ended, from the bytes the proxy sent: complete, clean error, broken."""

import json

from scripts.chaos.cases import (
    CHAT,
    COMPLETIONS,
    StreamResult,
    classify_json,
    error_message,
    make_cases,
    poison_400,
)
from scripts.loadgen.sse import SseDecoder


def test_case_pool_is_seeded_mixed_and_greedy():
    a = make_cases(7, vocab=500, n=10)
    assert a == make_cases(7, vocab=500, n=10) and a != make_cases(8, vocab=500, n=10)
    assert {c.path for c in a} == {COMPLETIONS, CHAT}
    for c in a:
        assert c.body["temperature"] == 0 and c.body["return_token_ids"]
        assert 4 <= c.body["max_tokens"] <= 48
        if c.path == COMPLETIONS:
            assert all(3 <= t < 500 for t in c.body["prompt"])
    body = a[0].request("m", True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in a[0].request("m", False)


def test_poison_bodies():
    assert poison_400(500, 0)[1]["max_tokens"] > 1024
    assert poison_400(500, 1)[1]["temperature"] < 0


def test_classify_non_streamed():
    ok = {"choices": [{"text": "x", "finish_reason": "length", "token_ids": [1]}]}
    assert classify_json(200, json.dumps(ok))[0] == "ok"
    unfinished = {"choices": [{"text": "x", "finish_reason": None}]}
    assert classify_json(200, json.dumps(unfinished))[0] == "broken"
    err = {"error": {"message": "no decode instance", "type": "x", "code": 503}}
    outcome, text, _ = classify_json(503, json.dumps(err))
    assert outcome == "error" and "no decode instance" in text
    assert classify_json(502, "<html>bad gateway</html>")[0] == "broken"
    assert classify_json(500, json.dumps({"detail": "x"}))[0] == "broken"
    assert error_message({"error": "flat string"}) is None


def feed(raw: bytes) -> StreamResult:
    dec, sr = SseDecoder(), StreamResult()
    for data in dec.feed(raw) + dec.flush():
        sr.feed(data)
    return sr


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_stream_complete_with_ids_and_text():
    raw = (
        event({"choices": [{"text": "a", "token_ids": [5], "finish_reason": None}]})
        + event({"choices": [{"text": "b", "token_ids": [6], "finish_reason": "length"}]})
        + event({"choices": [], "usage": {"completion_tokens": 2}})
        + b"data: [DONE]\n\n"
    )
    sr = feed(raw)
    assert sr.outcome() == ("ok", "") and sr.ids == [5, 6] and sr.text == "ab"


def test_chat_stream_text_from_deltas():
    raw = (
        event({"choices": [{"delta": {"content": "h"}, "finish_reason": None}]})
        + event({"choices": [{"delta": {"content": "i"}, "finish_reason": "stop"}]})
        + b"data: [DONE]\n\n"
    )
    sr = feed(raw)
    assert sr.outcome()[0] == "ok" and sr.text == "hi" and sr.ids is None


def test_stream_error_event_then_done_is_clean():
    raw = (
        event({"choices": [{"text": "a", "finish_reason": None}]})
        + event({"error": {"message": "decode instance broke the stream", "code": 502}})
        + b"data: [DONE]\n\n"
    )
    outcome, text = feed(raw).outcome()
    assert outcome == "error" and "broke the stream" in text


def test_truncated_or_malformed_streams_are_broken():
    cut = event({"choices": [{"text": "a", "finish_reason": None}]})
    assert feed(cut).outcome()[0] == "broken"
    no_done = event({"error": {"message": "x"}})
    assert feed(no_done).outcome()[0] == "broken"
    assert feed(b"data: {not json\n\ndata: [DONE]\n\n").outcome()[0] == "broken"
    assert feed(event({"error": "flat"}) + b"data: [DONE]\n\n").outcome()[0] == "broken"
