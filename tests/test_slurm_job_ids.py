"""Job ids a user takes from Slurm (``gpuslo job 123_4``, ``123+1``): an array task or het job
component is named by its own job id in what the agent records (squeue --json's ``job_id``, the
job's cgroup), which is not the name squeue's text, sacct or a user gives; such a name is asked
of scontrol, then sacct, for that id (the real slurmctld: tests/test_slurm.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslo.agent.slurm import SlurmCli, raw_job_id


def _refused(argv: Any) -> str:
    """Slurm's commands as they fail: scontrol on an id slurmctld does not hold, sacct without
    accounting (recorded from the 22.05 cluster of tests/servers/slurm.py)."""
    import subprocess

    if argv[0] == "scontrol":
        raise subprocess.CalledProcessError(
            1, list(argv), "", "slurm_load_jobs error: Invalid job id specified\n"
        )
    raise subprocess.CalledProcessError(
        1, list(argv), "", "sacct: error: Slurm accounting storage is disabled\n"
    )


@pytest.mark.parametrize("text", [
    "123", "0", "ns/pod", "1_", "_1", "1__2", "1_[0-3]", "1_2_3", "1+2+3", "1_2 ", " 1_2", "1+2#x", "1_2#",
    "\uff11_\uff12", "1\u0663_2", "12345678901_1", "1_12345678901", "1_2#123456", "1_2\n", "1;2", "'1_2'",
])  # fmt: skip
def test_an_id_in_no_slurm_alias_form_is_looked_up_as_given(text: str) -> None:
    asked: list[Any] = []
    assert raw_job_id(text, SlurmCli(run=lambda argv: asked.append(argv) or "")) == (text, "")
    assert asked == []


@pytest.mark.parametrize(("text", "scontrol", "sacct", "want"), [
    ("1_0", "JobId=4 ArrayJobId=1 ArrayTaskId=0 JobName=arr\n", None, "4"),
    ("2+1", "JobId=3 HetJobId=2 HetJobOffset=1 JobName=het\n", None, "3"),
    ("1_0#2", "JobId=4 ArrayJobId=1 ArrayTaskId=0 JobName=arr\n", None, "4#2"),
    ("4294967294_0", "JobId=4294967290 ArrayJobId=4294967294 ArrayTaskId=0\n", None, "4294967290"),
    ("1_0", None, "4\n", "4"),  # gone from slurmctld: sacct's JobIDRaw
    ("1_0", "JobName=x\n", "4\n4.batch\n", "4"),
    ("1_0", None, None, None),
    ("1_0", "JobId=abc\n", "\n", None),
    ("1_0", None, "4_0\n", None),
])  # fmt: skip
def test_an_alias_is_asked_of_scontrol_then_sacct(text: str, scontrol: str | None, sacct: str | None,
                                                  want: str | None) -> None:  # fmt: skip
    def run(argv: Any) -> str:
        answer = scontrol if argv[0] == "scontrol" else sacct
        return _refused(argv) if answer is None else answer

    if want is None:
        with pytest.raises(ValueError, match=r"own job id here; gpuslo records a job by its own id"):
            raw_job_id(text, SlurmCli(run=run))
    else:
        assert raw_job_id(text, SlurmCli(run=run))[0] == want


def test_an_alias_without_slurm_here_is_a_clear_refusal() -> None:
    def run(argv: Any) -> str:
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    with pytest.raises(ValueError, match=r"'7\+1' is Slurm's name of a het job component"):
        raw_job_id("7+1", SlurmCli(run=run))
