"""The broken-implementation zoo. ``--impl=tests.mutants:mutant --impl-opt name=ID`` runs one."""
from __future__ import annotations

import importlib
import pkgutil

from .base import Mutant


def all_mutants() -> dict[str, type[Mutant]]:
    """id -> class, from every module of this package."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    found: dict[str, type[Mutant]] = {}

    def walk(cls):
        for sub in cls.__subclasses__():
            if sub.id:
                if sub.id in found:
                    raise ValueError(f"mutant id {sub.id} defined twice")
                found[sub.id] = sub
            walk(sub)

    walk(Mutant)
    return found


def mutant(name: str) -> Mutant:
    mutants = all_mutants()
    if name not in mutants:
        raise ValueError(f"unknown mutant {name!r}; known: {', '.join(sorted(mutants))}")
    return mutants[name]()
