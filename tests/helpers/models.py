"""What many tests build: the tiny random model, prompt lists, and checks shared by backends."""

from __future__ import annotations

import random

import torch

from twophase import LLM, SamplingParams

# One short prompt list for every test on the default model (CI time).
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("raw", "The quick brown fox"),
    ("raw", "def fibonacci(n):"),
]
GREEDY_TOKENS = 32



def tiny_llm(**sections) -> LLM:
    cfg = {"model": {"name": "tiny", "weights": "random"}, "cache": {"num_blocks": 64}}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return LLM.from_config(cfg)


def prefill_all_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every position of ``prompts``, prefilled as one step of chunks by the engine's
    prefill backend."""
    from twophase.core.batch import prefill_batch

    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=2))
    sched = eng.scheduler.schedule()
    batch = prefill_batch([(r, 0, n) for r, n in sched.prefills], eng.kv)
    batch.logits = "all"
    return llm.prefill_backend.prefill(batch)


def top2_gaps(logits: torch.Tensor) -> list[float]:
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).tolist()


# A pool and budget small enough that ``random_prompts()`` preempt and mix chunks with decodes.
PREEMPTING = {"cache": {"num_blocks": 64, "block_size": 4},
              "scheduler": {"max_num_batched_tokens": 48, "max_num_seqs": 8}}


def random_prompts(n: int = 12, seed: int = 0, longest: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, longest))] for _ in range(n)]



def assert_same_tokens_with_preemption(backend: dict, torch_tokens: list[list[int]]) -> None:
    """``backend`` (a [backend] section, possibly split by phase) gives torch's greedy tokens
    through chunked prefill, mixed steps and preemption, and frees every block."""
    llm = tiny_llm(**PREEMPTING, backend=backend)
    outs = llm.generate(random_prompts(), SamplingParams(max_tokens=16, ignore_eos=True))
    rep = llm.report(outs)
    assert rep["preemptions"] > 0 and rep["steps_by_mix"].get("mixed")
    assert [o.token_ids for o in outs] == torch_tokens
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def assert_prefix_hits_give_torch_tokens(name: str) -> None:
    llm = tiny_llm(backend={"name": name})
    ref = tiny_llm()
    prefix = list(range(10, 60))
    prompts = [prefix + [100 + i] for i in range(3)]
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    got = [llm.generate([q], p)[0] for q in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref.generate(prompts, p)]
    assert got[-1].metrics["num_cached_tokens"] == 48


def dequantised_reference(llm_q4) -> LLM:
    """The torch model with every projection and the head replaced by its dequantised q4 form."""
    from twophase.testing import dequantised

    ref = tiny_llm(cache={"num_blocks": 64})
    dequantised(ref)
    return ref
