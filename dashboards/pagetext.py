"""Text on gpuslo's HTML pages (the report, its chargeback and what-if sections, the job page):
every value from the data or the config goes through :func:`esc`, every fraction shown as a
percentage through :func:`pct` (gpuslo.core.display, as on the terminal)."""

from __future__ import annotations

import html

from gpuslo.core.display import pct, visible

__all__ = ["esc", "pct"]


def esc(value: object) -> str:
    """``value`` as HTML text or a double-quoted attribute value: ``& < > " '`` escaped, and its
    control characters and bidirectional overrides shown as ``\\xNN`` / ``\\uNNNN`` (a U+202E in
    a cluster name reversed the rest of the line after it, "generated <date>" included; a NUL
    was dropped by the browser)."""
    return html.escape(visible(str(value)), quote=True)
