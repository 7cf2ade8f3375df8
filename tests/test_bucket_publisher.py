"""``fixtures.buckets.Publisher``, the suite's trainer on the bucket path, driven by a receiver written here
with raw ZMQ (no loader under test): what it must do whatever order ZMQ delivers in."""
import msgpack
import zmq

from fixtures import buckets as B
from fixtures import models as M
from wire import protocol

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("norm.bias", "float16", (4,)))
TIMEOUT_MS = 5000


def _ask(sock, message: dict) -> dict:
    sock.send(msgpack.packb(message, use_bin_type=True))
    assert sock.poll(TIMEOUT_MS), f"no answer to {message['type']} within {TIMEOUT_MS} ms"
    return msgpack.unpackb(sock.recv(), raw=False)


def _receive_until_end(sock, version: int) -> dict:
    """hello, then an ack per bucket manifest; the end message."""
    message = _ask(sock, protocol.hello(version))
    while message["type"] == "bucket":
        message = _ask(sock, protocol.ack(version, message["bucket"]))
    assert message["type"] == "end", message
    return message


def test_a_hello_that_overtakes_the_previous_done_is_served():
    """Each update is a connection of its own (a REQ socket), and ZMQ orders no connection's messages before
    another's: update 2's hello can reach the trainer before update 1's done (seen in CI: the reference's
    third update of BKT-REPEAT timed out waiting for bucket 0). The trainer serves update 2 all the same, and
    records the late done."""
    states = [(v, M.state(SPEC, version=v)) for v in (1, 2)]
    pub = B.Publisher(256, wait_s=5.0)
    ctx = zmq.Context.instance()
    first, second = ctx.socket(zmq.REQ), ctx.socket(zmq.REQ)
    try:
        pub.serve(*(B.pack(state, v, 256) for v, state in states))
        first.connect(pub.endpoint)
        end = _receive_until_end(first, 1)
        second.connect(pub.endpoint)
        second.send(msgpack.packb(protocol.hello(2), use_bin_type=True))
        for _ in range(500):  # the trainer took update 2's hello while it awaited update 1's done
            if len(pub.replies("hello")) == 2:
                break
            second.poll(10)
        assert len(pub.replies("hello")) == 2, pub.replies()
        first.send(msgpack.packb(protocol.done(1, end["count"]), use_bin_type=True))
        assert second.poll(TIMEOUT_MS), f"update 2 was never served: the trainer received {pub.replies()}"
        message = msgpack.unpackb(second.recv(), raw=False)
        assert message["type"] == "bucket" and message["version"] == 2, message
        while message["type"] == "bucket":
            message = _ask(second, protocol.ack(2, message["bucket"]))
        assert message["type"] == "end" and message["version"] == 2, message
        second.send(msgpack.packb(protocol.done(2, message["count"]), use_bin_type=True))
        pub.wait(5.0)
        assert [m["version"] for m in pub.replies("hello")] == [1, 2], pub.replies()
    finally:
        first.close(linger=0)
        second.close(linger=0)
        pub.close()
