"""``partime soak``: a stream of thousands of samples leaves every process's memory flat."""

import json

from click.testing import CliRunner

from partime_tools.cli import main
from partime_tools.soak import summarise

GROWTH_MB = 8.0
"""Most any process may grow after the warm-up. A leak of one 64 KB sample (or activation, or
gradient) per tick would grow by 64 KB x 1,600 = 100 MB for inference, 30 MB for learning."""


def test_summarise_measures_from_the_end_of_the_warm_up():
    records = [
        {"sample": k, "rss_mb": {"caller": mb, "stage 0": 10.0}}
        for k, mb in [(1, 5.0), (50, 9.0), (100, 12.0), (150, 11.0)]
    ]
    assert summarise(records, 50) == {
        "caller": {"start_mb": 9.0, "end_mb": 11.0, "growth_mb": 3.0},
        "stage 0": {"start_mb": 10.0, "end_mb": 10.0, "growth_mb": 0.0},
    }


def test_a_short_soak_stays_flat_and_is_written(tmp_path):
    args = ["soak", "--inference-samples", "2000", "--learning-samples", "600", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "max growth MB" in result.output
    runs = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert [(run["mode"], run["samples"]) for run in runs] == [("inference", 2000), ("learning", 600)]
    for run in runs:
        assert set(run["summary"]) == {"caller", "stage 0"}  # the caller runs the last stage, stage 1
        assert run["sample_bytes"] == 64 * 1024
        assert len(run["records"]) >= 100 and run["records"][-1]["sample"] == run["samples"]
        for process, row in run["summary"].items():
            assert 50 < row["start_mb"] < 2000, (run["mode"], process, row)
            assert row["growth_mb"] < GROWTH_MB, (run["mode"], process, row)
