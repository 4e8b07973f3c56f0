"""The memory planner: what a config needs on a device, before anything loads, and the same
figures the engine sizes its KV pool with (``twophase plan``)."""

from twophase.plan.budget import Item, Plan, plan, pool_settings
from twophase.plan.devices import DeviceProfile, profile

__all__ = ["DeviceProfile", "Item", "Plan", "plan", "pool_settings", "profile"]
