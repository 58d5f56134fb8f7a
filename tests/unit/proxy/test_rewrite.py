import json

import pytest

from proxy.rewrite import decode_body, prefill_body, validate_body

KV_REQ = {"do_remote_decode": True, "do_remote_prefill": False}


def test_completions_prefill_leg():
    body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 50,
        "min_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n"],
        "stop_token_ids": [5],
        "logprobs": 3,
        "echo": True,
        "n": 2,
        "best_of": 3,
        "temperature": 0.7,
        "seed": 1,
    }
    out = prefill_body(body, "completions")
    assert out == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "min_tokens": 1,
        "n": 1,
        "stream": False,
        "temperature": 0.7,
        "seed": 1,
        "kv_transfer_params": KV_REQ,
    }
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is untouched


def test_chat_prefill_leg_keeps_prompt_shaping_fields():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 30,
        "max_tokens": 30,
        "tools": tools,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"x": 1},
    }
    out = prefill_body(body, "chat")
    assert out["max_completion_tokens"] == 1
    assert "max_tokens" not in out
    assert out["tools"] == tools and out["chat_template_kwargs"] == {"x": 1}
    for dropped in ("logprobs", "top_logprobs", "response_format"):
        assert dropped not in out
    assert out["stream"] is False and out["kv_transfer_params"] == KV_REQ


def test_chat_without_limits_gets_max_tokens():
    out = prefill_body({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat")
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out


def test_decode_leg_is_the_original_plus_handle():
    body = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True, "stop": ["x"]}
    kv = {"do_remote_prefill": True, "transfer_id": "t"}
    out = decode_body(body, kv)
    assert out == {**body, "kv_transfer_params": kv}


def test_client_supplied_kv_params_never_reach_the_decoder():
    body = {"model": "m", "prompt": "p", "kv_transfer_params": {"remote_host": "evil"}}
    assert "kv_transfer_params" not in decode_body(body, None)
    assert prefill_body(body, "completions")["kv_transfer_params"] == KV_REQ


@pytest.mark.parametrize(
    ("body", "endpoint", "reason"),
    [
        ([], "completions", "JSON object"),
        ({"model": "m"}, "completions", "'prompt' is required"),
        ({"model": "m", "messages": []}, "chat", "non-empty list"),
        ({"model": "m", "messages": "hi"}, "chat", "non-empty list"),
        (
            {"model": "m", "prompt": "x", "stream": "yes"},
            "completions",
            "'stream' must be a boolean",
        ),
    ],
)
def test_validation(body, endpoint, reason):
    assert reason in validate_body(body, endpoint)


def test_valid_bodies():
    assert validate_body({"prompt": [1, 2]}, "completions") is None
    assert validate_body({"messages": [{"role": "user", "content": "x"}]}, "chat") is None


# -- protocol fidelity: n > 1, echo, logprobs, best_of ---------------------------------

from proxy.rewrite import check_fidelity, estimate_prompt_tokens, prefix_key  # noqa: E402


@pytest.mark.parametrize(
    ("body", "endpoint", "expected"),
    [
        ({"prompt": "x", "n": 2}, "completions", (None, "n")),
        ({"prompt": "x", "n": 1}, "completions", (None, None)),
        ({"prompt": "x", "echo": True}, "completions", (None, None)),
        ({"prompt": "x", "logprobs": 2}, "completions", (None, None)),
        ({"prompt": "x", "echo": True, "logprobs": 0}, "completions", (None, "prompt_logprobs")),
        ({"prompt": "x", "prompt_logprobs": 1}, "completions", (None, "prompt_logprobs")),
        ({"messages": [{}], "logprobs": True, "top_logprobs": 2}, "chat", (None, None)),
        ({"prompt": "x", "best_of": 1}, "completions", (None, None)),
    ],
)
def test_fidelity_routes(body, endpoint, expected):
    assert check_fidelity(body, endpoint) == expected


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "best_of": "2"}, "best_of"),
        ({"prompt": "x", "n": 0}, "'n'"),
        ({"prompt": "x", "n": True}, "'n'"),
    ],
)
def test_fidelity_clear_400(body, needle):
    reason, _ = check_fidelity(body, "completions")
    assert reason and needle in reason


def test_prompt_estimate_and_prefix_key():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}, "completions") == 3
    assert estimate_prompt_tokens({"prompt": "a" * 400}, "completions") == 100
    chat = {
        "messages": [{"role": "system", "content": "s" * 40}, {"content": [{"text": "t" * 40}]}]
    }
    assert estimate_prompt_tokens(chat, "chat") == 20
    assert prefix_key({"prompt": "abcdef"}, "completions", 3) == b"abc"
    assert prefix_key({"prompt": [1, 2, 3]}, "completions", 2) == b"1,2"
    assert prefix_key(chat, "chat", 1000).startswith(b"s" * 40)


# -- client-supplied transfer fields (issue 10, item 2) ----------------------------------

from proxy.rewrite import (  # noqa: E402
    TRANSFER_FIELDS,
    PlanOptions,
    plan_request,
    strip_transfer_fields,
    with_kv,
)

EVIL = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "transfer_secret": "stolen"}


def smuggling_body(**extra) -> dict:
    return {
        "model": "m",
        "prompt": "p",
        "kv_transfer_params": EVIL,
        "ec_transfer_params": EVIL,
        "vllm_xargs": {
            "kv_transfer_params": json.dumps(EVIL),  # vLLM accepts a string value here
            "ec_transfer_params": "x",
            "keep": "me",
        },
        **extra,
    }


def test_transfer_fields_are_stripped_everywhere_vllm_reads_them():
    body = smuggling_body()
    out = strip_transfer_fields(body)
    assert out == {"model": "m", "prompt": "p", "vllm_xargs": {"keep": "me"}}
    assert body["vllm_xargs"]["kv_transfer_params"]  # the client's body is untouched
    only = {"prompt": "p", "vllm_xargs": {"kv_transfer_params": "x"}}
    assert strip_transfer_fields(only) == {"prompt": "p"}  # nothing left: vllm_xargs goes
    assert set(TRANSFER_FIELDS) == {"kv_transfer_params", "ec_transfer_params"}


def test_both_legs_drop_smuggled_fields():
    body = smuggling_body()
    pre = prefill_body(body, "completions")
    assert pre["kv_transfer_params"] == KV_REQ and "ec_transfer_params" not in pre
    assert pre["vllm_xargs"] == {"keep": "me"}
    for kv in (None, {"transfer_id": "t"}):
        dec = decode_body(body, kv)
        assert dec.get("kv_transfer_params") == kv and "ec_transfer_params" not in dec
        assert dec["vllm_xargs"] == {"keep": "me"}


@pytest.mark.parametrize("xargs", ['{"kv_transfer_params": {}}', 3, ["kv_transfer_params"]])
def test_vllm_xargs_must_be_an_object(xargs):
    assert "vllm_xargs" in validate_body({"prompt": "p", "vllm_xargs": xargs}, "completions")


def loads(data: bytes | None) -> dict:
    assert data is not None
    return json.loads(data)


@pytest.mark.parametrize(
    ("extra", "opts", "alone"),
    [
        ({}, PlanOptions(), None),
        ({"n": 2}, PlanOptions(), "n"),
        ({"prompt_logprobs": 1}, PlanOptions(), "prompt_logprobs"),
        ({}, PlanOptions(min_prefill_tokens=100), "short_prompt"),
    ],
)
def test_plan_strips_transfer_fields_on_every_path(extra, opts, alone):
    plan = plan_request(json.dumps(smuggling_body(**extra)).encode(), "completions", opts)
    assert plan.error is None and plan.alone == alone
    dec = loads(plan.decode)
    assert "kv_transfer_params" not in dec and "ec_transfer_params" not in dec
    assert dec["vllm_xargs"] == {"keep": "me"}
    if alone is None:
        assert loads(plan.prefill)["kv_transfer_params"] == KV_REQ
    else:
        assert plan.prefill is None
    kv = {"transfer_id": "t", "transfer_secret": "s"}
    assert json.loads(with_kv(plan.decode, kv)) == {**dec, "kv_transfer_params": kv}


def test_plan_fields_and_errors():
    raw = json.dumps({"model": "m", "prompt": [1, 2, 3], "stream": True}).encode()
    plan = plan_request(raw, "completions", PlanOptions(prefix_chars=2))
    assert (plan.tokens, plan.key, plan.stream) == (3, b"1,2", True)
    assert plan_request(b"{no", "completions", PlanOptions()).error.startswith("request body is")
    assert "nested too deeply" in plan_request(b"[" * 100_000, "chat", PlanOptions()).error
    deep = b'{"prompt": "p", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "nested too deeply" in plan_request(deep, "completions", PlanOptions()).error
    assert plan_request(b"\xff\xfe", "completions", PlanOptions()).error
    assert (
        "best_of"
        in plan_request(b'{"prompt": "p", "best_of": 2}', "completions", PlanOptions()).error
    )


def test_with_kv_needs_no_reparse():
    assert with_kv(b"{}", {"a": 1}) == b'{"kv_transfer_params":{"a": 1}}'
    assert json.loads(with_kv(b'{"x": 1}', {"a": 1})) == {"x": 1, "kv_transfer_params": {"a": 1}}
    assert with_kv(b'{"x": 1}', None) == b'{"x": 1}'
