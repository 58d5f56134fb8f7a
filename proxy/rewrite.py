"""Pure request rewriting: the prefill leg's body and the decode leg's body.

The prefill leg must end as FINISHED_LENGTH_CAPPED after exactly one token, or the
prefiller does not hand its KV over; so everything that could end it earlier, ask for
more work, or change its shape is removed. The decode leg is the client's request,
plus the ``kv_transfer_params`` the prefiller returned.

Transfer fields are the proxy's alone. vLLM (0.32, ``entrypoints/openai/*/protocol.py``
``to_sampling_params``) builds ``SamplingParams.extra_args`` from the client's
``vllm_xargs`` and then sets ``kv_transfer_params`` / ``ec_transfer_params`` in it from
the top-level fields when those are set; ``Request`` reads the connector's params from
``extra_args["kv_transfer_params"]``. So a client can name them at the top level or
inside ``vllm_xargs`` (whose values may be strings, numbers or lists: a string is
accepted and handed to the connector as is). :func:`strip_transfer_fields` removes both
spellings on every leg, disaggregated or decode-only.

:func:`plan_request` is the whole CPU-bound part of a request (parse, validate, rewrite,
serialise), pure so that a big body can run it in a worker process.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

Body = dict[str, Any]

# Request fields vLLM hands to a KV / encoder-cache connector (top level or in vllm_xargs).
TRANSFER_FIELDS = ("kv_transfer_params", "ec_transfer_params")

# Fields that only shape the sampled output, never the prompt's KV: the prefill leg drops
# them (stop conditions could end the one token early; the rest is wasted work).
_PREFILL_DROP = (
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "best_of",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "bad_words",
    "min_tokens",
    "ignore_eos",
)


def strip_transfer_fields(body: Body) -> Body:
    """A copy of ``body`` without any client-supplied transfer field, wherever vLLM
    would read one: top level, or a key of ``vllm_xargs`` (emptied ``vllm_xargs`` goes).
    Call after :func:`validate_body` (``vllm_xargs``, when present, is an object)."""
    out = {k: v for k, v in body.items() if k not in TRANSFER_FIELDS}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and any(k in xargs for k in TRANSFER_FIELDS):
        clean = {k: v for k, v in xargs.items() if k not in TRANSFER_FIELDS}
        if clean:
            out["vllm_xargs"] = clean
        else:
            del out["vllm_xargs"]
    return out


def prefill_body(body: Body, endpoint: str) -> Body:
    """The client's request reduced to a one-token, non-streaming prefill."""
    out = {k: v for k, v in strip_transfer_fields(body).items() if k not in _PREFILL_DROP}
    if endpoint == "chat" and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
        out.pop("max_tokens", None)
    else:
        out["max_tokens"] = 1
        out.pop("max_completion_tokens", None)
    # One token that cannot be EOS or a stop token: the request must end length-capped.
    out["min_tokens"] = 1
    out["n"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def decode_body(body: Body, kv_transfer_params: dict[str, Any] | None) -> Body:
    """The client's request, with the prefiller's KV handle when there is one.

    Client-supplied transfer fields are never forwarded: they would let a caller point
    the decoder's connector at an arbitrary host or another request's blocks.
    """
    out = strip_transfer_fields(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def validate_body(body: Any, endpoint: str) -> str | None:
    """A short reason if the body cannot be a request for ``endpoint``; None when it can."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
    elif endpoint == "completions" and "prompt" not in body:
        return "'prompt' is required"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be a boolean"
    if body.get("vllm_xargs") is not None and not isinstance(body["vllm_xargs"], dict):
        return "'vllm_xargs' must be an object"
    return None


def check_fidelity(body: Body, endpoint: str) -> tuple[str | None, str | None]:
    """(a 400 reason, or None; a reason to serve decode-only, or None).

    - ``best_of`` > 1: vLLM's V1 engine does not support it; say so plainly.
    - ``n`` > 1: each of the decoder's n sequences would try to pull the one transfer; the
      decoder serves it alone (all n, correct), counted as a fallback.
    - prompt log-probabilities (``prompt_logprobs``, or ``echo`` with ``logprobs`` on
      completions) need the prompt computed where they are reported: decoder alone.
    - ``echo`` and sampled ``logprobs`` work disaggregated (the decoder has the prompt text
      and samples every output token itself).
    """
    best_of = body.get("best_of")
    if best_of is not None:
        if not isinstance(best_of, int) or isinstance(best_of, bool) or best_of < 1:
            return "'best_of' must be a positive integer", None
        if best_of > 1:
            return "'best_of' > 1 is not supported (vLLM's V1 engine has no best_of)", None
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return "'n' must be a positive integer", None
    if n > 1:
        return None, "n"
    if body.get("prompt_logprobs") is not None:
        return None, "prompt_logprobs"
    if endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None:
        return None, "prompt_logprobs"
    return None, None


def _prompt_parts(body: Body, endpoint: str) -> list[Any]:
    if endpoint == "chat":
        parts: list[Any] = []
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                parts += [p.get("text", "") for p in c if isinstance(p, dict)]
            elif c is not None:
                parts.append(c)
        return parts
    return [body.get("prompt")]


def estimate_prompt_tokens(body: Body, endpoint: str, chars_per_token: float = 4.0) -> int:
    """An estimate (the proxy has no tokenizer): token id lists count exactly, text by
    characters. Used for load accounting and the short-prompt threshold only."""
    total = 0.0
    for p in _prompt_parts(body, endpoint):
        if isinstance(p, str):
            total += len(p) / chars_per_token
        elif isinstance(p, list):
            if p and all(isinstance(x, int) for x in p):
                total += len(p)
            else:
                for x in p:
                    if isinstance(x, str):
                        total += len(x) / chars_per_token
                    elif isinstance(x, list):
                        total += len(x)
    return max(1, math.ceil(total))


def prefix_key(body: Body, endpoint: str, chars: int) -> bytes:
    """The prompt's first ``chars`` characters (or token ids): the prefix-affinity key."""
    out: list[str] = []
    left = chars
    for p in _prompt_parts(body, endpoint):
        if left <= 0:
            break
        if isinstance(p, str):
            out.append(p[:left])
            left -= len(p)
        elif isinstance(p, list):
            if p and all(isinstance(x, int) for x in p):
                out.append(",".join(map(str, p[:left])))
                left -= len(p)
            elif p and isinstance(p[0], str):
                out.append(p[0][:left])
                left -= len(p[0])
    return "\x1f".join(out).encode("utf-8", "surrogatepass")


# -- the whole request, in one pure step ---------------------------------------------------


@dataclass(frozen=True)
class PlanOptions:
    chars_per_token: float = 4.0
    # Characters (or token ids) of the prefix-affinity key; 0: no key needed.
    prefix_chars: int = 0
    min_prefill_tokens: int = 0


@dataclass(frozen=True)
class Plan:
    """What the request path needs from a body: small, cheap to send between processes."""

    error: str | None = None  # a 400 reason; nothing else is set then
    alone: str | None = None  # decode-only, and why (n, prompt_logprobs, short_prompt)
    stream: bool = False
    tokens: int = 0
    key: bytes | None = None
    prefill: bytes | None = None  # the prefill leg's body (None when decode-only)
    decode: bytes = b""  # the decode leg's body, transfer fields stripped, no handle yet


def plan_request(raw: bytes, endpoint: str, opts: PlanOptions) -> Plan:
    """Parse, validate and rewrite one request body. Never raises for client input:
    invalid JSON, a body nested deeper than the interpreter's recursion limit, or a bad
    field is a :attr:`Plan.error`."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return Plan(error="request body is nested too deeply")
    except ValueError as exc:  # includes invalid UTF-8
        return Plan(error=f"request body is not valid JSON: {exc}")
    reason = validate_body(body, endpoint)
    alone: str | None = None
    if reason is None:
        reason, alone = check_fidelity(body, endpoint)
    if reason is not None:
        return Plan(error=reason)
    clean = strip_transfer_fields(body)
    tokens = estimate_prompt_tokens(clean, endpoint, opts.chars_per_token)
    key = prefix_key(clean, endpoint, opts.prefix_chars) if opts.prefix_chars else None
    if alone is None and opts.min_prefill_tokens and tokens < opts.min_prefill_tokens:
        alone = "short_prompt"
    try:
        p_data = None if alone else json.dumps(prefill_body(clean, endpoint)).encode()
        d_data = json.dumps(clean).encode()
    except (RecursionError, ValueError):
        return Plan(error="request body is nested too deeply")
    return Plan(None, alone, bool(clean.get("stream")), tokens, key, p_data, d_data)


def with_kv(decode: bytes, kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The decode leg's serialised body plus the prefiller's handle, without parsing or
    re-serialising the (possibly large) body: ``decode`` is a JSON object that has no
    ``kv_transfer_params`` key (:func:`plan_request` made it)."""
    if not kv_transfer_params:
        return decode
    assert decode.startswith(b"{") and decode.endswith(b"}")
    sep = b"," if decode != b"{}" else b""
    kv = json.dumps(kv_transfer_params).encode()
    return decode[:-1] + sep + b'"kv_transfer_params":' + kv + b"}"
