"""Sampling (edgellm/run/sampling.py): greedy by default, draws that follow the warped distribution,
seeds that repeat, stop strings held back until they are known, and ranges refused by name."""

import pytest
import torch

from edgellm.run.sampling import Sampler, Sampling, StopText

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(sampling: Sampling, n: int = 4000, history=(5,)) -> torch.Tensor:
    sampler = Sampler(sampling)
    return torch.bincount(torch.tensor([sampler(LOGITS, list(history)) for _ in range(n)]),
                          minlength=len(LOGITS)).float() / n


def test_greedy_is_the_default_and_is_the_argmax():
    assert Sampling().temperature == 0
    assert Sampler(Sampling())(LOGITS, [0]) == 0
    assert Sampler(Sampling(repetition_penalty=10.0))(LOGITS, [0]) == 1  # token 0 seen: penalised


@pytest.mark.parametrize("temperature", [1e-282, 5e-324, 1e-39])
def test_a_temperature_too_small_for_floats_is_its_limit_greedy(temperature):
    """Logits over a vanishing temperature overflow float32 (or it is 0 there, and 0 / 0 is nan):
    the draw is the argmax, the limit as the temperature goes to 0 (a server answered such a
    request with a 500)."""
    assert Sampler(Sampling(temperature=temperature, seed=0))(LOGITS, [5]) == 0


def test_draws_follow_the_tempered_and_truncated_distribution():
    """temperature 2: softmax(logits / 2); top_k 2: the two likeliest renormalised; top_p 0.6:
    the smallest set whose mass reaches 0.6; min_p 0.5: those at least half the likeliest."""
    p = torch.softmax(LOGITS / 2, -1)
    assert torch.allclose(draws(Sampling(temperature=2.0, seed=0)), p, atol=0.03)
    two = torch.zeros_like(p)
    two[:2] = p[:2] / p[:2].sum()
    assert torch.allclose(draws(Sampling(temperature=2.0, top_k=2, seed=1)), two, atol=0.03)
    q = torch.softmax(LOGITS, -1)  # 0.57, 0.21, ...: top_p 0.6 keeps the first two
    kept = torch.zeros_like(q)
    kept[:2] = q[:2] / q[:2].sum()
    assert torch.allclose(draws(Sampling(temperature=1.0, top_p=0.6, seed=2)), kept, atol=0.03)
    half = torch.zeros_like(q)  # q[1] / q[0] = e^-1 < 0.5: only the likeliest is left
    half[0] = 1
    assert torch.equal(draws(Sampling(temperature=1.0, min_p=0.5, seed=3), n=200), half)


def test_a_seed_repeats_its_draws_and_another_does_not():
    def run(seed):
        sampler = Sampler(Sampling(temperature=1.5, seed=seed))
        return [sampler(LOGITS, [0]) for _ in range(64)]

    assert run(7) == run(7) and run(7) != run(8)


def test_stop_strings_are_held_back_until_known_and_left_out():
    stop = StopText(("END", "\n\n"))
    shown = [stop.add(p) for p in ("Hello E", "X then E", "N", "D and more")]
    assert shown == ["Hello ", "EX then ", "", ""] and stop.stopped
    assert stop.text == "Hello EX then "
    tail = StopText(("END",))
    assert tail.add("almost EN") == "almost " and tail.rest() == "EN" and not tail.stopped


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.5, "a number >= 0 (0: greedy)"),
    ("top_p", 0.0, "a number in (0, 1] (1: off)"),
    ("top_k", -1, "an integer >= 0 (0: off)"),
    ("min_p", 1.5, "a number in [0, 1] (0: off)"),
    ("repetition_penalty", 0.0, "a number > 0 (1: off)"),
    ("max_tokens", 0, "an integer >= 1"),
])
def test_out_of_range_values_are_named_with_what_is_allowed(field, value, allowed):
    assert Sampling(**{field: value}).problems() == [
        f"{field}: {value} is out of range; give {allowed}"]


def test_keyword_options_are_checked_by_name():
    """edgellm.generate(..., temprature=1) is refused naming the known options; a single stop
    string is one string, not its characters."""
    from edgellm.errors import InputError

    with pytest.raises(InputError, match=r"unknown sampling option\(s\) temprature; known: "
                       r"max_tokens, min_p, repetition_penalty, seed, stop, temperature"):
        Sampling.of(temprature=1.0)
    assert Sampling.of(stop="END").stop == ("END",)
