"""conformance/holds.py's lease hold (LIFE-CONCURRENT): what it stops, what it sees, and that it never hangs.

An ``open()`` of the leased file blocks until the hold is let go, and the hold counts the threads blocked there
(a second call reading the held files runs beside the first). An ``open()`` made while keeping the interpreter
lock (a ``ctypes.PyDLL`` call, as a Rust extension that does not release it) stops every thread of the process:
the holder hears nothing and lets go by itself, and the hold says so (``lost``) instead of hanging.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

from conformance.holds import LeaseHold


def _file(tmp_path) -> str:
    path = tmp_path / "model_state.tp0.0.pdparams"
    path.write_bytes(b"\0" * 64)
    return str(path)


def test_an_open_waits_until_the_hold_lets_go(tmp_path):
    path = _file(tmp_path)
    hold = LeaseHold(path, "at the open of the file")
    opened = threading.Event()

    def reader():
        os.close(os.open(path, os.O_RDONLY))
        opened.set()

    try:
        threading.Thread(target=reader, daemon=True).start()
        assert hold.reached(10.0)
        assert not hold.lost
        openers = hold.openers_reach(1, 1.0)
        assert openers in (None, 1)  # None: this kernel shows no wait channels
        assert not opened.wait(0.3), "the open went through the lease"
        if openers is not None:  # a second reader of the same file waits there too, and is counted
            threading.Thread(target=lambda: os.close(os.open(path, os.O_RDONLY)), daemon=True).start()
            assert hold.openers_reach(2, 2.0) == 2
        assert not hold.let_go()
        hold.release()
        assert opened.wait(10.0)
    finally:
        hold.close()


def test_a_process_that_stops_is_let_go_and_told(tmp_path):
    path = _file(tmp_path)
    hold = LeaseHold(path, "at the open of the file", grace_s=1.0)
    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the interpreter lock, as some native readers do
    libc.open.argtypes, libc.open.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
    done = threading.Event()

    def reader():
        fd = libc.open(path.encode(), os.O_RDONLY)
        if fd >= 0:
            os.close(fd)
        done.set()

    started = time.monotonic()
    try:
        threading.Thread(target=reader, daemon=True).start()
        assert hold.reached(30.0)
        assert hold.lost, "the holder kept the lease although this process could not tell it it was alive"
        assert done.wait(10.0)
        assert time.monotonic() - started < 25.0
    finally:
        hold.close()
