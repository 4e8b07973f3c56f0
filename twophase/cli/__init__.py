"""The ``twophase`` command: its subcommands (``main``), the flags they share (``flags``), the
terminal chat, the run's workload, the cache listing and the phase table."""

from twophase.cli.main import main

__all__ = ["main"]
