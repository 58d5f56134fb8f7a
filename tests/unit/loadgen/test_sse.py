"""SSE decoding and token timing from chunks, on hand-made byte streams."""

from __future__ import annotations

import json

import pytest

from scripts.loadgen.sse import SseDecoder, StreamTimer


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_decoder_handles_split_chunks_comments_crlf_and_utf8() -> None:
    d = SseDecoder()
    payload = 'data: {"choices": [{"text": "é"}]}\r\n\r\n'.encode()
    cut = payload.index("é".encode()) + 1  # split inside the two-byte character
    out = d.feed(b": ping\n\n") + d.feed(payload[:cut]) + d.feed(payload[cut:])
    out += d.feed(b"event: x\ndata: a\ndata: b\n\n")
    assert out == ['{"choices": [{"text": "é"}]}', "a\nb"]


def test_decoder_flush_keeps_an_unterminated_last_event() -> None:
    d = SseDecoder()
    assert d.feed(b"data: [DONE]") == []
    assert d.flush() == ["[DONE]"]


def test_timer_follows_vllm_rules() -> None:
    t = StreamTimer(start=10.0)
    t.on_data(10.5, json.dumps({"choices": [{"text": "a"}]}))
    t.on_data(10.6, json.dumps({"choices": [{"text": "b"}]}))
    t.on_data(10.9, json.dumps({"choices": [{"text": "c", "finish_reason": "length"}]}))
    # The usage-only chunk and [DONE] carry no token: they do not move E2EL.
    t.on_data(
        11.5, json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    )
    t.on_data(11.6, "[DONE]")
    assert t.ttft == pytest.approx(0.5)
    assert t.itl == pytest.approx([0.1, 0.3])
    assert t.e2el == pytest.approx(0.9)
    assert t.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert t.text == "abc"
    assert t.done and t.error is None


def test_timer_chat_role_chunk_counts_as_first_chunk_like_vllm() -> None:
    t = StreamTimer(start=0.0)
    t.on_data(0.2, json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    t.on_data(0.25, json.dumps({"choices": [{"delta": {"content": "hi"}}]}))
    assert t.ttft == pytest.approx(0.2)
    assert t.itl == pytest.approx([0.05])
    assert t.text == "hi"


def test_timer_records_errors_in_stream() -> None:
    t = StreamTimer(start=0.0)
    t.on_data(0.1, json.dumps({"error": {"message": "engine died", "code": 500}}))
    assert t.error == "engine died"
    bad = StreamTimer(start=0.0)
    bad.on_data(0.1, "{not json")
    assert bad.error is not None and "invalid JSON" in bad.error
    assert bad.ttft is None and bad.e2el is None
