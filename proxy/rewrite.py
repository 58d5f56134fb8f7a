"""Pure request rewriting: the prefill leg's body and the decode leg's body.

The prefill leg must end as FINISHED_LENGTH_CAPPED after exactly one token, or the
prefiller does not hand its KV over; so everything that could end it earlier, ask for
more work, or change its shape is removed. The decode leg is the client's request
untouched, plus the ``kv_transfer_params`` the prefiller returned.
"""

from __future__ import annotations

import math
from typing import Any

Body = dict[str, Any]

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


def prefill_body(body: Body, endpoint: str) -> Body:
    """The client's request reduced to a one-token, non-streaming prefill."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
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

    A client-supplied ``kv_transfer_params`` is never forwarded: it would let a caller
    point the decoder at an arbitrary host.
    """
    out = dict(body)
    out.pop("kv_transfer_params", None)
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
