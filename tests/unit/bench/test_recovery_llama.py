"""``unbroken bench recovery --model llama``: its data-account figures and the options it refuses."""

from __future__ import annotations

from click.testing import CliRunner

from unbroken.bench.training.recovery import recovery, sample_account


def test_sample_account_is_the_last_committed_steps_account() -> None:
    rows = {
        0: [
            {"event": "ready", "t": 0.0},
            {"step": 8, "step_s": 1.0, "committed": True, "samples_skipped": 0, "samples_repeated": 0},
            {"step": 9, "step_s": 1.0, "committed": False, "samples_skipped": 99, "samples_repeated": 99},
        ],
        1: [{"step": 9, "step_s": 1.0, "committed": True, "samples_skipped": 8, "samples_repeated": 4}],
    }
    assert sample_account(rows) == {"samples_skipped": 8, "samples_repeated": 4}
    assert sample_account({0: []}) == {}


def test_llama_options_that_cannot_work_are_refused() -> None:
    runner = CliRunner()
    out = runner.invoke(recovery, ["--ranks-per-replica", "2"])
    assert out.exit_code == 2 and "use --model llama" in out.output
    out = runner.invoke(recovery, ["--model", "llama", "--api", "ddp"])
    assert out.exit_code == 2 and "FSDP2's hook" in out.output
    out = runner.invoke(recovery, ["--alternate-steps", "210"])
    assert out.exit_code == 2 and "add --model llama" in out.output
    out = runner.invoke(recovery, ["--model", "llama", "--alternate-steps", "30"])
    assert out.exit_code == 2 and "at least 40" in out.output
