"""Wire format of the CheckpointTransfer stand-in: what ``sim.checkpoint_transfer`` (the receiver's
library) and ``sim.stream_trainer`` (the trainer) must agree on. Pure: no sockets, no threads.

One ZMQ connection per library handle: the handle's DEALER socket connects to the trainer's ROUTER.
Every receiver message is a request for exactly one reply, except ``bye`` and ``unregister`` (no reply),
so the trainer never sends an item the library did not ask for: the library's pace (and so the
receiver's prefetch window) is what the trainer sees.

    receiver -> trainer                         trainer -> receiver
    register   {handle, config}                 registered {handle} | refused {message}
    hello      {handle, stream, mode, step_id,  the stream's first reply
                verify_checksum, rank}
    next       {handle, stream}                 item {stream, index, name, dtype, shape, data, crc32}
                                                | end {stream, count}
                                                | fail {stream, message}    (the library raises ConnectionError)
                                                | cancel {stream, message}  (the library raises CancelledError)
                                                | hang {stream}             (the library blocks, its timeouts off)
    bye        {handle, stream, received, reason}   the receiver stopped before ``end``
    unregister {handle}                              ``cleanup()``

Every message is one msgpack map (``use_bin_type``) in the first frame of a ZMQ message; extension types
and anything not a map with a known ``type`` are refused, so a pickle on the wire is an error, never code.
An ``item``'s tensor bytes (C order, host byte order, ``nbytes`` of them, with their zlib CRC-32 in
``crc32``) follow as a second, raw frame, so that neither end copies them through msgpack.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import msgpack

from weightsync.wire.protocol import unpack_map

PROTO = 1
MAX_FRAME = 1 << 31  # one tensor per frame; the limit only guards against a confused peer

# dtype name -> itemsize: the dtypes an item may carry (Paddle's names)
DTYPES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# receiver -> trainer
REGISTER, HELLO, NEXT, BYE, UNREGISTER = "register", "hello", "next", "bye", "unregister"
RECEIVER_TYPES = (REGISTER, HELLO, NEXT, BYE, UNREGISTER)
# trainer -> receiver
REGISTERED, REFUSED, ITEM, END, FAIL, CANCEL, HANG = "registered", "refused", "item", "end", "fail", "cancel", "hang"
TRAINER_TYPES = (REGISTERED, REFUSED, ITEM, END, FAIL, CANCEL, HANG)
# hello modes: which library call opened the stream
MODES = ("stream", "weights", "download")


class WireError(ValueError):
    """A frame that is not a message of this wire format."""


def encode(message: Mapping) -> bytes:
    return msgpack.packb({"proto": PROTO, **message}, use_bin_type=True)


def decode(frame, where: str, allowed: Sequence[str]) -> dict:
    message = unpack_map(frame, where, limit=MAX_FRAME, error=WireError, noun="message")
    if message.get("type") not in allowed:
        raise WireError(f"{where}: message type {message.get('type')!r}, expected one of {list(allowed)}")
    if message.get("proto") != PROTO:
        raise WireError(f"{where}: proto {message.get('proto')!r}, expected {PROTO}")
    return message


def checksum(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def item(stream: int, index: int, name: str, dtype: str, shape: Sequence[int], data, crc32: int | None = None) -> dict:
    """The header of an item whose bytes are ``data`` (sent as the next frame); ``crc32`` if already known."""
    return {"type": ITEM, "stream": stream, "index": index, "name": name, "dtype": dtype, "shape": list(shape),
            "nbytes": len(data), "crc32": checksum(data) if crc32 is None else crc32}


def check_item(message: dict, data, where: str) -> None:
    """Fields present and consistent: a known dtype, a non-negative shape, ``data`` (the item's second
    frame, or None when it had none) of shape x itemsize bytes."""
    name, dtype, shape = (message.get(k) for k in ("name", "dtype", "shape"))
    if not isinstance(name, str) or not name:
        raise WireError(f"{where}: item name {name!r}")
    if dtype not in DTYPES:
        raise WireError(f"{where}: item {name!r} dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise WireError(f"{where}: item {name!r} shape {shape!r}")
    want = DTYPES[dtype]
    for d in shape:
        want *= d
    got = None if data is None else len(data)
    if got != want or message.get("nbytes") != want:
        raise WireError(f"{where}: item {name!r} carries {got} bytes (nbytes {message.get('nbytes')!r}), "
                        f"{dtype}{shape} needs {want}")
