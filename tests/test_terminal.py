"""Text from a model, a user or a file reaches the terminal as text: Rich markup in it is neither
applied nor an error."""

from __future__ import annotations

import io

from twophase import LLM
from twophase.cli import main, terminal

MARKUP = "Markup examples:\n[bold]Hello[/bold]\n[/]\n[bold] a[i] = b[i]"


def test_the_console_prints_markup_as_it_is():
    out = io.StringIO()
    c = terminal.console()
    c.file = out
    c.print(MARKUP)
    c.print(terminal.styled(("#0", "bold"), " ", MARKUP))
    assert out.getvalue() == MARKUP + "\n#0 " + MARKUP + "\n"


def test_run_prints_a_completion_with_markup_as_text(monkeypatch, capsys):
    """``twophase run`` on a completion whose text is Rich markup (and code with brackets): no
    MarkupError, nothing swallowed."""
    real = LLM.generate

    def generate(self, prompts, params=None, use_tqdm=False):
        outs = real(self, prompts, params)
        for o in outs:
            o.text = MARKUP
        return outs

    monkeypatch.setattr(LLM, "generate", generate)
    monkeypatch.setenv("COLUMNS", "200")
    rc = main(["run", "--model", "tiny", "--max-tokens", "2", "--prompt", "x", "--raw"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[bold]Hello[/bold]" in out and "[/]" in out and "a[i] = b[i]" in out
