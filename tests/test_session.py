"""Sessions (edgellm/run/session.py) and `edgellm chat`: a sequence that extends what the program's
caches hold prefills only its new tokens and gives the tokens a fresh run of the whole sequence
gives (greedy); the chat template ships with the export; the REPL reads a message a line."""

import io
import json

import pytest

import edgellm
from edgellm.cli import main
from edgellm.run.sampling import Sampling
from edgellm.run.session import Session

GREEDY = Sampling(max_tokens=6)


def fresh(folder, ids, sampling=GREEDY):
    return Session(folder).generate(ids, sampling).run()


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_sequence_that_extends_the_caches_prefills_only_its_new_tokens(exported, arch):
    """Turn two (turn one, its reply, a new message) runs on the caches turn one left: only its
    own tokens are prefilled, and its greedy tokens are a fresh run's. LFM2's conv state takes
    no shorter prefix: a sequence that departs from the caches starts again at 0; Llama's KV
    caches rewind to the shared prefix."""
    folder, _ = exported(arch)
    session = Session(folder)
    one = session.encode("the quick brown fox")
    first = session.generate(one, GREEDY)
    first.run()
    two = one + first.tokens + session.encode(" jumps over")
    held = len(session.fed)  # turn one and its reply, but the token sampled last (never fed)
    assert held >= len(one) + len(first.tokens) - 1
    second = session.generate(two, GREEDY)
    assert second.run() == fresh(folder, two)
    assert second.usage.cached_tokens == held and second.usage.prompt_tokens == len(two)
    other = one[:3] + session.encode(" lazy dog")  # departs from the caches at 3
    third = session.generate(other, GREEDY)
    assert third.run() == fresh(folder, other)
    assert third.usage.cached_tokens == (3 if arch == "llama" else 0)
    assert session.rewinds == (arch == "llama")


def test_the_chat_template_ships_with_the_export_and_renders_as_transformers_does(
        exported, tiny_models):
    from transformers import AutoTokenizer

    folder, _ = exported("llama")
    assert (folder / "chat_template.jinja").is_file()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    theirs = AutoTokenizer.from_pretrained(tiny_models["llama"][0]).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert Session(folder).chat_ids(messages) == list(theirs)


def test_chat_reads_a_message_a_line_and_keeps_the_conversation(exported, capsys, monkeypatch):
    """Not a terminal: each line a user message, each reply a line; /reset starts over; turn two
    is the whole conversation in the template, the same reply a fresh session gives it."""
    folder, _ = exported("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\nthe quick\n/reset\nhello world\n"))
    assert main(["chat", str(folder), "-n", "4"]) == 0
    lines = capsys.readouterr().out.split("\n")
    session = Session(folder)
    one = [{"role": "user", "content": "hello world"}]
    reply = session.generate(session.chat_ids(one), Sampling(max_tokens=4)).run()
    two = one + [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "the quick"}]
    again = fresh(folder, Session(folder).chat_ids(two), Sampling(max_tokens=4))
    assert lines[:4] == [reply, again, reply, ""]


def test_generate_samples_with_a_seed_and_stops_at_a_stop_string(exported, capsys):
    folder, _ = exported("llama")
    pte = folder / "model.pte"
    options = dict(n=12, temperature=1.5, top_k=20, seed=3)
    one = edgellm.generate(pte, "the quick", **options)
    assert one == edgellm.generate(pte, "the quick", **options)
    assert one != edgellm.generate(pte, "the quick", **{**options, "seed": 4})
    cut = one[2:4]
    stopped = edgellm.generate(pte, "the quick", stop=[cut], **options)
    assert stopped == one[:one.index(cut)]
    assert main(["generate", str(pte), "--prompt", "the quick", "-n", "12", "--temperature",
                 "1.5", "--top-k", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out == one + "\n"


def test_a_model_without_a_chat_template_is_refused_for_chat(
        exported, tmp_path, capsys, monkeypatch):
    """Refused by name, and `edgellm chat` refuses before reading a first message."""
    import shutil

    folder, _ = exported("llama")
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    with pytest.raises(edgellm.InputError, match="has no chat template .* use `edgellm "
                       "generate` with a plain prompt"):
        Session(bare).chat_ids([{"role": "user", "content": "hi"}])
    assert json.loads((bare / "report.json").read_text())  # the rest was copied
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(bare)]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_chat_on_a_terminal_streams_replies_and_takes_commands(exported):
    """On a terminal (a pty): a banner naming the commands, a `> ` prompt, each reply streamed,
    /system starting a new conversation, an unknown command named, Ctrl-D leaving with exit 0."""
    import os
    import pty
    import subprocess
    import sys
    import time

    folder, _ = exported("llama")
    session = Session(folder)
    one = [{"role": "user", "content": "hello world"}]
    reply = session.generate(session.chat_ids(one), Sampling(max_tokens=4)).run()
    main_fd, child_fd = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "chat", str(folder), "-n", "4"],
                             stdin=child_fd, stdout=child_fd, stderr=child_fd, close_fds=True)
    os.close(child_fd)
    seen = b""

    def until(text: bytes, timeout=60):
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, seen
            try:
                seen += os.read(main_fd, 4096)
            except OSError:  # the child closed the terminal
                break
        return seen

    until(b"> ")
    assert b"/reset starts over, /system TEXT sets the system message" in seen
    os.write(main_fd, b"hello world\n")
    until(reply.encode() + b"\r\n> ")
    os.write(main_fd, b"/system be brief\n")
    until(b"(a new conversation)")
    os.write(main_fd, b"/nope\n")
    until(b"unknown command /nope")
    os.write(main_fd, b"\x04")  # Ctrl-D at the prompt
    assert child.wait(30) == 0
    os.close(main_fd)
