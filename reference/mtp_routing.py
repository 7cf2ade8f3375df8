"""Streaming one pass of items into a main model and its MTP (draft) models (fd-spec §4.1).

The main model's ``load_weights`` receives every item, in stream order. Items that belong to an MTP
model are also collected and handed to every MTP model's ``load_weights`` in chunks of ``chunk`` items:
a chunk is flushed when it is full, at the moment the main loader asks for its next item, and once more
after the main loader returns. With MTP models present, a stream with no MTP item is an error: the
draft model would be left on its old weights.

Routing is by whole name components (where FastDeploy tests substrings): a name belongs to the MTP
models when one of its components starts with ``mtp_`` (``mtp_linear_proj``, ``mtp_block``), or when a
component ``layers`` is followed by the index of an MTP layer: ``model.layers.2.q`` reaches MTP layer 2,
``model.layers.20.q`` and ``model.sublayers.2.q`` do not. An MTP model's layers are
``range(start, start + count)``, from ``mtp_start_layer_idx`` / ``num_mtp_layers`` or, failing those,
``fd_config.model_config.start_layer_index`` / ``num_nextn_predict_layers``; a model that has neither
routes by ``mtp_`` components only.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_CHUNK = 16
NO_MTP_WEIGHTS = "No MTP weights were cached from the GDR stream for auxiliary model loading."


def chunk_size(value) -> int:
    """``gdr_mtp_chunk_size``: 16 by default; 0 or less means 1."""
    try:
        return max(1, int(DEFAULT_CHUNK if value is None else value))
    except (TypeError, ValueError):
        raise ValueError(f"rsync_config['gdr_mtp_chunk_size'] must be an integer, got {value!r}") from None


def _first_set(*values):
    for value in values:
        if value is not None:
            return value
    return None


def mtp_layers(model) -> range | None:
    model_config = getattr(getattr(model, "fd_config", None), "model_config", None)
    start = _first_set(getattr(model, "mtp_start_layer_idx", None), getattr(model_config, "start_layer_index", None))
    count = _first_set(getattr(model, "num_mtp_layers", None), getattr(model_config, "num_nextn_predict_layers", None))
    if start is None or count is None:
        return None
    return range(int(start), int(start) + int(count))


def routing_layers(mtp_models: Sequence) -> frozenset[str]:
    """The MTP layer indices of every MTP model, as name components."""
    out: set[str] = set()
    for model in mtp_models:
        layers = mtp_layers(model)
        if layers is not None:
            out.update(str(i) for i in layers)
    return frozenset(out)


def routes(name: str, layers: frozenset[str]) -> bool:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("mtp_"):
            return True
        if part == "layers" and i + 1 < len(parts) and parts[i + 1] in layers:
            return True
    return False


def item_name(item) -> str:
    return item[0]


class NoMtpWeights(ValueError):
    """FastDeploy's "No MTP weights" ValueError, with what was delivered (for the counts of its message)."""

    def __init__(self, message: str, delivery):
        super().__init__(message)
        self.delivery = delivery


@dataclass
class Delivery:
    update_count: int = 0  # items the main model received
    mtp_cache_count: int = 0  # items routed to the MTP models
    names: list = field(default_factory=list)  # names the main model received, in order


def load_models(models: Sequence, items: Iterable, chunk: int, mtp_names: Sequence[str] = ()) -> Delivery:
    """Stream ``items`` into ``models`` (main first); ``mtp_names``: the MTP models' parameters, named
    when no item reaches them."""
    main, mtp_models = models[0], list(models[1:])
    out = Delivery()
    if not mtp_models:
        def everything():
            for item in items:
                out.update_count += 1
                out.names.append(item_name(item))
                yield item

        main.load_weights(everything())
        return out
    layers = routing_layers(mtp_models)
    pending: list = []

    def flush() -> None:
        if pending:
            batch = list(pending)
            pending.clear()
            for model in mtp_models:
                model.load_weights(iter(batch))

    def routed():
        for item in items:
            out.update_count += 1
            name = item_name(item)
            out.names.append(name)
            if routes(name, layers):
                pending.append(item)
                out.mtp_cache_count += 1
            yield item
            if len(pending) >= chunk:
                flush()

    main.load_weights(routed())
    flush()
    if out.mtp_cache_count == 0:
        raise NoMtpWeights(f"{NO_MTP_WEIGHTS} The MTP model(s) would keep the previous version of {list(mtp_names)}", out)
    return out
