"""graphep.Error: every graphep failure, from the C++ engine or from the Python checks.

`status` is a graphep.Status (INVALID_ARGUMENT, CUDA_ERROR, ...); the message names the bad value
("MoeConfig.hidden=7004 is not a positive multiple of 8", "x has dtype float16, expected bfloat16").
"""

from graphep._graphep import Status


class Error(RuntimeError):
    """A graphep failure: `status` says what kind, `message` names the offending value."""

    def __init__(self, status: Status, message: str):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


def invalid_argument(message: str) -> Error:
    return Error(Status.INVALID_ARGUMENT, message)


def not_supported(message: str) -> Error:
    return Error(Status.NOT_SUPPORTED, message)
