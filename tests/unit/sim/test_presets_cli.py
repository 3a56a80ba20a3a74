"""Presets reproduce what their sources publish; the command's output and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from unbroken.cli import main
from unbroken.sim.model import closed_form
from unbroken.sim.presets import BUILDERS, load_preset


def test_ft_hsdp_preset_gives_the_published_44_and_80_percent(tmp_path: Path) -> None:
    preset = load_preset("ft-hsdp", tmp_path)
    assert closed_form(preset.cluster, preset.policies["synchronous"]).ettr == pytest.approx(0.44, abs=0.03)
    assert closed_form(preset.cluster, preset.policies["ft-hsdp"]).ettr == pytest.approx(0.80, abs=0.03)


def test_llama3_preset_stays_above_90_percent(tmp_path: Path) -> None:
    preset = load_preset("llama3", tmp_path)
    assert closed_form(preset.cluster, preset.policies["synchronous"]).ettr > 0.90


def test_meta_table_follows_the_first_order_reference(tmp_path: Path) -> None:
    preset = load_preset("meta-16k", tmp_path)
    assert [m for m, _, _ in preset.table] == [2.0, 10.0, 30.0]
    values = [closed_form(preset.cluster, policy).ettr for _, policy, _ in preset.table]
    assert values == sorted(values, reverse=True)
    for value, (_, _, reference) in zip(values, preset.table):
        assert value == pytest.approx(reference, abs=0.03)


def test_unknown_preset_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_preset("nope", tmp_path)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_preset_compares_the_three_policies(name: str, tmp_path: Path) -> None:
    assert {"synchronous", "ft-hsdp", "unbroken"} <= set(load_preset(name, tmp_path).policies)


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["simulate", "goodput", *args])
    return result.exit_code, result.output


def test_json_output_has_the_documented_fields(tmp_path: Path) -> None:
    code, out = _run("--preset", "ft-hsdp", "--json", "--years", "0.05", "--runs", "2",
                     "--bench-dir", str(tmp_path))
    assert code == 0, out
    data = json.loads(out)
    assert data["preset"] == "ft-hsdp" and data["gpus"] == 100_000
    for name in ("synchronous", "ft-hsdp", "unbroken"):
        entry = data["policies"][name]
        assert 0 <= entry["ettr"] <= 1
        assert entry["ettr"] + sum(entry["lost"].values()) == pytest.approx(1.0, abs=1e-3)
    assert data["assumptions"] and data["unbroken_figures"]


def test_plot_is_written(tmp_path: Path) -> None:
    target = tmp_path / "ettr.png"
    code, out = _run("--preset", "llama3", "--years", "0.05", "--runs", "2", "--plot", str(target),
                     "--bench-dir", str(tmp_path))
    assert code == 0, out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-replicas", "20"], "fewer than min_replicas"),
        (["--failures-per-1000-node-days", "-1"], "must not be negative"),
        (["--burst-prob", "2"], "probability"),
        (["--runs", "1"], "runs must be at least 2"),
    ],
)
def test_bad_parameters_are_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    code, out = _run("--bench-dir", str(tmp_path), *args)
    assert code == 2
    assert message in out
