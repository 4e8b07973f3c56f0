"""Quality of a model as served: perplexity on a text and greedy agreement with a reference,
both computed by the engine's own prefill backend (so a quantised graph is measured as it runs).

The text is fed in chunks through ``prefill`` with logits at every position, over KV blocks the
engine lends for the duration and takes back (``Engine.prefill_logits``: never published to the
prefix cache).
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from twophase.core.sampling_params import SamplingParams


def shipped_text() -> str:
    """A few KB of public-domain prose shipped with the package (see ``twophase/data``)."""
    return files("twophase.data").joinpath("prose.txt").read_text(encoding="utf-8")


def all_logits(llm, ids: list[int], chunk: int | None = None):
    """Yield ``(start, logits [n, vocab])`` for consecutive chunks of ``ids``."""
    return llm.engine.prefill_logits(ids, chunk)


def perplexity(llm, text: str | list[int]) -> float:
    """exp of the mean negative log-likelihood of each token given all before it."""
    ids = llm.tokenizer.encode(text) if isinstance(text, str) else list(text)
    nll, count = 0.0, 0
    for start, logits in all_logits(llm, ids):
        targets = torch.tensor(ids[start + 1:start + 1 + logits.shape[0]])
        lp = torch.log_softmax(logits[:len(targets)], dim=-1)
        nll -= float(lp[torch.arange(len(targets)), targets].sum())
        count += len(targets)
    return math.exp(nll / count)


def compare(llm, reference, text: str | list[int]) -> tuple[float, float, float]:
    """``(perplexity of llm, perplexity of reference, KL(reference ‖ llm))`` from one pass of each
    over ``text``, the same chunks: what ``perplexity`` twice and ``kl_divergence`` give, at half
    the forward passes."""
    ids = reference.tokenizer.encode(text) if isinstance(text, str) else list(text)
    nll, ref_nll, total, count = 0.0, 0.0, 0.0, 0
    chunk = reference.engine.limits.max_num_batched_tokens
    for (start, want), (_, got) in zip(all_logits(reference, ids, chunk), all_logits(llm, ids, chunk)):
        ref_lp, lp = torch.log_softmax(want, dim=-1), torch.log_softmax(got, dim=-1)
        total += float((ref_lp.exp() * (ref_lp - lp)).sum())
        targets = torch.tensor(ids[start + 1:start + 1 + want.shape[0]])
        rows = torch.arange(len(targets))
        nll -= float(lp[rows, targets].sum())
        ref_nll -= float(ref_lp[rows, targets].sum())
        count += want.shape[0]
    n = len(ids) - 1
    return math.exp(nll / n), math.exp(ref_nll / n), total / count


def kl_divergence(llm, reference, text: str | list[int]) -> float:
    """The mean over positions of KL(reference ‖ llm) between next-token distributions, in nats:
    how far a quantised model's predictions are from the float model's everywhere, not only at
    the text's tokens (perplexity's difference on a short text swings with a few uncertain
    tokens: llama.cpp's on the default model's GGUF is +0.15% or +0.59% by its attention kernel)."""
    ids = reference.tokenizer.encode(text) if isinstance(text, str) else list(text)
    total, count = 0.0, 0
    chunk = reference.engine.limits.max_num_batched_tokens      # the same chunks from both
    for (_, want), (_, got) in zip(all_logits(reference, ids, chunk), all_logits(llm, ids, chunk)):
        ref_lp, lp = torch.log_softmax(want, dim=-1), torch.log_softmax(got, dim=-1)
        total += float((ref_lp.exp() * (ref_lp - lp)).sum())
        count += want.shape[0]
    return total / count


def greedy_agreement(llm, reference, prompts: list[str | list[int]], max_tokens: int = 32) -> float:
    """The share of positions where ``llm``'s greedy token equals ``reference``'s, along the
    reference's own greedy continuations (teacher-forced, so one early difference does not
    count every later token against it)."""
    agree = total = 0
    for out in reference.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        first = len(out.prompt_token_ids) - 1           # the logits that chose output token 0
        want = torch.tensor(out.token_ids)
        got = torch.cat([logits.argmax(-1) for _, logits in all_logits(llm, ids)])[first:first + len(want)]
        agree += int((got == want).sum())
        total += len(want)
    return agree / total
