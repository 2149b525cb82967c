"""`python -m bench --baseline REV`: the rows measured with another revision's engine."""

from __future__ import annotations

import subprocess

import pytest

from bench.__main__ import main
from bench.baseline import KEY_LAYOUT_MODULE, ROOT, Baseline


def _first_commit_with_the_key_layout() -> str:
    added = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", KEY_LAYOUT_MODULE],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert added, f"no commit added {KEY_LAYOUT_MODULE}"
    return added[-1]


def test_a_baseline_from_before_the_key_layout_is_refused_as_measuring_nothing_comparable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = f"{_first_commit_with_the_key_layout()}~1"
    with pytest.raises(SystemExit) as refused:
        main(["--rows", "throughput", "--throughput-rows", "payments", "--baseline", before])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"--baseline {before}" in err and "measure nothing comparable" in err, err
    assert KEY_LAYOUT_MODULE in err


def test_a_baseline_with_the_key_layout_is_taken() -> None:
    assert not Baseline(_first_commit_with_the_key_layout()).predates_key_layout()
    assert not Baseline("HEAD").predates_key_layout()
