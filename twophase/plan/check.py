"""The plan checked against the truth after load: what the process (CPU: resident set) or the
device (CUDA: memory in use, ``mem_get_info``) gained while each item was allocated, next to what
the plan predicted. A gap over 10% and over 256 MiB is a warning naming the item.

On CUDA the device's memory in use counts what torch's caching allocator holds, freed blocks
too: blocks an earlier engine in this process freed would hold part of the next one's weights
without the device's figure growing, hiding them from the check. So each reading first returns
the cached blocks no tensor uses to the driver (``gc.collect``, then ``torch.cuda.empty_cache``);
what is left is what is allocated (in whole segments), and what other libraries (TensorRT, IREE,
ONNX Runtime) and other processes hold.
"""

from __future__ import annotations

import gc
import logging

import torch

from twophase.device import resident_bytes
from twophase.plan.budget import MiB

log = logging.getLogger("twophase.memory")
TOLERANCE, FLOOR = 0.10, 256 * MiB


def in_use(device: str) -> int:
    """Bytes in use now: this process's resident set on the CPU, the device's used memory on
    CUDA, once torch's cache of freed blocks is handed back."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        gc.collect()                  # tensors only a reference cycle still holds
        with torch.cuda.device(dev):  # empty_cache acts on the current device
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        return int(total - free)
    return resident_bytes()


def compare(predicted: dict[str, int], measured: dict[str, int]) -> dict[str, dict[str, int]]:
    """Log each item's predicted and measured bytes; warn where they part."""
    out, parts = {}, []
    for item, want in predicted.items():
        got = measured.get(item)
        if got is None:
            continue
        out[item] = {"predicted": want, "measured": got}
        parts.append(f"{item} {want / MiB:,.1f} vs {got / MiB:,.1f} MiB")
        gap = got - want
        if abs(gap) > max(TOLERANCE * want, FLOOR):
            log.warning("memory: %s took %.1f MiB, the plan said %.1f MiB (%+.0f%%): the plan "
                        "(twophase plan) misjudges this item here", item, got / MiB, want / MiB,
                        100 * gap / max(want, 1))
    if parts:
        log.info("memory, predicted vs measured: %s", "; ".join(parts))
    return out
