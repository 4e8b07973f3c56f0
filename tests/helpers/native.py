"""What the native backend's tests share: the instruction-set paths its kernels are built for,
and the skip where it cannot run."""

from __future__ import annotations

import pytest

from twophase.backends.native.kernel import ISA_FLAGS
from twophase.contract import BackendUnavailable

# the kernels' paths: each instruction set a test builds them for
PATHS = ISA_FLAGS


def native_or_skip() -> None:
    from twophase.backends.native import NativeBackend

    try:
        NativeBackend.check_available("cpu")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
