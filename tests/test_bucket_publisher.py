"""``fixtures.buckets.Publisher``, the suite's trainer on the bucket path, driven by a receiver written here
with raw ZMQ (no loader under test): what it must do whatever order ZMQ delivers in."""
import threading

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


def _served_version(pub, version_asked: int) -> int:
    """A whole session on a new connection: the version the trainer served (its end's)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.connect(pub.endpoint)
        end = _receive_until_end(sock, version_asked)
        sock.send(msgpack.packb(protocol.done(version_asked, end["count"]), use_bin_type=True))
        return end["version"]
    finally:
        sock.close(linger=1000)


ROUNDS = 20  # two threads reading one socket lose a hello about one round in two


def test_a_version_published_while_the_last_session_awaits_its_done_is_served():
    """The receiver failed after the end (a parameter missing) and said so, and the suite published the next
    version at once (CTL-WAKEUP-RELOADS on the bucket path, a loaded CI machine): the previous serve()'s thread
    still awaited that session's error when the next hello came. Two threads reading one socket: the old one
    took the hello as the one that overtook its done and ended, and the new one waited for a hello that never
    came (the receiver's next update timed out). Each round, the next version is served within the timeout."""
    pub = B.Publisher(256, wait_s=5.0)
    ctx = zmq.Context.instance()
    try:
        for r in range(ROUNDS):
            v = 2 * r + 1
            first = ctx.socket(zmq.REQ)
            try:
                pub.serve(B.pack(M.state(SPEC, version=v), v, 256))
                first.connect(pub.endpoint)
                _receive_until_end(first, v)  # the session's error or done not sent yet
                pub.serve(B.pack(M.state(SPEC, version=v + 1), v + 1, 256))
                assert _served_version(pub, v + 1) == v + 1, f"round {r}"
                first.send(msgpack.packb(protocol.error(v, 1, "RuntimeError: a parameter missing"), use_bin_type=True))
            finally:
                first.close(linger=0)
        pub.wait(5.0)
    finally:
        pub.close()


def test_a_version_never_asked_for_is_replaced_by_the_next():
    """serve() again before any receiver came: the next session gets the newer version, never the one it
    replaced, and the replaced call's thread ends without a failure for wait() to raise."""
    pub = B.Publisher(256, wait_s=5.0)
    try:
        for r in range(ROUNDS):
            v = 2 * r + 1
            pub.serve(B.pack(M.state(SPEC, version=v), v, 256))
            pub.serve(B.pack(M.state(SPEC, version=v + 1), v + 1, 256))
            assert _served_version(pub, v + 1) == v + 1, f"round {r}: the replaced version {v} was served"
        pub.wait(5.0)
        assert [m["version"] for m in pub.replies("hello")] == [2 * r + 2 for r in range(ROUNDS)]
    finally:
        pub.close()


def test_serve_waits_for_a_session_in_progress():
    """A session inside its buckets (here held before bucket 1) is finished before a newer serve() takes the
    socket: the held session ends on its own version, and the next one gets the newer version."""
    spec = M.spec(("a", "float32", (64,)), ("b", "float32", (64,)))  # 256 bytes each: two buckets
    pub = B.Publisher(256, wait_s=5.0)
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        pub.serve(B.pack(M.state(spec, version=1), 1, 256), hold_before=1)
        sock.connect(pub.endpoint)
        message = _ask(sock, protocol.hello(1))
        assert message["type"] == "bucket" and message["bucket"] == 0, message
        sock.send(msgpack.packb(protocol.ack(1, 0), use_bin_type=True))
        assert pub.holding.wait(5.0), "the trainer never reached its hold before bucket 1"
        replaced = threading.Thread(target=pub.serve, args=(B.pack(M.state(spec, version=2), 2, 256),), daemon=True)
        replaced.start()
        replaced.join(0.3)
        assert replaced.is_alive(), "serve() returned while the previous session was held inside its buckets"
        pub.release.set()
        assert sock.poll(TIMEOUT_MS), "the held session's bucket 1 never came after the release"
        message = msgpack.unpackb(sock.recv(), raw=False)
        assert (message["type"], message["bucket"], message["version"]) == ("bucket", 1, 1), message
        message = _ask(sock, protocol.ack(1, 1))
        assert message["type"] == "end" and message["version"] == 1, message
        sock.send(msgpack.packb(protocol.done(1, message["count"]), use_bin_type=True))
        replaced.join(5.0)
        assert not replaced.is_alive(), "serve() still blocked after the previous session ended"
        assert _served_version(pub, 2) == 2
        pub.wait(5.0)
    finally:
        sock.close(linger=0)
        pub.close()
