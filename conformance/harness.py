"""What a conformance test holds: the adapter, a worker identity, and sessions on fresh models."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .adapter import LoaderConfig

_calls = {"adapter": 0}


def reset() -> None:
    _calls["adapter"] = 0


def adapter_calls() -> int:
    return _calls["adapter"]


class RecordedSession:
    """Forwards to the implementation's session and counts the calls (vacuity guard)."""

    def __init__(self, inner, models):
        self._inner = inner
        self.models = models  # keep the Paddle layers alive as long as the session

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            _calls["adapter"] += 1
            return attr(*args, **kwargs)

        return call


def set_worker_env(environ, rank: int, visible: str, selected: str) -> None:
    """Put a worker identity in ``environ`` and drop Paddle's cached parallel env so that
    ``paddle.distributed.get_rank()`` reads it afresh."""
    environ["PADDLE_TRAINER_ID"] = str(rank)
    environ["PADDLE_TRAINERS_NUM"] = str(max(rank + 1, int(environ.get("PADDLE_TRAINERS_NUM", "1"))))
    environ["CUDA_VISIBLE_DEVICES"] = visible
    environ["FLAGS_selected_gpus"] = selected
    from paddle.distributed import parallel

    parallel._global_parallel_env = None


@dataclass
class Worker:
    rank: int = 0
    visible: str = "0"
    selected: str = "0"

    @property
    def gpu_id(self) -> int:
        return int(self.visible.split(",")[int(self.selected)])


class Loader:
    """Opens sessions of the implementation under test on models built from a spec."""

    def __init__(self, adapter, tmp_path, monkeypatch):
        self.adapter = adapter
        self.model_dir = str(tmp_path / "model")
        self.shared_dir = str(tmp_path / "shared_ipc_meta")
        os.makedirs(self.model_dir, exist_ok=True)
        os.makedirs(self.shared_dir, exist_ok=True)
        self._monkeypatch = monkeypatch
        self._sessions: list[RecordedSession] = []

    def open(self, model_spec, *, strategy="ipc_snapshot", worker: Worker | None = None, model_dir=None, options=None):
        worker = worker or Worker()
        for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus"):
            self._monkeypatch.setenv(key, os.environ.get(key, "0"))  # restored after the test
        set_worker_env(os.environ, worker.rank, worker.visible, worker.selected)
        from fixtures.models import build_models

        models = build_models(model_spec)
        config = LoaderConfig(strategy, model_dir or self.model_dir, self.shared_dir, dict(options or {}))
        _calls["adapter"] += 1
        session = RecordedSession(self.adapter.open(models, config), models)
        self._sessions.append(session)
        return session

    def close_all(self) -> None:
        for s in self._sessions:
            close = getattr(s._inner, "close", None)
            if close:
                close()
        self._sessions.clear()
        from paddle.distributed import parallel

        parallel._global_parallel_env = None
