"""What the native backend's tests share: the instruction-set paths its kernels are built for,
and the skip where it cannot run."""

from __future__ import annotations

import pytest

from twophase.contract import BackendUnavailable

# the kernels' paths, each compiled for this CPU with what it may not use switched off: 512-bit
# VNNI (16 lanes a vector, where the CPU has it), 256-bit VNNI, AVX2 without VNNI (8 lanes)
# (a switch for a set this CPU lacks changes nothing and is dropped: the path is the native build)
PATHS = {"native": (), "avx-vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni")}


def native_or_skip() -> None:
    from twophase.backends.native import NativeBackend

    try:
        NativeBackend.check_available("cpu")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
