"""A line benched in a process of its own answers the bench's calls as an in-process line does,
reports its errors, and goes away when closed; IREE (not the first line) is benched that way."""

from __future__ import annotations

import os

import pytest

from twophase.bench import run as bench_run
from twophase.bench import serving
from twophase.bench.isolated import IsolatedLine
from twophase.config import load_config

TINY = {"model": {"name": "tiny", "weights": "random"},
        "bench": {"prompt_lens": [16], "batch_sizes": [2], "decode_context": 16, "decode_steps": 3}}


def test_a_line_in_its_own_process_answers_rounds_and_serves():
    cfg = load_config(TINY)
    line = IsolatedLine(cfg, "torch")
    try:
        assert line._proc.pid != os.getpid() and line.load_time_s > 0
        assert line.prefill_round(16, 0, 0) > 0
        assert line.decode_round(2, 16, 3, 0) > 0
        requests = serving.synthetic(4, None, [4, 8], [2, 3], 512, 0)
        got = line.serve(cfg.scheduler, requests)
        assert got["requests"] == 4 and got["output_tokens"] >= 8
        with pytest.raises(RuntimeError, match="in its own process.*prefill sweep"):
            line.prefill_round(4096, 0, 0)                  # past the context: rejected
        assert line.decode_round(2, 16, 3, 1) > 0           # and it serves on after an error
    finally:
        line.close()
    assert not line._proc.is_alive()


def test_a_line_that_cannot_load_says_why():
    cfg = load_config({**TINY, "backend": {"options": {"nope": 1}}})
    with pytest.raises(RuntimeError, match="torch .in its own process.: ConfigError.*nope"):
        IsolatedLine(cfg, "torch")


def test_iree_is_benched_in_its_own_process_unless_it_is_the_first_line(monkeypatch):
    made = []
    monkeypatch.setattr(bench_run, "IsolatedLine", lambda cfg, name: made.append(name) or "isolated")
    monkeypatch.setattr(bench_run, "_bench_llm", lambda cfg, name: "here")
    cfg = load_config(TINY)
    assert bench_run._lines(cfg, ["torch", "iree"]) == {"torch": "here", "iree": "isolated"}
    assert bench_run._lines(cfg, ["iree", "torch"]) == {"iree": "here", "torch": "here"}
    assert made == ["iree"]
