"""Tied parameters (SPEC.md MODEL-TIED): one parameter object under several names, such as an output
head sharing its embedding's storage. A source carrying any one name of a tied group has loaded them all."""
from __future__ import annotations

from collections.abc import Collection, Mapping


def missing(params: Mapping[str, object], present: Collection[str]) -> list[str]:
    """Names of ``params`` whose parameter object is carried by none of the names in ``present``."""
    carried = {id(params[n]) for n in present if n in params}
    return [name for name, param in params.items() if id(param) not in carried]
