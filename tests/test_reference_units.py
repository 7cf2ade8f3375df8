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
