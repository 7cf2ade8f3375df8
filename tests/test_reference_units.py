"""The reference's internals that no adapter observes, pinned directly (run by mutation testing too:
``[tool.mutmut]`` in pyproject.toml)."""
import pytest


@pytest.mark.parametrize("shape, stride, elements", [
    ([3, 4], [1, 3], 12),  # column-major: the last element is at 2 * 1 + 3 * 3 = 11
    ([1, 5], [7, 1], 5),  # a dimension of one: its stride never counts
    ([2, 3, 2], [6, 1, 3], 12),  # permuted
    ([4], [1], 4),  # contiguous
])
def test_a_strided_target_gets_storage_up_to_its_last_element(shape, stride, elements):
    """``apply.allocate_strided`` gives a cleared strided parameter fresh storage laid out by its own strides:
    exactly ``1 + sum((n - 1) * s)`` elements, so the view's last element is inside it (Paddle's
    ``as_strided`` checks nothing: a shorter buffer is written past its end)."""
    import paddle

    from reference.apply import allocate_strided

    target = paddle.as_strided(paddle.empty([elements], dtype="float32"), shape, stride)
    allocate_strided(target)
    assert (list(target.shape), list(target.stride())) == (shape, stride)
    assert target._holder_size() == elements * 4, (
        f"shape {shape} stride {stride}: storage of {target._holder_size()} bytes, expected {elements * 4}")


def test_a_model_loaded_at_start_up_is_served_and_digested_before_any_update():
    """A manager over parameters that already hold weights (the engine loaded them at start-up) starts NORMAL:
    a forward pass runs at once (the request gate starts open, SERVE-NO-MIXED-VERSIONS: "a pass that arrives
    while nothing changes runs at once") and ``digest()`` describes those weights (no update has changed
    anything in place yet)."""
    import threading

    import numpy as np
    import paddle

    from fixtures import digests
    from reference.manager import WeightManager
    from reference.status import Status

    model = paddle.nn.Linear(3, 2)
    manager = WeightManager(model, load_strategy="ipc_snapshot")
    assert manager.status == Status.NORMAL, manager.status
    ran = threading.Event()

    def forward():
        with manager.requests.forward():
            ran.set()

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    assert ran.wait(5.0), "a forward pass on the weights loaded at start-up waited for an update"
    thread.join(5.0)
    oracle = digests.model({name: np.asarray(p.numpy()) for name, p in model.state_dict().items()})
    assert manager.digest().as_dict() == oracle, (manager.digest().as_dict(), oracle)


@pytest.mark.parametrize("process_env", [{}, {"CUDA_VISIBLE_DEVICES": "0,1", "FLAGS_selected_gpus": "0"}],
                         ids=["process-env-unset", "process-env-other-gpu"])
def test_a_manager_takes_its_identity_from_the_env_it_is_given(monkeypatch, process_env):
    """``WeightManager(env=...)`` reads the worker's physical GPU id (SNAP-GPU-ID:
    ``CUDA_VISIBLE_DEVICES[FLAGS_selected_gpus]``; the streamed paths' worker identity reads the same mapping)
    from the mapping it is given, whatever the process's environment holds; without ``env``, from the
    process's. The adapter never passes ``env`` (the harness sets a worker's variables in its process), so
    only this test sees a manager that ignores it."""
    import paddle

    from reference.manager import WeightManager

    for name in ("CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus"):
        monkeypatch.delenv(name, raising=False)
    for name, value in process_env.items():
        monkeypatch.setenv(name, value)
    model = paddle.nn.Linear(3, 2)
    given = {"CUDA_VISIBLE_DEVICES": "5,7", "FLAGS_selected_gpus": "1"}
    manager = WeightManager(model, load_strategy="ipc_snapshot", env=given)
    assert (manager.gpu_id, manager.env) == (7, given), (
        f"env={given} with the process's {process_env}: gpu_id {manager.gpu_id}, env {manager.env}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,9")
    monkeypatch.setenv("FLAGS_selected_gpus", "1")
    assert WeightManager(model, load_strategy="ipc_snapshot").gpu_id == 9, "no env: the process's variables"


@pytest.mark.parametrize("served", [(2, 3), (3, 3), (2, 2, 3)])
def test_a_layout_is_given_once_however_often_it_is_asked_for(served):
    """``transforms.before_load`` and ``restore`` each move a transposed weight's data once: asked again (the update
    after a failed one failing before its load, the reference's refusal of an update without ``clear()``, restores a
    second time) they leave it as it is; ``_relayout`` itself always swaps."""
    import math

    import numpy as np
    import paddle

    from reference import transforms as T

    data = np.arange(math.prod(served), dtype=np.float32).reshape(served)
    param = paddle.to_tensor(data)
    loaded = T.loaded_shape(served)
    post = T.PostLoad([T.Transpose(param, served, loaded)], [])
    for step, shape, want in ((T.before_load, loaded, np.swapaxes(data, -1, -2)), (T.restore, served, data)):
        for call in ("first", "second"):
            step(post)
            got = param.numpy()
            assert tuple(param.shape) == shape and np.array_equal(got, want), (
                f"{served}: after the {call} {step.__name__}(): shape {tuple(param.shape)} {got.tolist()}, "
                f"expected {shape} {want.tolist()}")
