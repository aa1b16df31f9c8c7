"""Argument types the commands share (no imports beyond argparse: every command parses them)."""

from __future__ import annotations

import argparse


def path_arg(text: str) -> str:
    """A path the user names: an empty one is refused (``--config ""`` was read as no --config,
    the shipped example; ``--csv ""`` wrote nothing, exit 0)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def text_arg(text: str) -> str:
    """A value the user names (a broker list, a server, a group, a node, an address): an empty one
    is refused. It was read as the flag not given: ``--kafka "$KAFKA"`` with the variable unset ran
    the agent writing JSON lines to stdout instead of sending, ``--clickhouse ""`` wrote into a
    local chDB store instead of the server, ``--metrics-addr ""`` served on every interface. Text
    that is not UTF-8 (:func:`utf8_text`) is refused too."""
    if not text:
        raise argparse.ArgumentTypeError("an empty value")
    return utf8_text(text)


def utf8_text(text: str) -> str:
    """``text`` if it is UTF-8 text. Python keeps an argument's bytes that are not UTF-8 (a
    Latin-1 terminal's ``é``) as lone surrogates, which nothing downstream can encode: a
    ``--cluster`` or job id of them reached chDB as "Unable to cast Python instance of type
    <class 'str'> to C++ type"; a Kafka group id, the protocol's encoder. Paths keep them (a
    file name is bytes): this is for names and values only."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        import re

        # the bytes that are not UTF-8 shown as \xNN (Python's repr says \udcNN)
        shown = re.sub(r"\\udc([89a-f][0-9a-f])", r"\\x\1", repr(text[:200]))
        raise argparse.ArgumentTypeError(
            f"{shown} is not UTF-8 text (a \\xNN is a byte that is not)"
        ) from None
    return text


#: the longest name the wire carries (gpuslo.wire.models.NAME_MAX; tests/test_cli.py checks the
#: two agree): a longer one is no name a store holds
NAME_MAX = 256


def name_arg(text: str) -> str:
    """A name as the store holds it, to select by (a cluster, a job's cluster, a GPU model): UTF-8
    text (:func:`utf8_text`) of at most :data:`NAME_MAX` characters, compared exactly, white space
    and control characters included (the wire carries them; a message shows them escaped). Empty
    means what the option's help says (every cluster)."""
    utf8_text(text)
    if len(text) > NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}... is {len(text)} characters long: no name is longer than {NAME_MAX}"
        )
    return text


def node_arg(text: str) -> str:
    """The node's name as its scheduler knows it (``agent --node``): UTF-8 text, not empty, without
    white space or control characters. A Slurm NodeName and a Kubernetes node
    name hold none, and the agent asks the scheduler for the node's jobs, pods, pool and
    ResourceSlices by it: ``--node " gpu1"`` found none of them, every GPU unallocated, without
    a word. Its length is the wire's to check (``agent`` checks every name it sends)."""
    text_arg(text)
    bad = next((c for c in text if c.isspace() or ord(c) < 32 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"{text[:200]!r} holds {bad!r}: a node's name (Slurm's NodeName, a Kubernetes node name) has no "
            "white space or control character"
        )
    return text


_IDNA = "a label empty or over 63 characters, or a character IDNA refuses"


def bind_addr(text: str) -> str:
    """An address to listen on (``--metrics-addr``): a host name or address, not empty
    (:func:`text_arg`) and one socket can encode (IDNA): ``a..b`` or a label over 63 characters
    was a UnicodeError traceback at the bind, not the 'cannot serve /metrics' of a bad address."""
    text_arg(text)
    if ":" not in text:  # an IPv6 address is no name
        try:
            text.encode("idna")
        except UnicodeError:
            raise argparse.ArgumentTypeError(f"{text[:200]!r} is no host name or address ({_IDNA})") from None
    return text


# a Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of 1 to 63
# alphanumerics, '-', '_' and '.', starting and ending alphanumeric (apimachinery's
# IsQualifiedName); the prefix at most 253 characters
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_PREFIX = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"


def label_key(text: str) -> str:
    """A Kubernetes label key (``--pool-label``): one no Node can carry (empty, a shell variable
    unset; white space; a name over 63 characters) replaced the default keys and was looked up
    on every Node in vain, the pool left empty, without a word."""
    import re

    prefix, _, name = text.rpartition("/") if "/" in text else ("", "", text)
    ok = re.fullmatch(_LABEL_NAME, name) is not None and (
        "/" not in text or (len(prefix) <= 253 and re.fullmatch(_LABEL_PREFIX, prefix) is not None)
    )
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text[:200]!r} is no Kubernetes label key ([prefix/]name: a name of 1 to 63 letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit; a DNS subdomain as the prefix)"
        )
    return text


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host (and a port that is a number): anything
    else was taken at start and failed at every scrape or watch, logged and counted, while the
    agent ran on (``--dcgm-url notaurl --once``: exit 0 with no samples; ``--k8s-api notaurl``
    retried for ever; ``http://[x`` is urlsplit's own ValueError)."""
    from urllib.parse import urlsplit

    utf8_text(text)
    try:
        u = urlsplit(text)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port > 0)
        if ok and ":" not in str(u.hostname):  # a name (no IPv6 address), as socket encodes it
            str(u.hostname).encode("idna")
    except UnicodeError:  # a name no resolver reads (http://a..b/): a failed scrape each time
        raise argparse.ArgumentTypeError(
            f"{text[:200]!r}: the host is no name a resolver reads ({_IDNA})"
        ) from None
    except ValueError as exc:  # a bracket that does not close, a port that is no number
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not a URL: {exc}") from None
    if not ok or any(c.isspace() or ord(c) < 32 for c in text):
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not an http:// or https:// URL with a host")
    return text
