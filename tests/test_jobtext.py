"""The per-job report's plain language and text, on reports built by hand (no store)."""

from __future__ import annotations

import shlex
from dataclasses import replace

from gpuslo.app.jobtext import bar, duration, report, sparkline, squeeze
from gpuslo.rules import jobreport as jr
from gpuslo.rules.rightsize import JobAdvice

T = 1_800_000_000.0


def _gpu(i: int, peak_act: float, peak_fb: float, share: float = 1.0) -> jr.JobGpu:
    return jr.JobGpu(node="n1", gpu=i, uuid=f"GPU-{i}", model="NVIDIA H100 80GB HBM3", mig_gi=None, mig_ci=None,
                     mig_profile=None, share=share, shared=False, held_gpu_hours=1.0, active_gpu_hours=peak_act,
                     idle_gpu_hours=0.0, idle_share=0.0, utilization=peak_act, peak_activity=peak_act,
                     peak_fb_mib=peak_fb, fb_total_mib=81920.0, samples=360, activity_samples=360,
                     first_sample=T, last_sample=T + 3600, series=())  # fmt: skip


def _report(gpus: tuple[jr.JobGpu, ...], **kw: object) -> jr.JobReport:
    r = jr.JobReport(cluster="c", scheduler="slurm", id="42", request_id="42", name="n", user="u", account="a",
                     queue="q", from_=T, to=T + 3600, bucket_s=60, submitted=T, started=T, ended=T + 3600,
                     end_state="COMPLETED", gpus_requested=float(len(gpus)), gpus=gpus, held_gpu_hours=len(gpus) * 1.0,
                     active_gpu_hours=0.0, idle_gpu_hours=0.0, idle_share=0.0, utilization=0.0, peak_fb_mib=None,
                     wait_s=0.0, starvation=None, rightsize=None, energy=None, idle_threshold=0.05, min_idle_s=0.0, notes=())  # fmt: skip
    return replace(r, **kw)  # type: ignore[arg-type]


def test_notes_in_plain_language() -> None:
    # all GPUs below the idle threshold throughout: one note for the job, not one per GPU
    r = _report((_gpu(0, 0.01, 40000.0), _gpu(1, 0.0, 40000.0)))
    assert jr.notes(r) == (
        "The job never used its GPUs: activity stayed below 5 % the whole time (2.00 GPU-hours held).",
    )
    # one of two idle; memory 3.1 GiB of 80 GiB on the other (under a quarter)
    r = _report((_gpu(0, 0.6, 3174.4), _gpu(1, 0.0, 40000.0)))
    n = jr.notes(r)
    assert n[0].startswith("1 of its 2 GPUs showed no activity (below 5 % throughout): GPU 1 on n1.")
    assert "Memory far below what was held on GPU 0 on n1: peak 3.1 GiB of 80.0 GiB." in n
    # half a GPU held: memory compared with the half (40 GiB); 12 GiB is more than a quarter of it
    assert not any(x.startswith("Memory") for x in jr.notes(_report((_gpu(0, 0.6, 12288.0, share=0.5),))))
    a = JobAdvice(cluster="c", id="42", name="n", user="u", account="a", queue="q", gpus=1, model="m",
                  mig_profile=None, held_gpu_hours=7.0, peak_fb_mib=3174.4, peak_activity=0.09, profile="1g.10gb",
                  slice_fraction=1 / 7, give_back_gpu_hours=6.0, reason=None)  # fmt: skip
    n = jr.notes(_report((_gpu(0, 0.09, 3174.4),), rightsize=a))
    assert ("This job would have fitted a MIG 1g.10gb slice (peak 3.1 GiB of memory, peak activity 9 % of the GPU): "
            "6.00 of its 7.00 GPU-hours could have gone to others.") in n  # fmt: skip
    assert jr.notes(_report((), started=None, ended=None)) == (
        "No GPU samples: the job has not started (it is still pending).",
    )
    assert (
        jr.notes(_report((), started=None))[0] == "No GPU samples: the job left the queue without starting."
    )


def test_text_pieces() -> None:
    assert sparkline([0.0, 0.5, 1.0, None, 2.0, -1.0]) == "▁▅█ █▁"
    assert sparkline([5.0], top=0) == "▁"
    assert squeeze([1.0, 3.0, None, 5.0], 2, mean=True) == [2.0, 5.0]
    assert squeeze([1.0, 3.0, None, None], 2, mean=False) == [3.0, None]
    assert squeeze([1.0], 5, mean=True) == [1.0]
    assert duration(None) == "-" and duration(59.6) == "00:01:00" and duration(90061) == "1-01:01:01"
    assert duration(20) == "00:00:20" and duration(float("nan")) == "-"
    from gpuslo.core.display import hms

    assert hms(20) == "00:00:20" and hms(None) == "–"  # the job page's wait: a 20 s wait was "0 min"
    assert (
        bar(0.5).startswith("[" + "|" * 20 + " " * 20 + "]")
        and bar(None).endswith("-")
        and bar(2.0).count("|") == 40
    )
    text = report(_report((_gpu(0, 0.6, 3174.4),)))
    assert "Job:           42" in text and "Per GPU" in text and "n1 GPU 0" in text


def test_the_command_a_notice_links_to() -> None:
    assert jr.command("1042") == "gpuslo job 1042"
    assert jr.command("ns/pod-0", "c 1") == "gpuslo job ns/pod-0 --cluster 'c 1'"
    assert shlex.split(jr.command("o'brien; rm -rf /", "x"))[2] == "o'brien; rm -rf /"
