"""Model-weight status values, numerically identical to FastDeploy's ModelWeightsStatus."""
from enum import IntEnum


class Status(IntEnum):
    NORMAL = 0
    UPDATING = 1
    CLEARING = -1
    CLEARED = -2
