"""Alert delivery under receiver faults: one queue per receiver, permanent and transient
failures told apart, no redirect followed, a total deadline per attempt, evaluation never
waiting, a restart resending exactly once, and receiver secrets kept out of logs and files."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslo.core.settings import RedactSecrets, redact_logs
from gpuslo.ingest.store import ChdbStore
from gpuslo.rules.alerts import Alert, AlertState, Engine, Notifier, outbox_file
from gpuslo.rules.delivery import Policy, ReceiverQueue
from gpuslo.rules.outbox import Outbox
from gpuslo.rules.receivers import Outcome, Receiver, ReceiverError, classify, from_sources, http_post
from tests.servers import receivers as rx
from tests.servers.alertmanager import Alertmanager


def page(i: int) -> Alert:
    return Alert({"alertname": "GpusloSLOBurn", "severity": "page", "slo": f"slo-{i}", "service": "chat", "window": "1h/5m"},
                 {"summary": f"page {i}"})  # fmt: skip


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Poll a condition on state (a generous bound against a hung test, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached: {what}"
        time.sleep(0.05)


@pytest.fixture
def servers() -> Iterator[dict[str, rx.Receiver]]:
    made = {
        "bad_request": rx.Receiver(status=400),
        "error": rx.Receiver(status=500),
        "redirect_target": rx.Receiver(status=200),
        "hang": rx.Receiver(behaviour="hang"),
        "trickle": rx.Receiver(behaviour="trickle"),
    }
    made["redirect"] = rx.Receiver(status=302, headers=(("Location", made["redirect_target"].url + "/x"),))
    yield made
    for s in made.values():
        s.close()


FAST = Policy(deadline_s=1.0, backoff_initial_s=0.2, backoff_max_s=0.5)
# a total deadline longer than the trickle's 1 s between bytes: a per-read timeout of that
# length would never fire, only a total deadline cuts the answer
TRICKLE = Policy(deadline_s=2.5, backoff_initial_s=0.2, backoff_max_s=0.5)


@pytest.mark.integration
def test_each_receiver_its_own_outcome_and_alertmanager_gets_every_page(
    store: ChdbStore,
    tmp_path: Path,
    servers: dict[str, rx.Receiver],
    make_alertmanager: Callable[..., Alertmanager],
) -> None:
    """A webhook answering 400 once made Alertmanager receive 1 of 3 pages; a 302 counted as
    sent; a trickling receiver held a delivery 39 s with a 5 s timeout."""
    am = make_alertmanager(tmp_path / "am")
    am.start()
    try:
        recv = {"am": Receiver.parse("alertmanager", am.url)} | {
            k: Receiver.parse("webhook", s.url + "/hook")
            for k, s in servers.items()
            if k != "redirect_target"
        }
        notifier = Notifier(tmp_path / "outbox", list(recv.values()), policy=TRICKLE)
        eng = Engine(AlertState(store), notifier)
        t = time.time() - 60  # past, within the firing notifications' hold (4 x 60 s)
        for i in range(3):  # three pages, three notifications per receiver
            r = eng.step([page(j) for j in range(i + 1)], t + i)
            assert r["new"] == 1 and r["queued"] == len(recv)

        def st(k: str) -> dict[str, object]:
            return notifier.stats()[recv[k].name]

        wait_for(
            lambda: len([a for a in am.alerts() if a["status"]["state"] == "active"]) == 3, "3 pages at AM"
        )
        wait_for(lambda: st("am")["sent"] == 3 and st("bad_request")["failed"] == 3 and st("redirect")["failed"] == 3,
                 "permanent outcomes")  # fmt: skip
        wait_for(
            lambda: all(int(st(k)["retries"]) >= 2 for k in ("error", "hang", "trickle")), "transient retries"
        )
        wait_for(lambda: bool(servers["trickle"].trickled), "the trickling receiver sees the client leave")
        notifier.close()
        s = notifier.stats()
        # Alertmanager: every page, nothing pending, whatever the others do
        assert {a["labels"]["slo"] for a in am.alerts()} == {"slo-0", "slo-1", "slo-2"}
        assert (s[recv["am"].name]["sent"], s[recv["am"].name]["pending"]) == (3, 0)
        # permanent: reported and dropped, never retried, nothing blocks
        for k, code in (("bad_request", 400), ("redirect", 302)):
            assert (s[recv[k].name]["failed"], s[recv[k].name]["pending"], s[recv[k].name]["sent"]) == (
                3,
                0,
                0,
            )
            assert s[recv[k].name]["retries"] == 0 and s[recv[k].name]["last_status"] == code
            assert len(servers[k].posts()) == 3  # one attempt each
        assert "redirect is not followed" in str(s[recv["redirect"].name]["last_error"])
        assert servers["redirect_target"].seen == []  # no GET (nor POST) to the Location
        # transient: kept in order, retried; the head blocks only its own receiver
        for k in ("error", "hang", "trickle"):
            assert (s[recv[k].name]["pending"], s[recv[k].name]["sent"], s[recv[k].name]["failed"]) == (
                3,
                0,
                0,
            )
            bodies = {p.body for p in servers[k].posts()}
            assert len(bodies) == 1  # always the first notification: order is kept
        assert s[recv["error"].name]["last_status"] == 500
        for k in ("hang", "trickle"):
            assert "total deadline of 2.5 s" in str(s[recv[k].name]["last_error"])
        # the total deadline, shown by state: the trickled answer was abandoned long before
        # its end (a per-read timeout would have waited for every byte of it)
        assert servers["trickle"].trickled[0] < servers["trickle"].answer_len // 4
    finally:
        am.stop()


def test_evaluation_never_waits_on_a_receiver(store: ChdbStore, tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()
    callers: list[threading.Thread] = []

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        callers.append(threading.current_thread())
        entered.set()
        release.wait(60)
        return Outcome("sent", 200, "")

    n = Notifier(tmp_path / "ob", [Receiver.parse("webhook", "http://127.0.0.1:9/h")], post=post)
    eng = Engine(AlertState(store), n)
    done = threading.Event()

    def evaluate() -> None:
        eng.step([page(1)], 1_790_000_000.0)
        eng.step([page(1), page(2)], 1_790_000_060.0)  # a second evaluation while the first is in flight
        done.set()

    threading.Thread(target=evaluate, daemon=True).start()
    assert entered.wait(30), "no delivery started"
    assert done.wait(30), "evaluation waited on a blocked receiver"
    assert not release.is_set()  # both evaluations finished while the delivery was still blocked
    assert callers[0] is not threading.main_thread()
    assert n.stats()[n.receivers[0].name]["pending"] == 2
    release.set()
    wait_for(lambda: n.stats()[n.receivers[0].name]["sent"] == 2, "both delivered")
    n.close()


@pytest.mark.parametrize(
    ("status", "kind"),
    [(200, "sent"), (201, "sent"), (202, "sent"), (204, "sent"), (299, "sent"),
     (100, "permanent"), (300, "permanent"), (301, "permanent"), (302, "permanent"), (303, "permanent"),
     (307, "permanent"), (308, "permanent"), (400, "permanent"), (401, "permanent"), (403, "permanent"),
     (404, "permanent"), (410, "permanent"), (413, "permanent"), (422, "permanent"), (499, "permanent"),
     (408, "transient"), (429, "transient"), (500, "transient"), (502, "transient"), (503, "transient"),
     (504, "transient"), (599, "transient"), (600, "permanent")],
)  # fmt: skip
def test_status_classes(status: int, kind: str) -> None:
    assert classify(status) == kind


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_no_redirect_is_followed_on_a_post(status: int) -> None:
    target = rx.Receiver(status=200)
    redir = rx.Receiver(status=status, headers=(("Location", target.url + "/elsewhere"),))
    try:
        out = http_post(Receiver.parse("webhook", redir.url + "/h"), b'{"text":"x"}', 5.0)
        assert (out.kind, out.status) == ("permanent", status)
        assert target.seen == [] and len(redir.posts()) == 1
    finally:
        target.close()
        redir.close()


def test_connection_refused_is_transient() -> None:
    dead = rx.Receiver()
    url = dead.url
    dead.close()
    assert http_post(Receiver.parse("webhook", url + "/h"), b"{}", 2.0).kind == "transient"


@pytest.mark.parametrize("watchdog", ["fires", "late"])
def test_the_deadline_reads_the_same_whichever_timer_fires_first(
    watchdog: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket's own timeout and the watchdog are both the deadline; on a loaded machine the
    timer thread runs late and the socket fires first. Either way: one outcome, one wording."""
    if watchdog == "late":
        import gpuslo.rules.receivers as receivers

        class Late(threading.Timer):
            def start(self) -> None:  # never fires within the attempt
                pass

        monkeypatch.setattr(receivers.threading, "Timer", Late)
    silent = rx.Receiver(behaviour="hang")
    try:
        out = http_post(Receiver.parse("webhook", silent.url + "/h"), b"{}", 0.5)
        assert (out.kind, out.status, out.detail) == (
            "transient",
            None,
            "no complete answer within the total deadline of 0.5 s",
        )
    finally:
        silent.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_to_its_cap_honours_retry_after_and_keeps_order(tmp_path: Path) -> None:
    answers = iter([Outcome("transient", 503, "x")] * 5 + [Outcome("transient", 429, "slow down", 7.0)]
                   + [Outcome("sent", 200, "")] * 3)  # fmt: skip
    posted: list[bytes] = []

    def post(r: Receiver, body: bytes, deadline_s: float) -> Outcome:
        posted.append(body)
        return next(answers)

    mono, wall = Clock(), Clock()
    r = Receiver.parse("webhook", "http://127.0.0.1:9/h")
    q = ReceiverQueue(
        r, Outbox(tmp_path / "o.jsonl"), Policy(backoff_initial_s=1, backoff_max_s=4), post, wall, mono
    )
    for i in range(3):
        assert q.put({"n": i})
    waits = []
    while q.outbox.head() is not None:
        d = q.due_in()
        assert d is not None
        waits.append(d)
        mono.t += d
        q.attempt()
    # 1, 2, 4, 4, 4 (cap), then Retry-After 7 beyond the cap is held to the cap 4
    assert waits == [0.0, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 0.0, 0.0]
    assert [json.loads(b)["n"] for b in posted] == [0, 0, 0, 0, 0, 0, 0, 1, 2]
    s = q.snapshot()
    assert (s["sent"], s["retries"], s["failed"], s["pending"]) == (3, 6, 0, 0)


def test_retry_after_below_the_cap_is_honoured(tmp_path: Path) -> None:
    answers = iter([Outcome("transient", 429, "", 3.0), Outcome("sent", 200, "")])
    mono = Clock()
    q = ReceiverQueue(Receiver.parse("webhook", "http://h/x"), Outbox(tmp_path / "o.jsonl"),
                      Policy(backoff_initial_s=1, backoff_max_s=60), lambda r, b, d: next(answers), Clock(), mono)  # fmt: skip
    q.put({"a": 1})
    q.attempt()
    assert q.due_in() == 3.0


def test_a_notification_past_its_max_age_expires_counted(tmp_path: Path) -> None:
    wall, mono = Clock(), Clock()
    q = ReceiverQueue(Receiver.parse("webhook", "http://h/x"), Outbox(tmp_path / "o.jsonl"), Policy(max_age_s=100),
                      lambda r, b, d: Outcome("transient", None, "down"), wall, mono)  # fmt: skip
    q.put({"a": 1})
    q.attempt()
    wall.t += 101
    mono.t += 1000
    q.attempt()
    s = q.snapshot()
    assert (s["expired"], s["pending"], s["retries"]) == (1, 0, 1)


def test_outbox_survives_a_torn_line_and_acknowledges_durably(tmp_path: Path) -> None:
    p = tmp_path / "d" / "r.jsonl"
    ob = Outbox(p)
    a, b = ob.add({"n": 1}, 1.0), ob.add({"n": 2}, 2.0)
    ob.done(a, "sent")
    with open(p, "ab") as f:
        f.write(b'{"id":"zz","queued_at":3.0,"payl')  # a crash in the middle of an append
    again = Outbox(p)
    assert again.corrupt == 1 and len(again) == 1 and again.head() == b
    assert p.read_bytes().endswith(b"\n") and b"payl\n" not in p.read_bytes()  # compacted: no torn tail
    third = Outbox(p)
    assert (len(third), third.corrupt) == (1, 0)


def test_outbox_files_are_private_and_hold_no_url(tmp_path: Path) -> None:
    d = tmp_path / "outbox"
    d.mkdir(mode=0o755)
    r = Receiver.parse(
        "webhook", "https://alice:s3cr3t-pw@hooks.example.com/services/T000/B000/XXXXSECRETXXXX"
    )
    os.umask(0o022)
    n = Notifier(d, [r], post=lambda r, b, t: Outcome("transient", None, "down"), start=False)
    n.queue([(page(1), 1.0, None)])
    f = outbox_file(d, r)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
    text = f.read_text()
    assert "s3cr3t" not in text and "XXXXSECRETXXXX" not in text and "hooks.example.com" not in text


def test_a_legacy_single_file_outbox_moves_to_the_receivers(tmp_path: Path) -> None:
    old = tmp_path / "alerts-outbox.jsonl"
    old.write_text(json.dumps({"target": "http://am:9093/api/v2/alerts", "payload": [{"labels": {"a": "1"}}]}) + "\n"
                   + json.dumps({"target": "http://hook/x", "payload": {"text": "hi"}}) + "\n" + "torn{\n")  # fmt: skip
    old.chmod(0o644)
    am, hook = Receiver.parse("alertmanager", "http://am:9093"), Receiver.parse("webhook", "http://hook/x")
    n = Notifier(old, [am, hook], post=lambda r, b, t: Outcome("transient", None, "down"), start=False)
    assert old.is_dir() and stat.S_IMODE(old.stat().st_mode) == 0o700
    assert [n.stats()[r.name]["pending"] for r in (am, hook)] == [1, 1]


@pytest.mark.parametrize("text", ["my precious notes\n", '{"a": 1}\n', "[1, 2]\n", "x" * 10 + "\n" + "{}\n"])
def test_an_outbox_path_that_is_someone_elses_file_is_refused_and_left_as_it_is(
    tmp_path: Path, text: str
) -> None:
    """``--outbox`` naming an ordinary file (a mistake): a clear error, the file untouched (it was
    taken as an earlier version's outbox, moved, and deleted: an empty directory in its place);
    such a file beside the outbox (the old default's name) is left alone."""
    hook = Receiver.parse("webhook", "http://hook/x")
    notes = tmp_path / "notes.txt"
    notes.write_text(text)
    with pytest.raises(OSError, match="is a file, not an alert outbox of an earlier version"):
        Notifier(notes, [hook], post=lambda r, b, t: Outcome("sent", 200, ""), start=False)
    assert notes.read_text() == text
    beside = tmp_path / "alerts-outbox.jsonl"
    beside.write_text(text)
    n = Notifier(
        tmp_path / "alerts-outbox", [hook], post=lambda r, b, t: Outcome("sent", 200, ""), start=False
    )
    n.close()
    assert beside.read_text() == text and (tmp_path / "alerts-outbox").is_dir()


def test_restart_with_a_pending_outbox_resends_exactly_once(store: ChdbStore, tmp_path: Path) -> None:
    hook = rx.Receiver(status=503)
    try:
        r = Receiver.parse("webhook", hook.url + "/h")
        n1 = Notifier(tmp_path / "ob", [r], policy=FAST)
        Engine(AlertState(store), n1, resend_s=600).step([page(7)], 1_790_000_000.0)
        wait_for(lambda: int(n1.stats()[r.name]["retries"]) >= 1, "a failed try")
        n1.close()  # the engine stops with the notification pending
        first = hook.posts()[0].body
        hook.status = 200
        before = len(hook.posts())
        n2 = Notifier(tmp_path / "ob", [r], policy=FAST)  # restarted: new objects, same store and outbox
        eng2 = Engine(AlertState(store), n2, resend_s=600)
        assert eng2.step([page(7)], 1_790_000_060.0)["queued"] == 0  # not re-paged by the engine
        wait_for(lambda: n2.stats()[r.name]["sent"] == 1, "the pending one delivered")
        n2.close()
        n3 = Notifier(tmp_path / "ob", [r], policy=FAST)  # and once more: nothing left to send
        assert n3.stats()[r.name]["pending"] == 0
        n3.close()
        assert [p.body for p in hook.posts()[before:]] == [first]
    finally:
        hook.close()


SECRET_URL = "https://bob:pa%24%24word-42@hooks.example.com/services/T123/B456/tokenTOKENtoken"


def test_receiver_secrets_are_redacted_in_messages_and_tracebacks() -> None:
    r = Receiver.parse("webhook", SECRET_URL)
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    lg = logging.getLogger("test.redact")
    lg.addHandler(h)
    lg.propagate = False
    try:
        h.addFilter(RedactSecrets([]))
        f = next(x for x in h.filters if isinstance(x, RedactSecrets))
        f.add(r.secrets())
        lg.warning("posting to %s", SECRET_URL)
        try:
            raise ConnectionError(f"cannot reach {SECRET_URL} with password pa$$word-42")
        except ConnectionError:
            lg.exception("delivery failed")
        lg.error("token in the path: /services/T123/B456/tokenTOKENtoken", stack_info=True)
    finally:
        lg.removeHandler(h)
    out = buf.getvalue()
    for secret in ("pa%24%24word-42", "pa$$word-42", "tokenTOKENtoken", "bob:pa"):
        assert secret not in out, out
    assert out.count("***") >= 4 and "Traceback" in out and "ConnectionError" in out


def test_logged_delivery_failures_name_the_receiver_never_its_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook = rx.Receiver(status=400)
    url = f"http://carol:hunter2-xyz@127.0.0.1:{hook.port}/services/T9/B9/sekritsekrit"
    try:
        r = Receiver.parse("webhook", url)
        n = Notifier(tmp_path / "ob", [r], policy=FAST)
        with caplog.at_level(logging.WARNING):
            n.queue([(page(1), 1.0, None)])
            wait_for(lambda: n.stats()[r.name]["failed"] == 1, "refused")
        n.close()
        assert "hunter2" not in caplog.text and "sekrit" not in caplog.text and "carol" not in caplog.text
        assert f"{r.name} (http://127.0.0.1:{hook.port}) refused" in caplog.text
        # the credentials were sent as Basic auth (they work), and never put in the request line
        (seen,) = hook.posts()
        assert (
            seen.headers["authorization"] == "Basic Y2Fyb2w6aHVudGVyMi14eXo="
        )  # base64 of carol:hunter2-xyz
        assert seen.path == "/services/T9/B9/sekritsekrit"
    finally:
        hook.close()


def test_receiver_urls_from_files_and_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "hook.url"
    f.write_text(
        "# the Slack hook\nhttps://hooks.example.com/services/A/B/C\n\nhttps://hooks.example.com/services/D/E/F\n"
    )
    f.chmod(0o600)
    found, warnings = from_sources("webhook", None, [str(f)], {"GPUSLO_WEBHOOK_URL": "http://h2:80/x"})
    assert [r.redacted for r in found] == ["https://hooks.example.com:443"] * 2 + ["http://h2:80"]
    assert warnings == []
    found, warnings = from_sources("alertmanager", ["http://u:p4ss@am:9093"], None, {})
    assert found[0].target == "/api/v2/alerts" and found[0].authorization
    assert "visible to every local user" in warnings[0] and "p4ss" not in warnings[0]
    f.chmod(0o644)
    assert "readable by other users" in from_sources("webhook", None, [str(f)], {})[1][0]
    # names are stable across restarts and differ per URL (each its own outbox file)
    assert Receiver.parse("webhook", "http://a/x").name == Receiver.parse("webhook", "http://a/x").name
    assert Receiver.parse("webhook", "http://a/x").name != Receiver.parse("webhook", "http://a/y").name


@pytest.mark.parametrize(
    ("url", "match"),
    [("ftp://h/x", "scheme must be http or https"), ("http:///x", "no host"), ("http://h:99999/x", "bad port"),
     ("http://h/x y", "whitespace"), ("hooks.slack.com/services/x", "scheme"),
     # a bracket that does not close: urlsplit's own ValueError was a traceback (exit 1)
     ("http://[::1/x", "Invalid IPv6 URL"), ("https://u:p@[fe80::1/hook", "Invalid IPv6 URL")],
)  # fmt: skip
def test_bad_receiver_urls_are_refused_without_quoting_them(url: str, match: str) -> None:
    with pytest.raises(ReceiverError, match=match) as e:
        from_sources("webhook", [url], None, {})
    assert url not in str(e.value)
    with pytest.raises(ReceiverError, match=r"--webhook-url-file .*nope: cannot read"):
        from_sources("webhook", None, ["/nope"], {})


def test_redact_logs_installs_on_every_root_handler() -> None:
    root = logging.getLogger()
    h = logging.StreamHandler(io.StringIO())
    root.addHandler(h)
    try:
        redact_logs(["abcd-secret"])
        redact_logs(["efgh-secret"])
        (f,) = [x for x in h.filters if isinstance(x, RedactSecrets)]
        assert set(f.secrets) == {"abcd-secret", "efgh-secret"}
    finally:
        root.removeHandler(h)


def test_a_full_disk_loses_the_notification_counted_and_logged_never_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = Receiver.parse("webhook", "http://127.0.0.1:9/h")
    n = Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("sent", 200, ""), start=False)
    f = outbox_file(tmp_path / "ob", r)
    f.unlink()
    f.symlink_to("/dev/full")  # the kernel's full disk: every write fails with ENOSPC
    with caplog.at_level(logging.ERROR):
        assert n.queue([(page(1), 1.0, None)]) == 0
    s = n.stats()[r.name]
    assert (s["dropped"], s["pending"]) == (1, 0) and "No space left" in str(s["last_error"])
    assert "not queued" in caplog.text


def test_an_outbox_over_its_bound_drops_the_oldest_counted(tmp_path: Path) -> None:
    r = Receiver.parse("webhook", "http://127.0.0.1:9/h")
    n = Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("sent", 200, ""),
                 policy=Policy(max_pending=3), start=False)  # fmt: skip
    for i in range(5):
        n.queue([(page(i), float(i), None)])
    s = n.stats()[r.name]
    assert (s["pending"], s["dropped"]) == (3, 2)
    head = n.queues[r.name].outbox.head()
    assert head is not None and "slo-2" in head.payload["text"]
    again = Outbox(outbox_file(tmp_path / "ob", r))  # the drops are on disk too
    assert len(again) == 3


def test_an_answer_echoing_the_token_is_redacted_in_the_summary(tmp_path: Path) -> None:
    token = "/services/T77/B77/echoedTOKEN"
    r = Receiver.parse("webhook", "http://127.0.0.1:9" + token)
    n = Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("permanent", 404, f"HTTP 404: no hook {token}"),
                 start=False)  # fmt: skip
    n.queue([(page(1), 1.0, None)])
    n.queues[r.name].attempt()
    s = n.stats()[r.name]
    assert s["failed"] == 1 and "echoedTOKEN" not in json.dumps(s) and "***" in str(s["last_error"])


def test_the_old_default_outbox_file_beside_the_new_directory_is_moved(tmp_path: Path) -> None:
    (tmp_path / "alerts-outbox.jsonl").write_text(
        json.dumps({"target": "http://hook/x", "payload": {"text": "a"}}) + "\n"
    )
    hook = Receiver.parse("webhook", "http://hook/x")
    n = Notifier(
        tmp_path / "alerts-outbox", [hook], post=lambda r, b, t: Outcome("sent", 200, ""), start=False
    )
    assert n.stats()[hook.name]["pending"] == 1 and not (tmp_path / "alerts-outbox.jsonl").exists()


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_a_tls_handshake_that_never_comes_is_cut_at_the_deadline() -> None:
    silent = rx.Receiver(behaviour="hang")  # accepts TCP, never answers the TLS hello
    try:
        out = http_post(Receiver.parse("webhook", f"https://127.0.0.1:{silent.port}/h"), b"{}", 1.0)
        assert (out.kind, out.status) == ("transient", None)
        assert "total deadline of 1 s" in out.detail
    finally:
        silent.close()


def test_a_bad_log_format_call_is_still_redacted() -> None:
    f = RedactSecrets(["hunter2-secret"])
    rec = logging.LogRecord(
        "x", logging.WARNING, __file__, 1, "url %s %s", ("http://u:hunter2-secret@h",), None
    )
    f.filter(rec)
    assert "hunter2-secret" not in str(rec.msg) and rec.args is None


def test_a_legacy_move_interrupted_by_a_crash_is_taken_up_again(tmp_path: Path) -> None:
    claimed = tmp_path / "alerts-outbox.migrating"  # renamed aside, then the process died
    claimed.write_text(json.dumps({"target": "http://hook/x", "payload": {"text": "a"}}) + "\n")
    hook = Receiver.parse("webhook", "http://hook/x")
    n = Notifier(
        tmp_path / "alerts-outbox", [hook], post=lambda r, b, t: Outcome("sent", 200, ""), start=False
    )
    assert n.stats()[hook.name]["pending"] == 1 and not claimed.exists()


def test_many_alerts_are_split_into_webhook_messages_slack_accepts(tmp_path: Path) -> None:
    from gpuslo.rules.alerts import WEBHOOK_TEXT_MAX

    hook, am = (
        Receiver.parse("webhook", "http://127.0.0.1:9/h"),
        Receiver.parse("alertmanager", "http://127.0.0.1:9"),
    )
    n = Notifier(tmp_path / "ob", [hook, am], post=lambda r, b, t: Outcome("sent", 200, ""), start=False)
    alerts = [(Alert({"alertname": "GpusloStarvation", "severity": "ticket", "queue": f"q{i}"}, {"summary": "x" * 90}),
               1.0, None) for i in range(200)] + [(Alert({"alertname": "A"}, {"summary": "y" * 10_000}), 1.0, None)]  # fmt: skip
    msgs = n.payloads(hook, alerts)
    assert all(len(m["text"]) <= WEBHOOK_TEXT_MAX for m in msgs) and len(msgs) > 1
    lines = [line for m in msgs for line in m["text"].split("\n")]
    assert len(lines) == 201 and [line.split()[3] for line in lines[:200]] == [f"q{i}" for i in range(200)]
    assert n.payloads(am, alerts) == [n.payloads(am, alerts)[0]] and len(n.payloads(am, alerts)[0]) == 201
    assert n.queue(alerts) == len(msgs) + 1


def test_hostile_names_are_literal_text_in_webhook_messages_one_line_per_alert(tmp_path: Path) -> None:
    """Slack reads ``<...>`` as markup (``<!channel>`` pings the channel, ``<URL|text>`` is a
    link) and ``&`` as an entity: a name from a config or a scheduler is sent escaped, its line
    breaks as blanks, so each alert stays one line that reads back as what it was."""
    import re

    from gpuslo.rules.alerts import WEBHOOK_TEXT_MAX
    from tests.hostile import corpus

    hook = Receiver.parse("webhook", "http://127.0.0.1:9/h")
    n = Notifier(tmp_path / "ob", [hook], post=lambda r, b, t: Outcome("sent", 200, ""), start=False)
    names = [
        *corpus(),
        "<!channel>",
        "<https://evil.example|reclaim here>",
        "&lt;",
        "p99 < 5 ms & > 1",
        "&" * 5000,
    ]
    alerts = [(Alert({"alertname": "GpusloSLOBurn", "severity": "page", "slo": name}, {"summary": f"[{name}]"}), 1.0, None)
              for name in names]  # fmt: skip
    msgs = n.payloads(hook, alerts)
    lines = [line for m in msgs for line in m["text"].split("\n")]
    assert len(lines) == len(names) and all(len(m["text"]) <= WEBHOOK_TEXT_MAX for m in msgs)
    for name, line in zip(names, lines, strict=True):
        assert "<" not in line and ">" not in line and not re.search(r"&(?!amp;|lt;|gt;)", line), repr(name)
        said = re.sub(r"&(amp|lt|gt);", lambda m: {"amp": "&", "lt": "<", "gt": ">"}[m.group(1)], line)
        want = "FIRING [page] GpusloSLOBurn " + re.sub(
            r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", " ", f"{name} [{name}]"
        )
        assert want.startswith(said) and (said == want or len(line) > WEBHOOK_TEXT_MAX - 5), repr(name)


def test_one_process_per_outbox_directory(tmp_path: Path) -> None:
    r = Receiver.parse("webhook", "http://127.0.0.1:9/h")
    first = Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("sent", 200, ""))
    with pytest.raises(OSError, match="in use by another process"):
        Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("sent", 200, ""))
    first.close()
    Notifier(tmp_path / "ob", [r], post=lambda r, b, t: Outcome("sent", 200, "")).close()  # free again


def test_what_counts_as_a_receiver_secret() -> None:
    assert Receiver.parse("alertmanager", "http://am:9093").secrets() == []
    am = Receiver.parse("alertmanager", "http://ops:pw%2Fx@am:9093")
    assert set(am.secrets()) >= {"http://ops:pw%2Fx@am:9093", "pw%2Fx", "pw/x", "ops:pw%2Fx"}
    hook = Receiver.parse("webhook", "https://hooks.example.com/services/T/B/tok?x=1")
    assert {"https://hooks.example.com/services/T/B/tok?x=1", "/services/T/B/tok"} <= set(hook.secrets())


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 60\r\n\r\nbad token sekret-token-path-1234567\r\nFAKE ERROR forged line\r\n",
        b"not http at all\r\nERROR gpuslo: forged line\r\n\r\n",
        b"HTTP/1.1 500 Oops\x1b[31m red\r\nContent-Length: 0\r\n\r\n",
    ],
)
def test_what_a_receiver_answers_is_one_log_line_and_never_its_token(answer: bytes) -> None:
    """A receiver's answer quoted in the outcome (its reason, its error page, a malformed status
    line in the exception) is one line, control characters escaped, cut; a part of the webhook's
    path long enough to be a token is masked by itself (the page echoed it)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    r = Receiver.parse("webhook", f"http://127.0.0.1:{srv.getsockname()[1]}/hooks/sekret-token-path-1234567")
    try:
        out = http_post(r, b"{}", 5.0)
    finally:
        srv.close()
    assert "\n" not in out.detail and "\r" not in out.detail and "\x1b" not in out.detail, out.detail
    assert len(out.detail) < 300
    assert "sekret-token-path-1234567" in r.secrets()
    assert "sekret-token-path-1234567" not in RedactSecrets(r.secrets()).redact(out.detail)
