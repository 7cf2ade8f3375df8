"""Running one case in its modes (conformance/modes.py): what a combination asks of the session and of the calls
before the one under test. A test generated with ``modes.params(RULE)`` receives a combination such as
``{"staged": "staged", "model": "draft", "call": "second"}`` and uses these helpers, so that every rule means the
same by each mode:

- ``staged``: the session is opened with ``options["staged"] = True`` (:func:`options`);
- ``model``: with ``draft``, the case's spec has a draft (MTP) model beside the main one and the behaviour is judged
  on the draft's tensors (:func:`with_draft`, :func:`judged`);
- ``call``: the call under test is the first, second or third update of its session: ``second`` and ``third`` are
  preceded by one or two healthy updates of other versions, each followed by a clear where the path has one
  (:func:`earlier`).

    session = loader.open(mode_run.with_draft(SPEC, combo), options=mode_run.options(combo))
    mode_run.earlier(combo, session, publish=lambda version: write_files(version))
    ... the case's own files, then session.update() and the checks
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from weightsync.fixtures import models as M

CALLS = {"first": 0, "second": 1, "third": 2}
DRAFT_PREFIX = "mtp_block.0."  # an `mtp_` name component: GDR routes it to the draft model (GDR-MTP-ROUTE)
# The versions the earlier calls publish: far from any version a case uses for its own files.
EARLIER_VERSIONS = (901, 902)


def options(combo: Mapping[str, str], **more) -> dict:
    """The session options of the combination (``staged``), with ``more``."""
    out = dict(more)
    if combo.get("staged") == "staged":
        out["staged"] = True
    return out


def with_draft(spec: M.ModelSpec, combo: Mapping[str, str]) -> M.ModelSpec:
    """``spec`` itself for the main model; with ``model=draft``, the same tensors with a draft (MTP) model beside
    the main one holding a copy of each main tensor's dtype and shape under ``mtp_block.0.`` + its name."""
    if combo.get("model") != "draft" or spec.mtp:
        return spec
    draft = tuple((DRAFT_PREFIX + p.name, p.dtype, p.shape) for p in spec.main)
    return M.spec(*((p.name, p.dtype, p.shape) for p in spec.main), mtp=[draft])


def judged(name: str, combo: Mapping[str, str]) -> str:
    """The tensor a case judges: ``name`` of the main model, or its twin in the draft model."""
    return DRAFT_PREFIX + name if combo.get("model") == "draft" else name


def earlier(combo: Mapping[str, str], session, publish: Callable[[int], object], *, clear: bool = True,
            settle: Callable[[], object] | None = None) -> list[int]:
    """The healthy updates before the call under test (none for ``call=first``): each publishes a version with
    ``publish(version)``, updates, and clears after it when ``clear`` (the paths whose update follows a clear).
    Returns the versions loaded."""
    loaded = []
    for version in EARLIER_VERSIONS[:CALLS[combo.get("call", "first")]]:
        publish(version)
        session.update()
        if settle is not None:
            settle()
        loaded.append(version)
        if clear:
            session.clear()
    return loaded


def earlier_snapshot(combo: Mapping[str, str], session, spec: M.ModelSpec, model_dir: str, shared_dir: str,
                     level: str = "single", rank: int = 0, gpu_id: int = 0) -> list[int]:
    """:func:`earlier` on the snapshot path: each earlier version is written at ``level`` for (rank, gpu_id),
    loaded, cleared, and its files removed before the case writes its own."""
    import os

    from weightsync.fixtures import snapshot as S

    def publish(version):
        for path in S.write_level(level, model_dir, shared_dir, rank, gpu_id, M.state(spec, version=version)):
            written.append(path)

    written: list[str] = []
    try:
        return earlier(combo, session, publish)
    finally:
        for path in written:
            if os.path.exists(path):
                os.remove(path)


def earlier_stream(combo: Mapping[str, str], session, trainer, spec: M.ModelSpec) -> list[int]:
    """:func:`earlier` on a streamed path (rsync, GDR), whose updates write into loaded weights: each earlier
    version is streamed by ``trainer`` and loaded; then, for ``start=cleared``, the session is cleared, so that the
    update under test fills cleared parameters (a bootstrap load) instead of updating them in place."""
    from weightsync.fixtures import streams as S

    def publish(version):
        trainer.serve(S.stream_of(M.state(spec, version=version)))

    loaded = earlier(combo, session, publish, clear=False)
    if loaded and combo.get("start") == "cleared":
        session.clear()
    return loaded


def label(combo: Mapping[str, str]) -> str:
    """The combination, for a failure message: ``staged, draft model, second call``."""
    parts = []
    if "path" in combo:
        parts.append(combo["path"])
    if combo.get("staged") == "staged":
        parts.append("staged")
    if combo.get("model") == "draft":
        parts.append("judged on the draft model")
    if combo.get("call", "first") != "first":
        parts.append(f"{combo['call']} update of the session")
    if "start" in combo:
        parts.append("in place" if combo["start"] == "loaded" else "after a clear")
    return ", ".join(parts) or "default modes"
