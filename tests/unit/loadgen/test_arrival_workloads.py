"""Arrival levels and gaps; token-exact workloads with the real local tokenizer."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from scripts.loadgen import workloads as wl
from scripts.loadgen.arrival import (
    CONCURRENCY,
    CONSTANT,
    POISSON,
    RATE,
    Level,
    arrival_gaps,
    parse_levels,
)
from scripts.pdlab import DEFAULT_MODEL


def test_parse_levels_single_sweep_and_errors() -> None:
    assert parse_levels(None, "4") == [Level(CONCURRENCY, 4)]
    sweep = parse_levels("1,2.5,inf", None, CONSTANT, max_concurrency=8)
    assert [lv.value for lv in sweep] == [1, 2.5, math.inf]
    assert sweep[1].label == "rate=2.5/s,max_conc=8"
    assert Level.from_json(sweep[2].to_json()) == sweep[2]
    for bad in ((None, None), ("1", "2"), (None, "1.5"), ("0", None), ("-1", None)):
        with pytest.raises(ValueError):
            parse_levels(*bad)


def test_arrival_gaps() -> None:
    assert arrival_gaps(3, 4.0, CONSTANT, random.Random(0)) == [0.0, 0.25, 0.25]
    assert arrival_gaps(3, math.inf, POISSON, random.Random(0)) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(20001, 5.0, POISSON, random.Random(1))
    assert gaps[0] == 0.0
    assert sum(gaps) / 20000 == pytest.approx(0.2, rel=0.03)  # mean gap 1/rate
    assert arrival_gaps(50, 5.0, POISSON, random.Random(7)) == arrival_gaps(
        50, 5.0, POISSON, random.Random(7)
    )
    assert Level(RATE, 2.0).label == "rate=2/s"


def test_parse_range() -> None:
    assert wl.parse_range("384") == (384, 384)
    assert wl.parse_range("256-512") == (256, 512)
    assert wl.parse_range("8:9") == (8, 9)
    for bad in ("0", "9-8", "x", "1-2-3"):
        with pytest.raises(ValueError):
            wl.parse_range(bad)


@pytest.fixture(scope="module")
def tok() -> wl.Tokenizer:
    if not (DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.skip("tiny model not built (scripts/setup.sh makes it)")
    return wl.load_tokenizer(DEFAULT_MODEL)


def _prompt_len(tok: wl.Tokenizer, body: dict[str, object]) -> int:
    if "messages" in body:
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])
    return len(tok(body["prompt"], add_special_tokens=True)["input_ids"])


@pytest.mark.parametrize("endpoint", [wl.COMPLETIONS, wl.CHAT])
@pytest.mark.parametrize("kind", [wl.FIXED, wl.RANDOM, wl.SHARED_PREFIX])
def test_prompts_are_token_exact(tok: wl.Tokenizer, kind: str, endpoint: str) -> None:
    spec = wl.WorkloadSpec(
        kind=kind,
        endpoint=endpoint,
        input_len=(100, 100) if kind == wl.FIXED else (40, 300),
        output_len=(8, 8) if kind == wl.FIXED else (4, 16),
        groups=3,
        prefix_len=64,
    )
    sessions, inexact = wl.build_sessions(spec, 24, tok, seed=5)
    assert inexact == 0 and len(sessions) == 24
    s = wl.Sampling(model="m")
    for sess in sessions:
        turn = sess.turns[0]
        body = wl.build_body(endpoint, turn, [], s)
        assert _prompt_len(tok, body) == turn.expected_prompt_tokens
        lo, hi = spec.input_len
        extra = 0
        if kind == wl.SHARED_PREFIX:
            assert sess.group == sess.id % 3
            extra = 64 if endpoint == wl.COMPLETIONS else 64 + 20  # + template of system+user
        assert lo <= turn.expected_prompt_tokens - extra <= hi + 20
        assert spec.output_len[0] <= turn.max_tokens <= spec.output_len[1]
    if kind == wl.FIXED:
        assert {sess.turns[0].expected_prompt_tokens for sess in sessions} == {100}


def test_shared_prefix_groups_share_the_same_head(tok: wl.Tokenizer) -> None:
    spec = wl.WorkloadSpec(kind=wl.SHARED_PREFIX, input_len=(20, 30), groups=2, prefix_len=64)
    sessions, _ = wl.build_sessions(spec, 6, tok, seed=1)
    heads = {s.group: s.turns[0].system for s in sessions}
    assert len(set(heads.values())) == 2
    for s in sessions:
        assert s.turns[0].system == heads[s.group]
        assert len(tok(s.turns[0].system)["input_ids"]) == 64


def test_same_seed_same_prompts_different_seed_different(tok: wl.Tokenizer) -> None:
    spec = wl.WorkloadSpec(kind=wl.RANDOM, input_len=(30, 60))
    a, _ = wl.build_sessions(spec, 5, tok, seed=3)
    b, _ = wl.build_sessions(spec, 5, tok, seed=3)
    c, _ = wl.build_sessions(spec, 5, tok, seed=4)
    assert [s.turns[0].user for s in a] == [s.turns[0].user for s in b]
    assert [s.turns[0].user for s in a] != [s.turns[0].user for s in c]


def test_multi_turn_sessions_and_history_bodies(tok: wl.Tokenizer) -> None:
    spec = wl.WorkloadSpec(kind=wl.MULTI_TURN, endpoint=wl.CHAT, input_len=(10, 20), turns=3)
    sessions, _ = wl.build_sessions(spec, 7, tok, seed=2)
    assert [len(s.turns) for s in sessions] == [3, 3, 1]  # exactly 7 requests
    t2 = sessions[0].turns[1]
    body = wl.build_body(wl.CHAT, t2, [("u1", "a1")], wl.Sampling("m", stream=True))
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_completion_tokens"] == t2.max_tokens
    comp = wl.build_body(wl.COMPLETIONS, wl.Turn("u2", 5), [("u1", "a1")], wl.Sampling("m"))
    assert comp["prompt"] == "u1a1u2" and comp["max_tokens"] == 5


def test_body_options() -> None:
    s = wl.Sampling("m", stream=False, temperature=None, ignore_eos=True, extra={"top_k": 1})
    body = wl.build_body(wl.COMPLETIONS, wl.Turn([1, 2, 3], 4), [], s)
    assert body == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": False,
        "top_k": 1,
    }


def test_jsonl_workload(tok: wl.Tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "hello world", "max_tokens": 5}\n\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    spec = wl.WorkloadSpec(kind=wl.JSONL, dataset=f, output_len=(9, 9))
    sessions, _ = wl.build_sessions(spec, 3, tok, seed=0)
    assert [s.turns[0].max_tokens for s in sessions] == [5, 9, 5]
    assert sessions[0].turns[0].expected_prompt_tokens == 2
    chat = wl.WorkloadSpec(kind=wl.JSONL, endpoint=wl.CHAT, dataset=f)
    cs, _ = wl.build_sessions(chat, 2, tok, seed=0)
    assert cs[1].turns[0].messages == [{"role": "user", "content": "hi"}]
    f.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="need 'prompt' or 'messages'"):
        wl.build_sessions(spec, 1, tok, seed=0)
