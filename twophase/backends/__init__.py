"""Backends: the contract (``base``), discovery (``registry``) and the built-in implementations."""
