"""The push handler alone: every claimed request ends, whatever happens inside."""


def test_unexpected_push_error_still_ends_the_request():
    """A bug or surprise inside the push must not strand the claimed request's blocks."""
    from connector.layout import GroupLayout, geometry
    from connector.plan import RegionLayout
    from connector.recorder import TransferRecorder
    from connector.send_registry import SendRegistry
    from connector.sender import PushHandler
    from connector.wire import PROTOCOL_VERSION, PullItem, PullRequest

    group = GroupLayout("full", 32, RegionLayout((4096,), 64, 64, 10))
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1, 2]], "k")

    def broken_write(*args):
        raise RuntimeError("engine exploded")

    handler = PushHandler(reg, (group,), broken_write, 1.0, 100, TransferRecorder())
    req = PullRequest(
        PROTOCOL_VERSION, 1, "d", "h:1", [geometry(group)], 2**62, [PullItem("t", "k", [[3, 4]])]
    )
    (reply,) = handler.serve(req)
    assert not reply.ok and "engine exploded" in reply.error
    assert reg.take_finished() == {"t"}
