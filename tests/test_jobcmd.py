"""``gpuslo job`` and ``gpuslo rightsize`` end to end on the demo's store: text, JSON, the HTML page,
exit codes and refusals; and the demo's own right-sizing summary and ``demo --json`` key."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gpuslo.agent.sim.fleet import SimConfig
from gpuslo.app.cli import EXIT_ERROR, EXIT_OK, main
from gpuslo.app.embedded import DemoResult

pytestmark = pytest.mark.integration  # slow (over 0.7 s): the demo's store


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code  # type: ignore[assignment]
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return int(rc or 0), out.out, out.err


def test_job_text_json_and_html(short_demo: tuple[SimConfig, DemoResult, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _, res, _ = short_demo
    store = str(res.store_dir)
    job = res.summary.top_idle[0].id  # the demo's suggestion
    rc, out, err = _run(["job", job, "--store", store, "--html", str(tmp_path / "j.html")], capsys)
    assert rc == EXIT_OK, err
    for part in ("gpuslo job report", f"Job:           {job}", "Overall utilization", "Per GPU", "Notes"):
        assert part in out
    page = (tmp_path / "j.html").read_text()
    assert page.startswith("<!doctype html>") and f"gpuslo job report: {job}" in page and "<svg" in page
    assert not re.search(r"<script|\b(src|href)=", page), "self-contained: no scripts, no external assets"
    rc, out, err = _run(["job", job, "--store", store, "--json"], capsys)
    assert rc == EXIT_OK, err
    data = json.loads(out)
    for key in ("cluster", "id", "user", "account", "queue", "from", "to", "gpus", "held_gpu_hours",
                "idle_gpu_hours", "idle_share", "wait_s", "starvation", "rightsize", "notes"):  # fmt: skip
        assert key in data, key
    assert data["id"] == job and data["gpus"] and data["gpus"][0]["series"]
    top = res.summary.top_idle[0]  # the same numbers as the engine's summary over the job's life
    assert data["idle_gpu_hours"] == pytest.approx(top.idle_gpu_hours, abs=1e-3)


def test_job_refusals(short_demo: tuple[SimConfig, DemoResult, Path], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _, res, _ = short_demo
    store = str(res.store_dir)
    rc, _, err = _run(["job", "no-such-job", "--store", store], capsys)
    assert rc == EXIT_ERROR and "gpuslo job: no job 'no-such-job'" in err
    rc, _, err = _run(["job", "x" * 300, "--store", store], capsys)
    assert rc == EXIT_ERROR and "300 characters" in err
    rc, _, err = _run(["job", "1", "--store", str(tmp_path / "none")], capsys)
    assert rc == EXIT_ERROR and "no such store directory" in err
    rc, _, err = _run(["job", "1", "--store", store, "--from", "10", "--to", "5"], capsys)
    assert rc == EXIT_ERROR and "--to must be after --from" in err
    for bad in ("1", "-0.1", "nan", "x"):
        rc, _, err = _run(["job", "1", "--store", store, "--headroom", bad], capsys)
        assert rc == EXIT_ERROR and "--headroom" in err
    job = res.summary.top_idle[0].id
    rc, _, err = _run(
        ["job", job, "--store", store, "--html", str(tmp_path / "no" / "dir" / "x.html")], capsys
    )
    assert rc == EXIT_ERROR and "cannot write --html" in err and "No such file or directory" in err


def test_rightsize_and_the_demo(short_demo: tuple[SimConfig, DemoResult, Path],
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    sim, res, _ = short_demo
    argv = [
        "rightsize",
        "--store",
        str(res.store_dir),
        "--from",
        f"{sim.start_ts:.0f}",
        "--to",
        f"{sim.end_ts:.0f}",
    ]
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == EXIT_OK, err
    data = json.loads(out)
    assert set(data) >= {"accounts", "jobs", "jobs_advised", "give_back_gpu_hours", "no_advice", "headroom"}
    assert data["give_back_gpu_hours"] == pytest.approx(
        sum(a["give_back_gpu_hours"] for a in data["accounts"])
    )
    assert len(data["jobs"]) == len({j["id"] for j in data["jobs"]})
    rc, out, _ = _run(argv, capsys)
    assert rc == EXIT_OK and "MIG right-sizing" in out and "Total:" in out
    # demo --json carries the same advice under `rightsize`
    js = res.to_json()
    assert js["rightsize"]["give_back_gpu_hours"] == data["give_back_gpu_hours"]
    assert js["rightsize"]["jobs_advised"] == data["jobs_advised"]
    from gpuslo.app.jobtext import demo_lines

    lines = demo_lines(res, sim)
    assert lines[0].startswith(f"job report: gpuslo job {res.summary.top_idle[0].id} --store ")
    assert lines[1].startswith(f"right-size: {data['jobs_advised']} of {len(data['jobs'])} jobs")


def test_the_dashboard_panel_gives_the_same_advice(short_demo: tuple[SimConfig, DemoResult, Path]) -> None:
    from gpuslo.dashboards.rightsizing import panels
    from gpuslo.ingest.store import ChdbStore
    from gpuslo.rules.config import example
    from gpuslo.rules.rightsize import rightsizing
    from tests.grafana import expand

    sim, res, _ = short_demo
    (spec,) = panels(example())
    store = ChdbStore(res.store_dir)
    try:
        rows = store.query(expand(spec.sql, sim.start_ts, sim.end_ts))
        rz = rightsizing(store, sim.start_ts, sim.end_ts)
    finally:
        store.close()
    per_account: dict[str, list[float]] = {}
    for j in rz.jobs:
        acc = per_account.setdefault(j.account, [0, 0, 0.0])
        acc[0] += 1
        acc[1] += j.profile is not None
        acc[2] += j.give_back_gpu_hours
    assert {r["account"]: (r["jobs"], r["would_fit"]) for r in rows} == {
        a: (v[0], v[1]) for a, v in per_account.items()
    }
    for r in rows:
        assert r["give_back_gpu_h"] == pytest.approx(per_account[r["account"]][2], abs=0.01)


def test_job_by_slurms_array_task_name(short_demo: tuple[SimConfig, DemoResult, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``gpuslo job 77_3`` (the name squeue's text and sacct give an array task) reports the job
    recorded by its own id, which scontrol gives; a name Slurm does not know is one clear line.
    scontrol and sacct here answer as the 22.05 ones do (recorded output and errors)."""
    _, res, _ = short_demo
    store = str(res.store_dir)
    job = res.summary.top_idle[0].id
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f'if [ "$4" = 77_3 ]; then echo "JobId={job} ArrayJobId=77 ArrayTaskId=3 JobName=train"; exit 0; fi\n'
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n'
    )
    (bin_dir / "sacct").write_text(
        '#!/bin/sh\necho "sacct: error: Slurm accounting storage is disabled" >&2; exit 1\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    rc, out, err = _run(["job", "77_3", "--store", store, "--json"], capsys)
    assert rc == EXIT_OK, err
    assert json.loads(out)["id"] == job and f"77_3 is job {job}" in err
    rc, out, err = _run(["job", "77_4", "--store", store], capsys)
    assert rc == EXIT_ERROR and "gpuslo job: '77_4' is Slurm's name of an array task" in err
    assert "sacct -X -n -o JobIDRaw -j 77_4" in err and out == ""
