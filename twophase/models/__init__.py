"""The torch model and its weight sources (GGUF, HF folders, random shapes)."""
