"""The devices a plan can be made for: this machine's CPU or GPU, or a GPU by name.

A named GPU's memory is what ``torch.cuda.mem_get_info`` reports as its total (a little under the
marketing figure: the driver keeps some), so a plan made on a laptop for an H200 is the plan the
engine makes on the H200 itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from twophase.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str                   # "cpu" or "cuda"
    total_bytes: int            # what the device has for this process
    source: str                 # where that figure comes from


# total memory as torch reports it on each card (MiB)
GPUS: dict[str, int] = {
    "h200": 143_156,            # 141 GB HBM3e
    "h100-80gb": 81_090,        # 80 GB HBM3 (SXM and PCIe)
    "h100-94gb": 95_248,        # H100 NVL
    "a100-80gb": 81_050,
    "a100-40gb": 40_338,
    "l40s": 45_467,
    "l4": 22_563,
    "a10g": 22_548,
    "rtx-4090": 24_210,
}


def profile(name: str, memory_gb: float | None = None) -> DeviceProfile:
    """``cpu`` and ``cuda`` are this machine's (free memory now); a GPU name is that card's total.
    ``memory_gb`` overrides the total of any of them."""
    key = name.lower()
    if key == "cpu" or key == "cuda" or key.startswith("cuda:"):
        from twophase.device import available_memory, parse_device, require_device

        dev = require_device(key) if key != "cpu" else parse_device(key)
        total, source = available_memory(str(dev)), f"free on this machine's {key} now"
    elif key in GPUS:
        total, source = GPUS[key] * MiB, "the card's total as torch reports it"
    else:
        raise ConfigError("--device", f"unknown device {name!r}; known: cpu, cuda, {', '.join(GPUS)} "
                                      f"(or give --memory-gb)")
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ConfigError("--memory-gb", f"must be positive; got {memory_gb}")
        total, source = int(memory_gb * GiB), "--memory-gb"
    return DeviceProfile(key, "cpu" if key == "cpu" else "cuda", total, source)
