"""Every HTTP read the project makes is bounded in its whole time and its size
(gpuslo.core.http): the agent's Kubernetes API calls (a Node, a ResourceSlice, a list, a watch),
the reclaim loop's calls, the scrapes. Each socket read's timeout alone let a server that
trickles hold a caller for ever, and a body read whole was as long as the server made it."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuslo.agent import k8s_watch, scrape
from gpuslo.agent.k8s_watch import KubeApi
from gpuslo.core.http import ERROR_BODY_BYTES, read_url
from gpuslo.rules.actions import KubeActor, KubeCredentials, http_request
from gpuslo.rules.reclaim import IdleHolder
from tests.trickle import Raw, Trickle, read_request


def _within(s: float, fn: Callable[[], Any]) -> tuple[float, BaseException | None, Any]:
    """Runs ``fn`` on a thread, waiting at most ``s`` (a hang fails the test, not the suite)."""
    out: list[Any] = []

    def go() -> None:
        try:
            out.append((None, fn()))
        except BaseException as exc:
            out.append((exc, None))

    t0 = time.monotonic()
    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(s)
    assert not th.is_alive(), f"still reading after {s} s"
    return time.monotonic() - t0, out[0][0], out[0][1]


@pytest.fixture
def trickle() -> Iterator[Trickle]:
    t = Trickle(chunk=b" ")
    yield t
    t.close()


def test_a_read_that_never_ends_fails_within_its_time(trickle: Trickle) -> None:
    _, exc, _ = _within(20, lambda: read_url(trickle.url, 0.5, 1 << 20))
    assert isinstance(exc, TimeoutError)


@pytest.mark.parametrize("status", ["500 Internal Server Error", "403 Forbidden", "410 Gone"])
def test_an_error_answer_that_never_ends_fails_within_its_time(status: str) -> None:
    """An error answer's body is read under the same deadline, and cut: the caller's read of it
    returns at once."""
    t = Trickle(status=status, chunk=b"x" * 4096)
    try:
        _, exc, _ = _within(20, lambda: read_url(t.url, 0.5, 1 << 20))
        assert isinstance(exc, urllib.error.HTTPError) and exc.code == int(status.split()[0])
        assert len(exc.read()) <= ERROR_BODY_BYTES
    finally:
        t.close()


def _api(items: int) -> _Pages:
    """A Kubernetes API server's lists as the real one pages them: ``limit`` objects an answer,
    a ``continue`` token to the next, the snapshot's resourceVersion on every page."""
    objs = [{"metadata": {"name": f"p{i}", "uid": f"u{i}"}} for i in range(items)]

    def page(_n: int, q: dict[str, list[str]]) -> dict[str, Any]:
        limit = int(q.get("limit", ["0"])[0]) or len(objs)
        start = int(q.get("continue", ["0"])[0])
        more = start + limit < len(objs)
        md = {"resourceVersion": "77"} | ({"continue": str(start + limit)} if more else {})
        return {"kind": "PodList", "metadata": md, "items": objs[start : start + limit]}

    return _Pages(page)


@pytest.mark.parametrize("n", [0, 1, 499, 500, 501, 1234])
def test_a_list_is_read_in_pages_and_whole(n: int) -> None:
    api = _api(n)
    try:
        items, rv = KubeApi(api.url).list_objects("/api/v1/pods?fieldSelector=spec.nodeName%3Dn1")
    finally:
        api.shutdown()
    assert [i["metadata"]["name"] for i in items] == [f"p{i}" for i in range(n)] and rv == "77"
    assert all(q["limit"] == [str(k8s_watch.LIST_PAGE)] for q in api.asked)
    assert all(q["fieldSelector"] == ["spec.nodeName=n1"] for q in api.asked)
    assert len(api.asked) == max(1, -(-n // k8s_watch.LIST_PAGE))


def test_a_page_past_its_bound_fails_the_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s_watch, "MAX_PAGE_BYTES", 1000)
    api = _api(100)
    try:
        with pytest.raises(OSError, match="longer than 1000 bytes"):
            KubeApi(api.url).list_objects("/api/v1/pods")
    finally:
        api.shutdown()


@pytest.mark.parametrize(
    "call",
    [
        lambda api: api.get_node("n1"),
        lambda api: api.get_object("/apis/resource.k8s.io/v1/resourceslices/s1"),
        lambda api: api.list_objects("/api/v1/pods"),
    ],
    ids=["node", "object", "list"],
)
def test_an_api_call_that_never_ends_fails_within_its_timeout(trickle: Trickle, call: Any) -> None:
    _, exc, _ = _within(20, lambda: call(KubeApi(trickle.base, timeout_s=0.5)))
    assert isinstance(exc, TimeoutError)


def test_a_watch_that_never_ends_is_shut_after_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch asks the server to end it after ``timeoutSeconds``; one that goes on (a trickle
    of blank lines keeps every read under its timeout) is shut ``WATCH_SLACK_S`` later, and
    the watcher watches again."""
    monkeypatch.setattr(k8s_watch, "WATCH_SLACK_S", 0.5)
    t = Trickle(chunk=b"\n")
    try:
        elapsed, exc, events = _within(
            20, lambda: list(KubeApi(t.base).watch_objects("/api/v1/pods", "1", 0))
        )
    finally:
        t.close()
    assert exc is None and events == [] and elapsed < 15


def test_a_reclaim_call_that_never_ends_fails_within_its_timeout(trickle: Trickle) -> None:
    """The reclaim round bounds its calls by ``reclaim.action.timeout_s`` each: a trickling API
    server (or proxy) held the round, and the rules process's loop, for ever."""
    actor = KubeActor(http_request(KubeCredentials(trickle.base, token="t"), 0.5))
    h = IdleHolder(
        "c1", "k8s", "ns1/pod-1", "ns1/pod-1", "u", "a", "q", 1.0, 0.0, 7200.0, 0.0, 3600.0, uid="uid-1"
    )
    _, exc, outcome = _within(20, lambda: actor.act("delete", h))
    assert exc is None and not outcome.ok and "TimeoutError" in outcome.reason


def _redirect(location: str) -> Callable[[socket.socket], None]:
    def answer(c: socket.socket) -> None:
        c.recv(65536)
        c.sendall(f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())

    return answer


def _trickle_bytes(c: socket.socket) -> None:
    """An FTP (or any) server whose greeting never ends: a byte now and then."""
    while True:
        c.sendall(b"2")
        time.sleep(0.05)


def test_a_redirect_to_anything_but_http_is_not_followed() -> None:
    """urllib's redirects went to ``ftp://`` too, through an FTP handler whose sockets no
    deadline watched: a redirect to a trickling FTP server held the caller for ever. Only
    http and https are followed; a redirect elsewhere is an error at once."""
    ftp = Raw(_trickle_bytes)
    first = Raw(_redirect(f"ftp://127.0.0.1:{ftp.port}/x"))
    try:
        _, exc, _ = _within(20, lambda: read_url(first.base + "/metrics", 0.5, 1 << 20))
    finally:
        first.close()
        ftp.close()
    assert isinstance(exc, urllib.error.URLError) and "only http and https" in str(exc)


def test_a_redirect_to_http_is_followed() -> None:
    target = Raw(lambda c: (c.recv(65536), c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")))
    first = Raw(_redirect(target.base + "/there"))
    try:
        assert read_url(first.base + "/metrics", 5, 100) == b"ok"
    finally:
        first.close()
        target.close()


class _Recorder(Raw):
    """Answers ``{}`` and keeps each request's head."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.heads: list[str] = []
        super().__init__(self._record, host)

    def _record(self, c: socket.socket) -> None:
        self.heads.append(c.recv(65536).decode())
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")


@pytest.mark.parametrize("where", ["same origin", "another port", "another host"])
@pytest.mark.parametrize(
    "call",
    [
        lambda base: KubeApi(base, token="SA-TOKEN").get_object("/api/v1/nodes/n1"),
        lambda base: KubeApi(base, token="SA-TOKEN").list_objects("/api/v1/pods"),
        lambda base: http_request(KubeCredentials(base, token="SA-TOKEN"), 5)(
            "GET", "/api/v1/pods", None, ""
        ),
    ],
    ids=["get", "list", "reclaim"],
)
def test_a_redirect_to_another_origin_does_not_carry_the_token(where: str, call: Any) -> None:
    """urllib sent every header on to where a redirect pointed: the ServiceAccount's bearer
    token went to any host (or port) an API server, a proxy or a man in the middle named. It
    goes on to the same origin only (scheme, host and port), as Go's client and requests do."""
    target = _Recorder("127.0.0.2" if where == "another host" else "127.0.0.1")
    first = Raw(lambda c: None)  # replaced below: the redirect needs the path asked
    same_origin = where == "same origin"

    def answer(c: socket.socket) -> None:
        head = c.recv(65536).decode()
        if "/moved" in head:  # the same origin's target
            target.heads.append(head)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            return
        to = (first.base if same_origin else target.base) + "/moved"
        c.sendall(f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {to}\r\nContent-Length: 0\r\n\r\n".encode())

    first.answer = answer
    try:
        call(first.base)
    finally:
        first.close()
        target.close()
    assert len(target.heads) == 1
    assert ("Bearer SA-TOKEN" in target.heads[0]) == same_origin


def _proxy_that_trickles(c: socket.socket) -> None:
    """A proxy that answers CONNECT (or a plain request) with a header that never ends."""
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 Connection established\r\nX-Slow: ")
    _trickle_bytes(c)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_proxy_that_trickles_fails_within_its_time(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through HTTP(S)_PROXY, https is a CONNECT tunnel set up inside connect(), before the
    socket was watched: a proxy that trickled its answer held the caller for ever. The socket
    is watched from its creation."""
    proxy = Raw(_proxy_that_trickles)
    for name in ("no_proxy", "NO_PROXY", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(f"{scheme}_proxy", proxy.base)
    try:
        _, exc, _ = _within(20, lambda: read_url(f"{scheme}://api.gpuslo.invalid/x", 0.5, 1 << 20))
    finally:
        proxy.close()
    assert isinstance(exc, TimeoutError)


@pytest.mark.parametrize(
    ("status", "raised"),
    [("500 Internal Server Error", urllib.error.HTTPError), ("403 Forbidden", k8s_watch.Forbidden),
     ("410 Gone", k8s_watch.Gone)],
)  # fmt: skip
def test_a_watch_refused_with_a_body_that_never_ends_fails_within_its_time(
    status: str, raised: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch's error answer: its body was read after the watch's deadline was cancelled, each
    read under its own timeout only, so a trickling one held the watcher for ever."""
    monkeypatch.setattr(k8s_watch, "WATCH_SLACK_S", 0.5)
    t = Trickle(status=status, chunk=b"x")
    try:
        _, exc, _ = _within(20, lambda: list(KubeApi(t.base).watch_objects("/api/v1/pods", "1", 0)))
    finally:
        t.close()
    assert isinstance(exc, raised)


def _cut(head: bytes, body: bytes) -> Callable[[socket.socket], None]:
    """An answer whose connection closes after ``body``, whatever ``head`` said would come."""

    def answer(c: socket.socket) -> None:
        read_request(c)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body)

    return answer


PAGE = b'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 100\n'
_CUT_SHORT = {
    "nothing of its length": _cut(b"Content-Length: %d\r\n" % len(PAGE), b""),
    "one byte of its length": _cut(b"Content-Length: %d\r\n" % len(PAGE), PAGE[:1]),
    "all but one byte of its length": _cut(b"Content-Length: %d\r\n" % len(PAGE), PAGE[:-3]),
    "a chunk cut short": _cut(b"Transfer-Encoding: chunked\r\n", b"%x\r\n" % len(PAGE) + PAGE[:-3]),
    "a chunk size that is none": _cut(b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + PAGE),
}


@pytest.mark.parametrize("answer", list(_CUT_SHORT.values()), ids=list(_CUT_SHORT))
def test_an_answer_cut_short_is_no_answer(answer: Callable[[socket.socket], None]) -> None:
    """A body that ended before its Content-Length came back as if it were all of it (a metrics
    page cut after 'util 1' of 'util 100' read as 1 %); a chunked one cut short raised
    http.client's IncompleteRead, no OSError: the reclaim actor let it out (a traceback). Both
    are an OSError, to every caller."""
    server = Raw(answer)
    h = IdleHolder(
        "c1", "k8s", "ns1/pod-1", "ns1/pod-1", "u", "a", "q", 1.0, 0.0, 7200.0, 0.0, 3600.0, uid="uid-1"
    )
    try:
        with pytest.raises(OSError, match=r"cut short|no whole HTTP answer"):
            read_url(server.base + "/metrics", 5, 1 << 20)
        with pytest.raises(OSError):
            scrape.http_get(server.base + "/metrics", 5)
        with pytest.raises(OSError):
            KubeApi(server.base).get_object("/api/v1/nodes/n1")
        outcome = KubeActor(http_request(KubeCredentials(server.base, token="t"), 5)).act("delete", h)
    finally:
        server.close()
    assert not outcome.ok and "OSError" in outcome.reason


def test_an_answer_of_its_whole_length_is_read() -> None:
    server = Raw(_cut(b"Content-Length: %d\r\n" % len(PAGE), PAGE))
    try:
        assert read_url(server.base + "/metrics", 5, len(PAGE)) == PAGE
    finally:
        server.close()


class _Pages(http.server.ThreadingHTTPServer):
    """An API server whose list pages ``page(n, asked)`` writes (n: the page asked, from 0)."""

    def __init__(self, page: Callable[[int, dict[str, list[str]]], dict[str, Any]]) -> None:
        self.asked: list[dict[str, list[str]]] = []
        server = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                server.asked.append(q)
                body = json.dumps(page(len(server.asked) - 1, q)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def list(self) -> tuple[float, BaseException | None, Any]:
        try:
            return _within(20, lambda: KubeApi(self.url).list_objects("/api/v1/pods"))
        finally:
            self.shutdown()


def _page(n: int, rv: Any = "77", cont: Any = None) -> dict[str, Any]:
    md = {"resourceVersion": rv} | ({} if cont is None else {"continue": cont})
    return {"kind": "PodList", "metadata": md, "items": [{"metadata": {"name": f"p{n}", "uid": f"u{n}"}}]}


@pytest.mark.parametrize("token", [123, 1.5, True, ["t"], {"t": 1}])
def test_a_continue_that_is_no_token_fails_the_list(token: Any) -> None:
    """A ``continue`` that is no string was read as none: the list ended at its first page, and
    the collector's relist took every pod of the pages after it for deleted ('Deleted
    (unobserved)' ends)."""
    _, exc, _ = _Pages(lambda n, q: _page(n, cont=token if n == 0 else None)).list()
    assert isinstance(exc, ValueError) and "not a token" in str(exc)


@pytest.mark.parametrize("last", [None, ""])
def test_no_continue_ends_the_list(last: Any) -> None:
    _, exc, got = _Pages(lambda n, q: _page(n, cont="next" if n == 0 else last)).list()
    assert exc is None and [i["metadata"]["name"] for i in got[0]] == ["p0", "p1"] and got[1] == "77"


def test_a_continue_token_given_again_fails_the_list() -> None:
    """A server that hands back a token it gave before was asked again as fast as it answered,
    for ever, the pages piling up."""
    pages = _Pages(lambda n, q: _page(n, cont=["a", "b", "a", "b"][n % 4]))
    _, exc, _ = pages.list()
    assert isinstance(exc, ValueError) and "came again" in str(exc) and len(pages.asked) == 3


def test_a_list_that_never_ends_fails_after_its_most_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s_watch, "MAX_LIST_PAGES", 7)
    pages = _Pages(lambda n, q: _page(n, cont=f"t{n}"))
    _, exc, _ = pages.list()
    assert isinstance(exc, ValueError) and "never ends" in str(exc) and len(pages.asked) == 7


def test_pages_at_different_resource_versions_fail_the_list() -> None:
    """The pages of one list are one snapshot, at the first page's resourceVersion: a server that
    answers a later page at another version served no snapshot, and a watch from the last page's
    version missed what changed on the first pages in between."""
    _, exc, _ = _Pages(lambda n, q: _page(n, rv=str(5 + 4 * n), cont="next" if n == 0 else None)).list()
    assert isinstance(exc, ValueError) and "not one snapshot" in str(exc)
