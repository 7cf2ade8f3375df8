"""Mutants: the reference with one real bug put back. Each must fail the rules it ``kills``.

A mutant patches functions of the reference *for the whole process* when constructed; the kill
matrix runs each in its own pytest subprocess (``--impl=tests.mutants:mutant --impl-opt name=X``).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

from reference.adapter import ReferenceAdapter


class Mutant(ReferenceAdapter):
    #: mutant id used on the command line
    id: str = ""
    #: the bug reproduced, with its origin
    bug: str = ""
    #: SPEC.md rule ids this mutant must fail (the kill matrix)
    kills: frozenset[str] = frozenset()
    #: rules of ``kills`` this mutant fails only in a tier's job, each with why the quick run cannot show it
    #: (tests/test_mutant_zoo.py: it must fail every other multi-rank rule of ``kills`` in the quick run too)
    tier_only: dict[str, str] = {}

    def patches(self) -> dict[str, Callable]:
        """'package.module.attr' -> replacement."""
        return {}

    def __init__(self):
        self.name = f"mutant:{self.id}"
        for target, replacement in self.patches().items():
            module_name, _, attr = target.rpartition(".")
            module = importlib.import_module(module_name)
            if not hasattr(module, attr):
                raise AttributeError(f"mutant {self.id}: {target} does not exist; the patch would be a no-op")
            setattr(module, attr, replacement)
