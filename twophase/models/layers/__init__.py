"""The layers kit: the pieces a model family composes (norms, rotary embeddings, paged
attention, gated MLPs, a mixture of experts), each configured by ``twophase.arch`` values."""
