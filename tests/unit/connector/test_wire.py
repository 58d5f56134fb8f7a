import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.wire import (
    PROTOCOL_VERSION,
    GroupGeometry,
    PullItem,
    PullReply,
    PullRequest,
    WireError,
    decode_pull,
    decode_reply,
    encode,
)


def make_pull(**kw) -> PullRequest:
    base = dict(
        version=PROTOCOL_VERSION,
        msg_id=7,
        decoder_engine_id="dec-1",
        decoder_session="127.0.0.1:15001",
        groups=[
            GroupGeometry("sliding:64", 32, [4096, 8192], 512, 512, 100),
            GroupGeometry("full", 32, [4096, 8192], 512, 512, 100),
        ],
        deadline_ms=1_900_000_000_000,
        items=[PullItem("t-1", "s3cret", [[0, 4, 5], [3, 4, 5]]), PullItem("t-2", "x", [[], []])],
    )
    base.update(kw)
    return PullRequest(**base)


def test_pull_round_trip():
    msg = make_pull()
    assert decode_pull(encode(msg)) == msg
    assert [i.is_release for i in msg.items] == [False, True]


def test_reply_round_trip():
    reply = PullReply(7, "t-1", ok=True, num_bytes=1024, num_segments=2)
    assert decode_reply(encode(reply)) == reply


def test_reply_is_not_a_pull():
    with pytest.raises(WireError, match="expected a pull request"):
        decode_pull(encode(PullReply(1, "t", ok=True)))
    with pytest.raises(WireError, match="expected a pull reply"):
        decode_reply(encode(make_pull()))


def test_wrong_version_refused():
    with pytest.raises(WireError, match="protocol version 99"):
        decode_pull(encode(make_pull(version=99)))


def test_wrong_field_types_refused():
    raw = msgspec.msgpack.encode({"type": "pull", "version": 1, "msg_id": "x"})
    with pytest.raises(WireError):
        decode_pull(raw)
    raw = msgspec.msgpack.encode(
        {**msgspec.to_builtins(make_pull()), "items": [{"transfer_id": 3}]}
    )
    with pytest.raises(WireError):
        decode_pull(raw)


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_garbage_only_raises_wire_error(data):
    with contextlib.suppress(WireError):
        decode_pull(data)


def test_every_list_and_string_is_bounded():
    """A hostile peer cannot make the decoder allocate without limit: caps refuse the message."""
    from connector.wire import MAX_BLOCKS, MAX_ID_LEN, MAX_ITEMS

    too_many_items = make_pull(items=[PullItem("t", "k", [[1]])] * (MAX_ITEMS + 1))
    too_many_blocks = make_pull(items=[PullItem("t", "k", [[1] * (MAX_BLOCKS + 1)])])
    long_id = make_pull(items=[PullItem("t" * (MAX_ID_LEN + 1), "k", [[1]])])
    negative = make_pull(items=[PullItem("t", "k", [[-5]])])
    for msg in (too_many_items, too_many_blocks, long_id, negative):
        with pytest.raises(WireError):
            decode_pull(encode(msg))


def test_compat_mismatch_names_each_field():
    from connector.wire import Compat

    a = Compat(PROTOCOL_VERSION, "m", "bfloat16", "auto", 2, 2, 32)
    assert a.mismatch(a) == ""
    b = Compat(PROTOCOL_VERSION, "other", "float16", "auto", 2, 2, 32)
    msg = a.mismatch(b)
    assert "model 'm' here vs 'other'" in msg and "dtype" in msg and "head_size" not in msg
    assert "no compatibility fingerprint" in a.mismatch(None)
    with_compat = make_pull(compat=a, want_digest=True)
    assert decode_pull(encode(with_compat)) == with_compat


def test_decoder_tp_fields_are_bounded():
    msg = make_pull(tp_size=4, tp_rank=3)
    assert decode_pull(encode(msg)) == msg
    for bad in ({"tp_size": 0}, {"tp_rank": -1}, {"tp_size": 1 << 20}):
        raw = msgspec.msgpack.encode({**msgspec.to_builtins(make_pull()), **bad})
        with pytest.raises(WireError):
            decode_pull(raw)
