"""``twophase chat``: answers stream as the model's own greedy output for the whole
conversation so far; /reset forgets it; a refused turn leaves the conversation as it was."""

from __future__ import annotations

import io

import pytest
from helpers.models import tiny_llm

from twophase import SamplingParams
from twophase.cli.chat import chat

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12)


def _talk(llm, lines: list[str], params=GREEDY) -> tuple[int, str]:
    feed = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    return chat(llm, params, read, out), out.getvalue()


def test_each_turn_answers_the_whole_conversation(default_llm):
    tok = default_llm.tokenizer
    first = [{"role": "user", "content": "What is the capital of France?"}]
    a1 = default_llm.generate(tok.apply_chat_template(first), GREEDY)[0].text
    both = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of Spain?"}]
    a2 = default_llm.generate(tok.apply_chat_template(both), GREEDY)[0].text
    fresh = default_llm.generate(tok.apply_chat_template([both[-1]]), GREEDY)[0].text
    assert a2 != fresh                      # the history changes the answer: the test can tell
    status, text = _talk(default_llm, ["What is the capital of France?", "And of Spain?", "/reset",
                                       "And of Spain?", "/exit"])
    assert status == 0
    assert text.splitlines()[1:] == [a1, a2, "(a new conversation)", fresh]


def test_a_refused_turn_keeps_the_conversation(default_llm):
    status, text = _talk(default_llm, ["x " * 100_000, "Hi"])
    hi = default_llm.generate(default_llm.apply_chat_template("Hi"), GREEDY)[0].text
    header, refused, answer, eof = text.split("\n")[:4]
    assert status == 0 and refused.startswith("(refused: ") and "/reset" in refused
    assert answer == hi and eof == ""


def test_a_model_without_a_chat_template_is_told_what_to_use():
    status, text = _talk(tiny_llm(), ["hi"])
    assert status == 2 and "no chat template" in text and "twophase run --prompt" in text
