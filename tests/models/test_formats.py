"""The weight-format table against the ``gguf`` package's own: type ids, block sizes and the
bytes a tensor of a shape takes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from twophase.formats import FORMATS, by_ggml_type


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_is_ggmls(name):
    fmt = FORMATS[name]
    t = gguf.GGMLQuantizationType[name]
    assert fmt.ggml_type == int(t) and by_ggml_type(int(t)) is fmt
    assert (fmt.block, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[t]
    shape = (3, 2 * fmt.block * (256 // fmt.block if fmt.block < 256 else 1))
    assert fmt.bytes_for(shape) == int(np.prod(gguf.quant_shape_to_byte_shape(shape, t)))


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="Q4_K: rows of 300 are not whole blocks of 256"):
        FORMATS["Q4_K"].bytes_for((2, 300))
