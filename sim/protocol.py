"""Moved to ``wire.protocol`` (what the trainer and the receiver agree on lives outside ``sim``).

Kept as an alias so that simulator code written against ``sim.protocol`` still imports; new code
imports ``wire.protocol``. ``reference`` imports neither this module nor anything else of ``sim``.
"""
from wire.protocol import *  # noqa: F401,F403
from wire.protocol import decode, encode  # noqa: F401  (explicit for readers and linters)
