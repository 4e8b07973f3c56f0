"""The draft model of ``[speculative] method = "draft"``: its config (the target's, with the
``[speculative.draft]`` keys over it) and the check, before any weights load, that it speaks the
target's vocabulary (a draft token is a target token id, so the two must mean the same text)."""

from __future__ import annotations

import dataclasses

from twophase.config import Config, SpeculativeConfig
from twophase.errors import ConfigError
from twophase.models.loader import ResolvedModel


def draft_config(cfg: Config) -> Config:
    """The config the draft model loads from: the target's model keys under the draft's own,
    its backend (default: the target's decode backend), the target's scheduler limits, and a
    pool of its own without prefix caching (its K/V are never shared)."""
    d = cfg.speculative.draft
    assert d is not None, "method = 'draft' is checked to have a [speculative.draft] section"
    m = cfg.model
    named = d.name is not None or d.path is not None
    model = dataclasses.replace(
        m, name=d.name or m.name, path=d.path if named else m.path,
        weights=d.weights or m.weights,
        num_layers=d.num_layers if d.num_layers is not None else m.num_layers,
        seed=d.seed if d.seed is not None else m.seed,
        quantization=d.quantization or m.quantization)
    cache = dataclasses.replace(cfg.cache, prefix_caching=False, memory_gb=None,
                                num_blocks=d.num_blocks)
    return dataclasses.replace(cfg, model=model, backend=d.backend or cfg.phases()[1], cache=cache,
                               speculative=SpeculativeConfig())


def with_pool(cfg: Config, num_blocks: int) -> Config:
    """``cfg`` with ``num_blocks = "auto"`` made ``num_blocks``: the draft's pool holds as many
    tokens as the target's, so every sequence the target keeps, the draft can too."""
    if cfg.cache.num_blocks != "auto":
        return cfg
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks=num_blocks))


def rekeyed(exc: ConfigError) -> ConfigError:
    """A ``model.*`` error raised while resolving the draft, under the draft's own keys."""
    key = exc.key.replace("model.", "speculative.draft.", 1)
    message = str(exc).removeprefix(f"{exc.key}: ")
    return ConfigError(key, message)


def check_vocabulary(target: ResolvedModel, draft: ResolvedModel) -> None:
    """Refuse a draft whose token ids mean other text than the target's, naming both (and a
    draft with state layers: its own pool keeps no state slots)."""
    if draft.arch.state_layers:
        raise ConfigError("speculative.draft", f"the draft {draft.model_id} has state layers; a draft model's "
                          f"every layer must attend (the target may keep a state)")
    why = None
    if draft.arch.vocab_size != target.arch.vocab_size:
        why = f"{draft.arch.vocab_size} token ids against {target.arch.vocab_size}"
    elif (draft.tokenizer is None) != (target.tokenizer is None):
        why = "one has a tokenizer and the other none"
    elif draft.tokenizer is not None and target.tokenizer is not None:
        dv, tv = draft.tokenizer.vocabulary(), target.tokenizer.vocabulary()
        if dv != tv:
            by_id_d, by_id_t = {i: t for t, i in dv.items()}, {i: t for t, i in tv.items()}
            first = min(i for i in set(by_id_d) | set(by_id_t) if by_id_d.get(i) != by_id_t.get(i))
            why = (f"token {first} is {by_id_d.get(first)!r} in the draft and "
                   f"{by_id_t.get(first)!r} in the target")
    if why is not None:
        raise ConfigError("speculative.draft", f"the draft {draft.model_id} and the target "
                          f"{target.model_id} have different vocabularies ({why}); a draft must "
                          f"use the target's tokenizer")
