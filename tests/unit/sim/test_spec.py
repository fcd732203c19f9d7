"""Fleet files: loading, template expansion, validation and the shipped fleets."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foretoken.core.checks import U64_MASK
from foretoken.sim.spec import (
    FleetSpecError,
    TruthSpec,
    load_fleet,
    parse_fleet,
    shipped_fleets,
)

# The Mooncake trace's largest prompt + output, in tokens (measured on data/traces).
MOONCAKE_LONGEST_TOKENS = 126_527

ENGINE = """
[[engines]]
id = "e"
model = "m"
{extra}
[engines.kv]
gpu_blocks = 64
{kv}
[engines.scheduler]
max_num_batched_tokens = 512
{scheduler}
[engines.truth]
prefill_a_s_per_token = 1e-5
prefill_b_s_per_token2 = 1e-9
seed = 5
{truth}
"""


def fleet_text(extra: str = "", kv: str = "", scheduler: str = "", truth: str = "") -> str:
    return ENGINE.format(extra=extra, kv=kv, scheduler=scheduler, truth=truth)


# --------------------------------------------------------------------------- loading


def test_a_minimal_engine_gets_the_documented_defaults() -> None:
    fleet = parse_fleet(fleet_text(), source="fleets/tiny.toml")
    assert fleet.name == "tiny"
    (engine,) = fleet.engines
    assert (engine.id, engine.model, engine.block_size, engine.eagle) == ("e", "m", 16, False)
    assert engine.scheduler.max_num_batched_tokens == 512
    assert engine.scheduler.long_prefill_token_threshold == 0
    assert engine.tiers == ("GPU",)
    assert engine.truth.noiseless and engine.truth.seed == 5


def test_count_replicates_a_template_with_suffixed_ids_and_offset_seeds() -> None:
    fleet = parse_fleet(fleet_text(extra="count = 3\nhash_seed = 40"))
    assert [e.id for e in fleet.engines] == ["e-0", "e-1", "e-2"]
    assert [e.truth.seed for e in fleet.engines] == [5, 6, 7]
    assert [e.effective_hash_seed for e in fleet.engines] == [40, 41, 42]
    assert len({e.config_hash for e in fleet.engines}) == 1


def test_hash_seeds_default_to_one_per_engine_id() -> None:
    fleet = parse_fleet(fleet_text(extra="count = 4"))
    seeds = [e.effective_hash_seed for e in fleet.engines]
    assert len(set(seeds)) == 4 and all(0 <= s <= U64_MASK for s in seeds)
    assert seeds == [
        e.effective_hash_seed for e in parse_fleet(fleet_text(extra="count = 4")).engines
    ]


def test_tiers_follow_the_kv_capacities() -> None:
    fleet = parse_fleet(fleet_text(kv="cpu_blocks = 128\nshared_blocks = 512"))
    assert fleet.engines[0].tiers == ("GPU", "CPU", "SHARED")
    assert fleet.engines[0].kv.lower_tiers() == (("CPU", 128), ("SHARED", 512))


def test_config_hash_changes_with_settings_but_never_with_the_truth() -> None:
    base = parse_fleet(fleet_text()).engines[0]
    other_truth = parse_fleet(fleet_text(truth="step_overhead_s = 0.5")).engines[0]
    other_budget = parse_fleet(fleet_text(scheduler="max_num_seqs = 3")).engines[0]
    assert base.config_hash == other_truth.config_hash
    assert base.config_hash != other_budget.config_hash


def test_prefill_cost_is_the_quadratic_curve_and_chunks_pay_for_their_context() -> None:
    truth = TruthSpec(prefill_a_s_per_token=2.0, prefill_b_s_per_token2=0.5)
    assert truth.prefill_s(10) == 2.0 * 10 + 0.5 * 100
    # Tokens 10..20 cost C(20) - C(10) = (40 + 200) - (20 + 50).
    assert truth.chunk_prefill_s(10, 20) == 170.0


def test_load_fleet_by_path_and_by_shipped_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(fleet_text())
    assert load_fleet(path).name == "mine"
    assert load_fleet("small").name == "small"
    with pytest.raises(FleetSpecError, match="cannot read"):
        load_fleet(tmp_path / "missing.toml")


# --------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engines = [", "not valid TOML"),
        ("name = 'x'", "missing required field `engines`"),
        ("engines = []", "at least one"),
        (fleet_text(extra="blocksize = 3"), "unknown field `blocksize` - at `$.engines[0]`"),
        (fleet_text(extra="block_size = '16'"), "Expected `int`, got `str`"),
        (fleet_text(extra="block_size = 0"), "block_size must be >= 1"),
        (fleet_text(extra="count = 0"), "count must be within 1..4096"),
        (fleet_text(extra="count = 100000000"), "count must be within 1..4096"),  # minutes
        (fleet_text(extra="kv_hash_algo = 'md5'"), "kv_hash_algo must be one of"),
        (fleet_text(kv="cpu_blocks = -1"), "kv.cpu_blocks must be >= 0 - at `$.engines[0].kv`"),
        (fleet_text(kv="shared_blocks = 0"), "kv.shared_blocks must be >= 1"),
        (fleet_text(scheduler="max_num_seq = 3"), "unknown scheduler setting(s) ['max_num_seq']"),
        (fleet_text(scheduler="max_num_seqs = 0"), "max_num_seqs must be >= 1"),
        (fleet_text(truth="noise_sigma = -0.1"), "noise_sigma must be finite and >= 0"),
        (fleet_text(truth="stall_probability = 1.5"), "stall_probability must be in [0, 1]"),
        (fleet_text(truth="decode_s_per_token = 1"), "unknown field `decode_s_per_token`"),
        (fleet_text(extra="count = 2") + fleet_text().replace('"e"', '"e-1"'), "duplicate"),
    ],
)
def test_bad_files_are_refused_with_a_clear_reason(text: str, message: str) -> None:
    with pytest.raises(FleetSpecError) as caught:
        parse_fleet(text, source="bad.toml")
    assert str(caught.value).startswith("bad.toml: ")
    assert message in str(caught.value)


def test_a_missing_truth_table_is_an_error() -> None:
    text = fleet_text().split("[engines.truth]")[0]
    with pytest.raises(FleetSpecError, match="missing required field `truth`"):
        parse_fleet(text)


# --------------------------------------------------------------------------- shipped fleets


def test_every_shipped_fleet_loads() -> None:
    assert set(shipped_fleets()) >= {"small", "hetero", "demo"}
    for name in shipped_fleets():
        fleet = load_fleet(name)
        assert fleet.name == name and fleet.engines


def test_small_fleet_is_small_and_fast() -> None:
    fleet = load_fleet("small")
    assert 2 <= len(fleet.engines) <= 3 and fleet.models() == ("sim-small",)
    for engine in fleet.engines:
        assert engine.truth.prefill_s(1000) < 0.1


def test_hetero_fleet_lets_the_mooncake_trace_drive_every_worker() -> None:
    fleet = load_fleet("hetero")
    assert 7 <= len(fleet.engines) <= 9 and fleet.models() == ("kimi-sim",)
    for engine in fleet.engines:
        assert engine.kv.gpu_blocks * engine.block_size >= MOONCAKE_LONGEST_TOKENS
        assert 512 % engine.block_size == 0
    curves = {
        (e.truth.prefill_a_s_per_token, e.truth.prefill_b_s_per_token2) for e in fleet.engines
    }
    assert (3.0e-5, 3.7e-11) in curves and len(curves) >= 5
    reference = next(e for e in fleet.engines if e.truth.prefill_a_s_per_token == 3.0e-5)
    # 30·N + 37·N² with N in millions: cold 300k ≈ 12 s, cold 1M ≈ 1 min.
    assert reference.truth.prefill_s(300_000) == pytest.approx(12.33)
    assert reference.truth.prefill_s(1_000_000) == pytest.approx(67.0)
    assert sum(e.eagle for e in fleet.engines) == 1
    assert any("CPU" in e.tiers for e in fleet.engines)
    assert len({e.scheduler.max_num_batched_tokens for e in fleet.engines}) >= 3


def test_fleet_lookup_helpers() -> None:
    fleet = load_fleet("demo")
    first = fleet.engines[0]
    assert fleet.engine(first.id) is first
    assert fleet.engines_for(first.model) == fleet.engines
    with pytest.raises(KeyError):
        fleet.engine("nope")


@given(count=st.integers(1, 6), seed=st.integers(0, 1000), block_size=st.sampled_from([1, 16, 64]))
def test_expansion_keeps_every_other_field(count: int, seed: int, block_size: int) -> None:
    text = fleet_text(extra=f"count = {count}\nblock_size = {block_size}").replace(
        "seed = 5", f"seed = {seed}"
    )
    engines = parse_fleet(text).engines
    assert len(engines) == count
    for index, engine in enumerate(engines):
        assert engine.truth.seed == seed + index
        plain = msgspec.structs.replace(engine, id=engines[0].id, truth=engines[0].truth)
        assert plain == engines[0]


def test_a_prefill_that_costs_nothing_is_refused() -> None:
    """Both costs 0 passed, then the bench's capacity calibration divided by zero."""
    with pytest.raises(ValueError, match="costs nothing"):
        TruthSpec(prefill_a_s_per_token=0.0, prefill_b_s_per_token2=0.0)
    assert TruthSpec(prefill_a_s_per_token=0.0, prefill_b_s_per_token2=1e-9).prefill_s(100) > 0


@pytest.mark.parametrize("change", [{"noise_sigma": 1e6}, {"prefill_a_s_per_token": 1e30},
                                    {"stall_s": 1e12}])  # fmt: skip
def test_absurd_truths_are_refused(change: dict[str, float]) -> None:
    """A noise sigma of 1e6 made every step infinite: 'requests never completed' later."""
    with pytest.raises(ValueError, match="at most"):
        TruthSpec(**{"prefill_a_s_per_token": 1e-5, "prefill_b_s_per_token2": 0.0, **change})
