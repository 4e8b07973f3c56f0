"""The prompts of a run, from ``[workload]``: inline, a JSONL file, or synthetic lengths."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict

from twophase.config import Config
from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError, InvalidSamplingParam

log = logging.getLogger(__name__)
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


def sampling_params(cfg: Config, **overrides) -> SamplingParams:
    unknown = sorted(set(overrides) - set(asdict(cfg.sampling)))
    if unknown:
        raise ConfigError(f"sampling.{unknown[0]}", f"is not a sampling parameter; allowed: "
                                                     f"{', '.join(asdict(cfg.sampling))}")
    try:
        return SamplingParams(**{**asdict(cfg.sampling), **overrides})
    except InvalidSamplingParam as exc:
        raise ConfigError(f"sampling.{exc.name}", exc.message) from None


def prompt_handling(chat: bool | str, tokenizer) -> str:
    """What a run does to a text prompt, and why, in words (said on every run that has text prompts)."""
    if tokenizer is None:
        return "token ids only: this model has no tokenizer"
    if chat is False:
        return "sent as written (workload.chat = false, or --raw)"
    if chat is True or tokenizer.chat_template:
        return (f"through the model's chat template (workload.chat = {json.dumps(chat)}); --raw, or "
                f"workload.chat = false, sends them as written")
    return ("sent as written: this model has no chat template (a base model continues the text; "
            "write prompts to be continued, e.g. \"The capital of France is\")")


def build(cfg: Config, tokenizer, vocab_size: int) -> list[tuple[str | list[int], SamplingParams]]:
    w = cfg.workload
    base = sampling_params(cfg)
    items: list[tuple[str | list[int], SamplingParams]] = []
    templated = tokenizer is not None and (w.chat is True or (
        w.chat == "auto" and tokenizer.chat_template))
    chat = (lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}])) \
        if templated else (lambda p: p)
    if w.prompts or w.jsonl or w.synthetic is None:
        log.info("prompts: %s", prompt_handling(w.chat, tokenizer))
    items += [(chat(p), base) for p in w.prompts or []]
    if w.jsonl:
        items += _jsonl(cfg, chat)
    if w.synthetic is not None:
        s = w.synthetic
        rng = random.Random(s.seed)
        for _ in range(s.num_requests):
            n = rng.randint(*s.input_len)
            ids = [rng.randrange(3, vocab_size) for _ in range(n)]
            items.append((ids, sampling_params(cfg, max_tokens=rng.randint(*s.output_len),
                                               ignore_eos=True)))
    if not items:
        if tokenizer is None:
            raise ConfigError("workload", "this model has no tokenizer: give workload.synthetic "
                                          "or a JSONL file of prompt_token_ids")
        log.info("no [workload] given: running %d example prompts", len(DEFAULT_PROMPTS))
        items = [(chat(p), base) for p in DEFAULT_PROMPTS]
    return items


def validate(cfg: Config) -> None:
    """Check the workload's files before the model loads, so a typo costs no load time."""
    if cfg.workload.jsonl:
        _jsonl(cfg, lambda p: p)


def _jsonl(cfg: Config, chat) -> list[tuple[str | list[int], SamplingParams]]:
    path = cfg.resolve(cfg.workload.jsonl)
    if not path.is_file():
        raise ConfigError("workload.jsonl", f"file {str(path)!r} not found")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"workload.jsonl ({path.name}:{lineno})"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"not JSON: {exc}") from None
        if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_token_ids" in rec):
            raise ConfigError(where, "each line needs exactly one of 'prompt' or 'prompt_token_ids'")
        prompt = chat(rec.pop("prompt")) if "prompt" in rec else rec.pop("prompt_token_ids")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise ConfigError(where, "'prompt' must be a string and 'prompt_token_ids' a list of integers")
        try:
            params = sampling_params(cfg, **rec)
        except ConfigError as exc:
            raise ConfigError(where, f"{exc.key.removeprefix('sampling.')} {str(exc).split(': ', 1)[1]}") from None
        out.append((prompt, params))
    return out
