"""Pure request rewriting: the prefill leg's body and the decode leg's body.

The prefill leg must end as FINISHED_LENGTH_CAPPED after exactly one token, or the
prefiller does not hand its KV over; so everything that could end it earlier, ask for
more work, or change its shape is removed. The decode leg is the client's request
untouched, plus the ``kv_transfer_params`` the prefiller returned.
"""

from __future__ import annotations

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
