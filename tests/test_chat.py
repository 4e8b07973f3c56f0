"""``twophase chat``: answers stream as the model's own greedy output for the whole
conversation so far; /reset forgets it; a refused turn leaves the conversation as it was."""

from __future__ import annotations

import io

import pytest
from helpers.models import tiny_llm

from twophase import SamplingParams
from twophase.cli.chat import chat, cut_notice

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

    def answer(messages) -> tuple[str, list[str]]:
        """The answer, and the notice chat prints after it where max_tokens cut it."""
        o = default_llm.generate(tok.apply_chat_template(messages), GREEDY)[0]
        return o.text, [cut_notice(GREEDY)] if o.finish_reason == "length" else []

    first = [{"role": "user", "content": "What is the capital of France?"}]
    a1, cut1 = answer(first)
    both = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of Spain?"}]
    a2, cut2 = answer(both)
    fresh, cut3 = answer([both[-1]])
    assert a2 != fresh                      # the history changes the answer: the test can tell
    assert cut1 or cut2 or cut3             # 12 tokens cut some answer: the notice is tested
    status, text = _talk(default_llm, ["What is the capital of France?", "And of Spain?", "/reset",
                                       "And of Spain?", "/exit"])
    assert status == 0
    assert text.splitlines()[1:] == [a1, *cut1, a2, *cut2, "(a new conversation)", fresh, *cut3]


def test_a_refused_turn_keeps_the_conversation(default_llm):
    status, text = _talk(default_llm, ["x " * 100_000, "Hi"])
    hi = default_llm.generate(default_llm.apply_chat_template("Hi"), GREEDY)[0].text
    header, refused, answer, eof = text.split("\n")[:4]
    assert status == 0 and refused.startswith("(refused: ") and "/reset" in refused
    assert answer == hi and eof == ""


def test_a_model_without_a_chat_template_is_told_what_to_use():
    status, text = _talk(tiny_llm(), ["hi"])
    assert status == 2 and "no chat template" in text and "twophase run --prompt" in text
