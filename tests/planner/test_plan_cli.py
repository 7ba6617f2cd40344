"""`diptych plan`, run as a process: its table and JSON, and a clear error with exit status 2 for each bad
input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.profile import save_profile
from tests.planner.hand_profile import hand_profile

WORKLOAD = ["--rate", "6", "--prompt-tokens", "256-1024", "--output-tokens", "16-64", "--requests", "300"]
SLO = ["--ttft-ms", "600", "--tpot-ms", "30"]


def diptych_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", "plan", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    save_profile(hand_profile(), path)
    return path


def test_plan_prints_both_fleets_and_which_wins(profile_path):
    result = diptych_plan("--profile", str(profile_path), *WORKLOAD, *SLO, "--max-workers", "20")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("split ") and ":" in line for line in lines)
    assert any(line.startswith("colocated ") for line in lines)
    assert any(" wins: cost " in line or line.startswith("a tie") for line in lines)
    assert "simulated " in result.stderr  # progress goes to stderr, not into the table
    # what is tried, when, and what the queueing model said first
    assert re.search(r"^  \[ *\d+\.\d s\] queueing model: split \d+ prefill \+ \d+ decode", result.stderr, re.M)
    assert re.search(r"^  \[ *\d+\.\d s\] trying \d+ colocated on \d+ requests$", result.stderr, re.M)
    assert "queueing model's first cut" in result.stdout


def test_plan_json_names_the_fleets_their_attainment_and_the_winner(profile_path):
    result = diptych_plan("--profile", str(profile_path), *WORKLOAD, *SLO, "--max-workers", "20", "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    split, colocated = found["split"], found["colocated"]
    assert split["prefill"] >= 1 and split["decode"] >= 1 and split["colocated"] == 0
    assert colocated["colocated"] >= 1 and split["attainment"] >= 0.9 and colocated["attainment"] >= 0.9
    expected = (
        "split" if split["cost"] < colocated["cost"] else "colocated" if colocated["cost"] < split["cost"] else "tie"
    )
    assert found["winner"] == expected
    assert found["slo"] == {"ttft_s": 0.6, "tpot_s": 0.03, "attainment": 0.9}


def test_a_preset_supplies_the_workload_and_the_slo(profile_path):
    result = diptych_plan(
        "--profile", str(profile_path), "--preset", "code", "--rate", "4", "--max-workers", "16", "--json"
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["workload"]["prefix_share"] == 0.8 and found["workload"]["rate_per_s"] == 4.0
    assert found["split"] is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "-1", "--prompt-tokens", "100", "--output-tokens", "10", *SLO], "arrival rate must be positive"),
        ([*WORKLOAD, *SLO, "--attainment", "0"], r"attainment target is a share in \(0, 1\]"),
        ([*WORKLOAD, *SLO, "--attainment", "1.2"], r"attainment target is a share in \(0, 1\]"),
        ([*WORKLOAD, *SLO, "--max-workers", "1001"], "2 to 1000 workers"),
        (["--prompt-tokens", "100", "--output-tokens", "10", *SLO], "without --preset, give --rate"),
        ([*WORKLOAD], "without --preset, give the SLO"),
        (["--rate", "1", "--prompt-tokens", "500-100", "--output-tokens", "10", *SLO], "1 <= low <= high"),
        ([*WORKLOAD, *SLO, "--prefix-share", "1.5"], r"prefix share is a fraction in \[0, 1\]"),
        ([*WORKLOAD, "--ttft-ms", "-5", "--tpot-ms", "30"], "must be positive"),
    ],
)
def test_bad_inputs_are_refused_with_a_specific_error(profile_path, args, message):
    result = diptych_plan("--profile", str(profile_path), *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("diptych plan: ")
    assert re.search(message, result.stderr), result.stderr


def test_a_missing_profile_names_the_command_that_measures_one(tmp_path):
    result = diptych_plan("--profile", str(tmp_path / "absent.json"), *WORKLOAD, *SLO)
    assert result.returncode == 2
    assert "no cost profile at" in result.stderr and "python -m bench.phase_costs" in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not JSON"),
        ('{"model": "m"}', "is not a cost profile"),
        (json.dumps({**hand_profile().to_json(), "prefill": []}), "at least one prefill and one decode"),
        (json.dumps({**hand_profile().to_json(), "max_running": 1024}), "max_running must not exceed token_budget"),
    ],
)
def test_a_malformed_profile_is_refused(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    result = diptych_plan("--profile", str(path), *WORKLOAD, *SLO)
    assert result.returncode == 2 and message in result.stderr, result.stderr
