"""``python -m bench send`` on a real broker at a small size: every codec this installation has
is measured, every Kafka message sent is read back (the bench refuses a run that reads fewer),
and each figure's ratios are to ``none`` and ``gzip`` of the same run."""

from __future__ import annotations

import json

import pytest

from bench import send

pytestmark = pytest.mark.integration


def test_bench_send_measures_every_codec_and_reads_back_what_it_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert send.main(["--batches", "40", "--timeout-s", "60"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "send" and out["batches"] == 40 and out["default"] == "zstd"
    codecs = [c for c in out if c in dict(send.CODECS)]
    assert codecs == send.available() and {"none", "gzip", "zstd"} <= set(codecs)
    for c in codecs:
        f = out[c]
        assert f["kafka_messages"] >= 41 + 1  # each heartbeat its own message; a pack holds many batches
        assert f["send_cpu_s_per_1000_batches"] > 0 and f["read_cpu_s_per_1000_batches"] > 0
        for base in ("none", "gzip"):
            b = out[base]
            assert f[f"ratio_bytes_vs_{base}"] == pytest.approx(
                f["bytes_per_batch"] / b["bytes_per_batch"], abs=1e-3
            )
    assert out["none"]["ratio_send_cpu_vs_none"] == 1.0 and out["gzip"]["ratio_read_cpu_vs_gzip"] == 1.0
    # compressed batches take less room on the broker than the same batches uncompressed
    assert out["zstd"]["bytes_per_batch"] < out["none"]["bytes_per_batch"] / 3
