"""One spelling of dtypes across the project: Paddle's name without the ``paddle.`` prefix."""
from __future__ import annotations

import paddle

# safetensors header dtype -> canonical name. Only dtypes Paddle can hold are listed.
SAFETENSORS_TO_NAME = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_name(tensor) -> str:
    """Canonical name of a Paddle tensor's dtype (``paddle.bfloat16`` -> ``"bfloat16"``)."""
    return str(tensor.dtype).removeprefix("paddle.")


def paddle_dtype(name: str):
    """Paddle dtype object for a canonical name; callers have checked the name against ``ITEMSIZE``."""
    return getattr(paddle, name)
