"""Busy chains: prefill samples from consecutive first tokens of a never-idle worker."""

from __future__ import annotations

import pytest

from foretoken.core.cost.busy_chains import BusyChains
from foretoken.core.types import SchedulerSettings, WorkerId

W = WorkerId("w")
SETTINGS = SchedulerSettings(max_num_batched_tokens=1000, max_num_seqs=16)


def test_a_chain_of_a_step_budget_becomes_one_sample_less_its_steps() -> None:
    chains = BusyChains(budgets=1.0)
    assert chains.add(W, SETTINGS, 600, 0, 0.5, step_s=0.01, decoding=0) is None
    assert chains.add(W, SETTINGS, 800, 200, 0.4, step_s=0.01, decoding=0) is None
    # the next step's first token closes it: 1200 new tokens, 2 steps of overhead
    sample = chains.add(W, SETTINGS, 100, 0, 0.3, step_s=0.01, decoding=0)
    assert sample is not None
    assert sample.u == 1200 and sample.v == 600**2 + 800**2 - 200**2
    assert sample.seconds == pytest.approx(0.9 - 2 * 0.01)


def test_decoders_take_budget_and_a_prompt_of_the_same_step_joins_with_no_gap() -> None:
    chains = BusyChains(budgets=1.0)
    chains.add(W, SETTINGS, 900, 0, 0.6, step_s=0.02, decoding=500)
    chains.add(W, SETTINGS, 300, 0, 0.0, step_s=0.02, decoding=500)  # the same step
    sample = chains.add(W, SETTINGS, 10, 0, 0.1, step_s=0.02, decoding=500)
    assert sample is not None and sample.u == 1200
    # 500 decoders leave 500 tokens a step: ceil(1200 / 500) = 3 steps
    assert sample.seconds == pytest.approx(0.6 - 3 * 0.02)


def test_a_dropped_chain_starts_afresh() -> None:
    chains = BusyChains(budgets=1.0)
    chains.add(W, SETTINGS, 2000, 0, 1.0, step_s=0.01, decoding=0)
    chains.drop(W)
    assert not chains.has(W)
    assert chains.add(W, SETTINGS, 100, 0, 0.2, step_s=0.01, decoding=0) is None


def test_before_it_settles_a_clean_chain_is_a_sample_at_its_next_step() -> None:
    """Started on an idle engine (timed from the send), a chain needs no step budget of
    tokens; a prompt whose first token comes in the same step joins it first. A worker
    without chain samples yet takes it at the next step (``settle`` off)."""
    chains = BusyChains(budgets=1.0)
    assert chains.start_clean(W, SETTINGS, 300, 100, 0.05, ts=1.0, step_s=0.01,
                              decoding=2) is None  # fmt: skip
    assert chains.close_clean(W, SETTINGS, ts=1.0) is None  # the same step: not closed yet
    joined = chains.add(W, SETTINGS, 150, 0, 0.0, step_s=0.5, decoding=9, settle=False)
    assert joined is None
    sample = chains.close_clean(W, SETTINGS, ts=1.2)
    assert sample is not None and sample.u == 350 and sample.v == 300**2 - 100**2 + 150**2
    # one step, at the step cost and decoders of the chain's start
    assert sample.seconds == pytest.approx(0.05 - 0.01)
    assert not chains.has(W) and chains.close_clean(W, SETTINGS, ts=2.0) is None


def test_a_settled_clean_chain_takes_every_prompt_until_nothing_waits() -> None:
    """Prompts sent after the idle engine's first one share its steps, and their first
    tokens come later: the chain waits for them (``drained``) and is then exact."""
    chains = BusyChains(budgets=1.0)
    assert chains.start_clean(W, SETTINGS, 300, 0, 0.2, ts=1.0, step_s=0.01,
                              decoding=0) is None  # others still wait  # fmt: skip
    chains = BusyChains(budgets=1.0)
    chains.start_clean(W, SETTINGS, 300, 0, 0.2, ts=1.0, step_s=0.01, decoding=0)
    assert chains.add(W, SETTINGS, 400, 0, 0.15, step_s=0.01, decoding=0) is None
    sample = chains.add(W, SETTINGS, 500, 100, 0.1, step_s=0.01, decoding=0, drained=True)
    assert sample is not None and sample.u == 300 + 400 + 400
    assert sample.raw_s == pytest.approx(0.45) and sample.steps == 3
    assert not chains.has(W)


def test_a_settled_clean_chain_that_never_drains_ends_as_a_busy_one() -> None:
    chains = BusyChains(budgets=1.0)
    chains.start_clean(W, SETTINGS, 900, 0, 0.5, ts=1.0, step_s=0.01, decoding=0)
    for _ in range(4):  # CLEAN_BUDGETS budgets of tokens, and still prompts waiting
        assert chains.add(W, SETTINGS, 900, 0, 0.5, step_s=0.01, decoding=0) is None
    assert not chains.is_clean(W)
    sample = chains.add(W, SETTINGS, 10, 0, 0.1, step_s=0.01, decoding=0)
    assert sample is not None and sample.u == 4500 and sample.raw_s == pytest.approx(2.5)


def test_a_busy_chain_is_dropped_when_nothing_waits_and_is_not_closed_as_a_clean_one() -> None:
    chains = BusyChains(budgets=1.0)
    chains.add(W, SETTINGS, 600, 0, 0.5, step_s=0.01, decoding=0)
    assert chains.close_clean(W, SETTINGS, ts=5.0) is None and chains.has(W)
    # its start is not exact: a drained queue ends it without a sample
    assert chains.add(W, SETTINGS, 900, 0, 0.5, step_s=0.01, decoding=0, drained=True) is None
    assert not chains.has(W)


def test_first_tokens_a_fraction_of_a_millisecond_apart_are_one_step() -> None:
    """The router reads each stream on its own: one step's first tokens reach it apart."""
    chains = BusyChains(budgets=1.0)
    chains.add(W, SETTINGS, 600, 0, 0.5, step_s=0.01, decoding=0)
    chains.add(W, SETTINGS, 600, 0, 0.0004, step_s=0.01, decoding=0)
    sample = chains.add(W, SETTINGS, 10, 0, 0.1, step_s=0.01, decoding=0)
    assert sample is not None and sample.steps == 2  # ceil(1200 / 1000), not 3 first tokens


def test_a_chain_does_not_end_at_a_prompt_that_overtook_one_still_waiting() -> None:
    """A long prompt capped at the long-prefill threshold shares its steps with shorter
    prompts sent after it, whose first tokens come first. A chain cut at one of those would
    leave the long prompt's earlier chunks out of the next chain's time (its whole prefill
    read in its last few steps: ``a`` 10× too low); it goes on until the long one is in."""
    chains = BusyChains(budgets=1.0)
    assert chains.add(W, SETTINGS, 700, 0, 0.4, step_s=0.01, decoding=0, overtook=True) is None
    assert chains.add(W, SETTINGS, 700, 0, 0.4, step_s=0.01, decoding=0, overtook=True) is None
    # the overtaken prompt's first token: still open (the chain ends at the next step)
    assert chains.add(W, SETTINGS, 5000, 0, 0.3, step_s=0.01, decoding=0) is None
    sample = chains.add(W, SETTINGS, 100, 0, 0.2, step_s=0.01, decoding=0)
    assert sample is not None and sample.u == 700 + 700 + 5000
    assert sample.raw_s == pytest.approx(1.1)
    # without the overtaking, the same first tokens end a chain at the second prompt
    chains = BusyChains(budgets=1.0)
    chains.add(W, SETTINGS, 700, 0, 0.4, step_s=0.01, decoding=0)
    chains.add(W, SETTINGS, 700, 0, 0.4, step_s=0.01, decoding=0)
    early = chains.add(W, SETTINGS, 5000, 0, 0.3, step_s=0.01, decoding=0)
    assert early is not None and early.u == 1400
