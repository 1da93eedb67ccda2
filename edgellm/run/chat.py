"""`edgellm chat OUT`: a conversation with an exported program. On a terminal, a REPL that
streams each reply (`/reset` starts over, `/system TEXT` sets the system message and starts
over, Ctrl-C stops a reply, Ctrl-D leaves); otherwise each line of stdin is one user message
and each reply one line of stdout. Every turn is the whole conversation in the model's chat
template, of which the program prefills only what its caches do not hold yet (session.py).
"""

from __future__ import annotations

import sys

from ..errors import InputError
from .sampling import Sampling
from .session import Session

COMMANDS = "/reset starts over, /system TEXT sets the system message, Ctrl-D leaves"


def chat(target, n: int = 512, system: str | None = None, tokenizer=None, stdin=None,
         stdout=None, **sampling) -> list[dict]:
    """Talk to the program until stdin ends; returns the conversation's messages."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    session, options = Session(target, tokenizer), Sampling.of(max_tokens=n, **sampling)
    session.chat_template()  # none shipped: refused before the first turn
    terminal = stdin.isatty()
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if terminal:
        print(f"edgellm chat: {COMMANDS}", file=sys.stderr)
    while True:
        if terminal:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line == "/reset" or line.startswith("/system "):
            if line.startswith("/system "):
                start = [{"role": "system", "content": line[len("/system "):]}]
            messages = list(start)
            _note(terminal, "(a new conversation)")
        elif line.startswith("/"):
            _note(True, f"unknown command {line.split()[0]}: {COMMANDS}")
        elif line.strip():
            messages.append({"role": "user", "content": line})
            reply = _turn(session, messages, options, stdout, terminal)
            if reply is None:
                messages.pop()
            else:
                messages.append({"role": "assistant", "content": reply})
    if terminal:
        stdout.write("\n")
    return messages


def _turn(session: Session, messages: list[dict], options, stdout, terminal: bool):
    """One reply streamed to stdout; None when there was none (the conversation fills the
    context, or Ctrl-C on a terminal), after saying why."""
    try:
        run = session.generate(session.chat_ids(messages), options)
    except InputError as e:
        _note(True, f"{e} /reset starts over.")
        return None
    try:
        for piece in run:
            stdout.write(piece)
            stdout.flush()
    except KeyboardInterrupt:
        if not terminal:
            raise
        session.reset()  # stopped between the program's calls: what its caches hold is unknown
        stdout.write("\n")
        _note(True, "(stopped; that turn is dropped)")
        return None
    stdout.write("\n")
    stdout.flush()
    return run.text


def _note(show: bool, text: str) -> None:
    if show:
        print(text, file=sys.stderr, flush=True)
