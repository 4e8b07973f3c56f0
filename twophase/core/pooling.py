"""Embeddings: a prompt's final hidden states pooled into one vector, by the engine that generates.

A pooling request is prefill-only work: the scheduler admits and chunks it as any prompt (the
token budget, the pool, chunked prefill, preemption), but its chunks go to a backend call of
their own that returns the final norm's hidden states instead of logits
(``PrefillBatch.output = "hidden"``), and it is never sampled. The ``Pooler`` pools each chunk's
rows as they come (mean pooling sums over chunks), and after the prompt's last chunk the request
finishes with ``finish_reason = "stop"``, its vector in ``RequestOutput.embedding``, and its
blocks freed.

Pooling modes: ``last`` (the last token's hidden state: what decoder embedding models such as
Qwen3-Embedding use), ``mean`` (over every token), ``cls`` (the first token's), or ``model``:
what the model's folder ships in sentence-transformers' files (``modules.json`` and
``1_Pooling/config.json``; a ``Normalize`` module means L2-normalised), else ``last``,
unnormalised; a config naming a mode computed nowhere here (max, weighted mean) refuses
``model``, rather than pool otherwise than the model was trained to. Prefix caching: ``last``
may take a hit (the last token is always computed, since a hit always leaves one token to
compute); ``mean`` and ``cls`` need every position's hidden
state, so they never do (``Request.may_hit_prefix``), though their blocks are published for
others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from twophase.contract import Backend
from twophase.core.batch import prefill_batch
from twophase.core.engine_values import PreparedPrompt
from twophase.core.outputs import Delta, RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected

if TYPE_CHECKING:
    from twophase.core.kv_manager import KVManager
    from twophase.core.request import Request
    from twophase.core.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

Pooling = Literal["last", "mean", "cls"]
POOLINGS = ("last", "mean", "cls", "model")
# a pooling request's SamplingParams: never sampled; one token of headroom is not asked for
# (its input may fill the context), see ``prepare``
POOLED = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class PoolingParams:
    """How to make one embedding: ``pooling`` as the module's docstring says, and ``normalize``
    (L2 to unit length): None takes the model's config where ``pooling`` is "model", else False."""

    pooling: Literal["last", "mean", "cls", "model"] = "model"
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            exc = RequestRejected(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
            exc.param = "pooling"
            raise exc


@dataclass(frozen=True)
class PoolingConfig:
    """What a model's folder says about pooling (sentence-transformers' files)."""

    pooling: Pooling
    normalize: bool
    unsupported: str | None = None    # a mode the folder names that is computed nowhere here

    @classmethod
    def read(cls, folder: str | Path | None) -> PoolingConfig | None:
        """The folder's config: ``modules.json`` names a ``Pooling`` module's folder, whose
        ``config.json`` sets ``pooling_mode`` (``lasttoken``, ``mean`` or ``cls``; or, as
        sentence-transformers before v6 saved it, one ``pooling_mode_*`` flag); a ``Normalize``
        module normalises. None where the folder has none; where it pools in a way computed
        nowhere here (max, weighted mean, several modes at once) ``unsupported`` names it."""
        if folder is None or not (Path(folder) / "modules.json").is_file():
            return None
        modules = json.loads((Path(folder) / "modules.json").read_text())
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        if "Pooling" not in kinds:
            return None
        mode = _pooling_mode(json.loads((Path(folder) / kinds["Pooling"] / "config.json").read_text()))
        if not isinstance(mode, str) or mode not in MODES:
            log.warning("%s: pooling %r is not computed here: pooling 'model' is refused", folder, mode)
            return cls("last", "Normalize" in kinds, str(mode))
        return cls(MODES[mode], "Normalize" in kinds)


# sentence-transformers' pooling modes computed here
MODES: dict[str, Pooling] = {"lasttoken": "last", "mean": "mean", "cls": "cls"}


def _pooling_mode(cfg: dict) -> object:
    """A Pooling module's mode: ``pooling_mode`` (v6), else the one ``pooling_mode_<x>_token(s)``
    flag set (``lasttoken``, ``mean``, ``cls``...), else the list of those set."""
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        return mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
    on = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
          for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    return on[0] if len(on) == 1 else on


def resolve(params: PoolingParams, model: PoolingConfig | None) -> tuple[Pooling, bool]:
    """The pooling and normalisation a request gets."""
    if params.pooling != "model":
        return params.pooling, bool(params.normalize)
    if model is None:
        return "last", bool(params.normalize)
    if model.unsupported is not None:
        exc = RequestRejected(f"this model pools {model.unsupported!r} (its sentence-transformers "
                              f"config), which is not computed here: ask for pooling last, mean or cls")
        exc.param = "pooling"
        raise exc
    return model.pooling, model.normalize if params.normalize is None else params.normalize


def rejected(message: str) -> RequestRejected:
    """A refusal of an embedding's input (the request's field ``input``)."""
    exc = RequestRejected(message)
    exc.param = "input"
    return exc


def prepare_pooled(prompt: str | Sequence[int], encode: Callable[[str], list[int]] | None,
            vocab_size: int | None, max_model_len: int, fits: Callable[[int], str | None]) -> PreparedPrompt:
    """An input tokenised (``encode``: None where the model has no tokenizer) and checked
    (``RequestRejected`` naming ``input``): not empty, every id in the vocabulary, at most the
    context; ``fits(n)`` says why ``n`` tokens can never have their K/V in the pool, or None."""
    if isinstance(prompt, str):
        if encode is None:
            raise rejected("this model has no tokenizer: give inputs as token ids")
        ids = encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise rejected("the input is empty")
    vocab = vocab_size or math.inf
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise rejected(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise rejected(f"the input ({len(ids)} tokens) exceeds the model's context of "
                       f"{max_model_len} tokens (model.max_model_len)")
    why = fits(len(ids))
    if why is not None:
        raise rejected(why)
    return PreparedPrompt(tuple(ids), POOLED, prompt if isinstance(prompt, str) else None)


@dataclass
class _Pooled:
    """One request's pooling, and what its chunks have given so far."""

    pooling: Pooling
    normalize: bool
    total: torch.Tensor | None = None       # mean: the sum of the rows so far
    count: int = 0                          # rows summed
    first: torch.Tensor | None = None       # cls: position 0's row
    last: torch.Tensor | None = None        # the latest chunk's last row

    def add(self, start: int, rows: torch.Tensor) -> None:
        if start == 0:                      # the prompt from its start (again, after a preemption)
            self.total, self.count, self.first = None, 0, rows[0]
        if self.pooling == "mean":
            s = rows.sum(0)
            self.total = s if self.total is None else self.total + s
            self.count += rows.shape[0]
        self.last = rows[-1]

    def vector(self, num_tokens: int) -> list[float]:
        if self.pooling == "mean":
            assert self.total is not None and self.count == num_tokens, "mean pooling missed positions"
            v: torch.Tensor = self.total / self.count
        else:
            chosen = self.first if self.pooling == "cls" else self.last
            assert chosen is not None
            v = chosen
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()


class Pooler:
    """The engine's pooling requests: their chunks as a hidden-states call, their vectors."""

    def __init__(self, backend: Backend, model: PoolingConfig | None = None):
        self.backend = backend                  # the prefill backend
        self.model = model                      # the model folder's config, if it ships one
        self.requests: dict[str, _Pooled] = {}
        self._said = False

    def add(self, req: Request, params: PoolingParams) -> None:
        """Take ``req`` as a pooling request (``RequestRejected`` where the backend cannot)."""
        if not self.backend.capabilities().hidden_states:
            raise RequestRejected(f"embeddings: the {self.backend.name} backend does not return hidden states "
                                  f"(Capabilities.hidden_states); give prefill a backend that does: "
                                  f"[backend.prefill] name = \"torch\"")
        if params.pooling == "model" and self.model is None and not self._said:
            log.info("this model ships no pooling config (sentence-transformers' modules.json): "
                     "pooling 'model' is the last token's hidden state, unnormalised")
            self._said = True
        pooling, normalize = resolve(params, self.model)
        req.may_hit_prefix = pooling == "last"
        self.requests[req.request_id] = _Pooled(pooling, normalize)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def split(self, out: SchedulerOutput) -> tuple[SchedulerOutput, list[tuple[Request, int]]]:
        """``out`` without the pooling requests' chunks (what is sampled), and those chunks."""
        if not self.requests:
            return out, []
        pooled = [(r, n) for r, n in out.prefills if r.request_id in self.requests]
        if not pooled:
            return out, []
        rest = [(r, n) for r, n in out.prefills if r.request_id not in self.requests]
        return dataclasses.replace(out, prefills=rest), pooled

    def run(self, chunks: list[tuple[Request, int]], kv: KVManager) -> None:
        """The chunks' hidden states, in one call of the prefill backend, pooled."""
        if not chunks:
            return
        items = [(r, r.num_computed_tokens, n) for r, n in chunks]
        b = prefill_batch(items, kv)
        b.state_copies = kv.take_copies()       # where no sampled call took them first
        b.logits, b.output = "all", "hidden"
        hidden = self.backend.prefill(b).float().cpu()
        start = 0
        for req, first, n in items:
            self.requests[req.request_id].add(first, hidden[start:start + n])
            start += n

    def finish(self, chunks: list[tuple[Request, int]],
               end: Callable[[str], RequestOutput | None]) -> list[Delta]:
        """After the step is applied: the requests whose whole prompt is computed end
        (``end(request_id)`` retires one and gives its output), each with its vector."""
        deltas = []
        for req, _ in chunks:
            if req.num_computed_tokens < req.num_tokens:
                continue
            vector = self.requests[req.request_id].vector(req.num_tokens)
            output = end(req.request_id)
            if output is not None:
                output.embedding = vector
            deltas.append(Delta(req.request_id, [], "", [], "stop", output))
        return deltas
