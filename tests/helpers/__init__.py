"""Test helpers: import them as ``from helpers.models import tiny_llm`` (tests/ is on the path)."""
