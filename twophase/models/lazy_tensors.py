"""Tensors by name, each made only when asked for: what a checkpoint's reader hands
``from_hf_state_dict`` (which takes each name once) where making a tensor costs memory, so a
checkpoint is never held whole in a second form (gpt-oss's MXFP4 experts dequantised: 38 GB in
bf16 for gpt-oss-20b), and a reader that wants some tensors reads only those."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class LazyTensors(Mapping[str, torch.Tensor]):
    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]):
        self._makers = makers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()               # made anew at each ask: not kept here

    def __contains__(self, name: object) -> bool:     # Mapping's own would make the tensor
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def maker(self, name: str) -> Callable[[], torch.Tensor]:
        return self._makers[name]

    def renamed(self, names: Mapping[str, str]) -> LazyTensors:
        """The tensors ``names`` maps (old -> new), under their new names."""
        return LazyTensors({new: self._makers[old] for old, new in names.items()})


def lazily(tensors: Mapping[str, torch.Tensor]) -> LazyTensors:
    """``tensors`` as a ``LazyTensors`` (a lazy one as it is)."""
    if isinstance(tensors, LazyTensors):
        return tensors
    return LazyTensors({k: (lambda k=k: tensors[k]) for k in tensors})
