"""``twophase chat``: an interactive conversation in the terminal, streamed token by token.

The whole conversation is the prompt of each turn (the model's chat template over every
message so far), so the prefix cache serves the earlier turns and only the new message is
prefilled. ``/reset`` starts over; ``/exit`` (or Ctrl-D) ends; Ctrl-C stops an answer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected
from twophase.llm import LLM

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) ends, Ctrl-C stops an answer"


def chat(llm: LLM, params: SamplingParams, read: Callable[[str], str] = input,
         out: TextIO = sys.stdout) -> int:
    """Run the conversation until the user ends it; returns the exit status."""
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        out.write(f"{llm.model.model_id} has no chat template: use `twophase run --prompt ...`\n")
        return 2
    out.write(f"chatting with {llm.model.model_id} ({HELP})\n")
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = []
            out.write("(a new conversation)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        answer = _answer(llm, tok.apply_chat_template(messages), params, out)
        if answer is None:
            messages.pop()                 # refused: the conversation stays as it was
        else:
            messages.append({"role": "assistant", "content": answer})


def _answer(llm: LLM, prompt: str, params: SamplingParams, out: TextIO) -> str | None:
    """Stream the model's answer to ``prompt``; None if the request was refused."""
    engine = llm.engine
    try:
        req_id = engine.add_request(prompt, params).request_id
    except RequestRejected as exc:
        out.write(f"(refused: {exc}; /reset starts a shorter conversation)\n")
        return None
    text, reason = [], None
    try:
        while engine.has_unfinished():
            for d in engine.step():
                if d.request_id == req_id:
                    out.write(d.text)
                    out.flush()
                    text.append(d.text)
                    reason = d.finish_reason or reason
    except KeyboardInterrupt:
        engine.abort(req_id)
        out.write(" (stopped)")
    out.write("\n")
    if reason == "length":
        out.write(f"{cut_notice(params)}\n")
    return "".join(text)


def cut_notice(params: SamplingParams) -> str:
    """What a turn cut at ``max_tokens`` says after it (the answer is not finished)."""
    return f"(cut at max_tokens = {params.max_tokens}; --max-tokens gives answers more room)"
