"""Measuring a loaded model: its quality (perplexity, KL against a reference) and the time of
one prefill or decode round, both through the engine's own backends."""
