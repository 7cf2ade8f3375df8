"""What the trainer and the receiver must agree on, and nothing else.

``wire.protocol``: the ``ipc_bucket`` wire format (message schema and builders, the msgpack codec,
bucket layout planning, the constants). ``wire.handles``: the CPU form of an IPC handle (64 bytes
naming a shared-memory segment), the segment it names, the 7-field meta's fields and dtype codes, and
the rule that a handle opens only on the opener's current device.

The receiver's logic lives in ``reference/`` (parsing and validating what arrives, copying, applying);
the trainers and the rest of the device stand-in live in ``sim/``. Both import this package; it
imports neither, and ``reference`` never imports ``sim`` (``tests/test_import_direction.py``).
"""
