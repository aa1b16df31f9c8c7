"""``gpuslo chargeback``: the bill of a window per account, user and queue (rules/chargeback.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import Any

from gpuslo.app.argtypes import path_arg

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR = 0, 1, 2
CSV_COLUMNS = (
    "dimension", "name", "gpu_hours_used", "gpu_hours_allocated_idle", "gpu_hours_unallocated_share",
    "energy_kwh", "cost_gpu", "cost_energy", "cost",
)  # fmt: skip


PLACES = 3  # GPU-hours and kWh in the text; the lines are shared out at it, so they add up


def table(bill: Any) -> str:
    """The bill as text: one line per account, then the totals. Names are the data's: each is
    one cell, escaped and padded by the columns it takes (gpuslo.app.text.table), never cut (two
    accounts alike in their first 20 characters were two lines of the same name, and a newline
    in one started a line of its own, a forged one)."""
    from gpuslo.app.text import cell
    from gpuslo.app.text import table as text_table

    cur = f" {bill.currency}" if bill.currency else ""
    cols = ("gpu_hours_used", "gpu_hours_allocated_idle", "gpu_hours_unallocated_share", "energy_kwh")
    rows = [[r["account"] or "(none)", *(f"{r[c]:.{PLACES}f}" for c in cols), r["cost"]]
            for r in bill.rows("account", PLACES)]  # fmt: skip
    t = bill.totals_at(PLACES)
    rows.append(["total", *(f"{t[c]:.{PLACES}f}" for c in cols), t["cost"]])
    head = ["account", "used h", "alloc-idle h", "unalloc h", "kWh", f"cost{cur}"]
    out = [f"chargeback (unallocated: {cell(bill.unallocated_mode)})", text_table(rows, head)]
    out.append(
        f"capacity {t['gpu_hours_capacity']:.3f} GPU-h priced {t['capacity_cost']}{cell(cur)}; "
        f"not charged {t['uncharged_cost']}{cell(cur)}"
    )
    for u in bill.unpriced:
        out.append(
            f"UNPRICED: {u['gpu_hours']:.3f} GPU-h of model {cell(repr(u['model']))} in cluster {cell(repr(u['cluster']))}"
        )
    for a in bill.rightsize:
        out.append(
            f"right-size: {cell(a['account'] or '(none)')}: {a['jobs']} job(s) would have fit {cell(a['profile'])} "
            f"slices, {a['give_back_gpu_hours']:.2f} of their {a['held_gpu_hours']:.2f} GPU-h to give back"
        )
    return "\n".join(out)


def demo_text(res: Any) -> str:
    """The demo summary's energy line (measured beside the simulator's) and its bill."""
    from gpuslo.rules.energy import co2_words

    got, want = res.energy, res.truth.get("energy", {})
    out = []
    if got:
        out.append(
            f"energy:     {got['energy_kwh']:.3f} kWh (simulator: {want.get('energy_kwh', 0):.3f}); "
            f"allocated-idle {got['allocated_idle_kwh']:.3f} ({want.get('allocated_idle_kwh', 0):.3f}), "
            f"unallocated {got['unallocated_kwh']:.3f} ({want.get('unallocated_kwh', 0):.3f}), "
            f"outside capacity {got['outside_capacity_kwh']:.3f} ({want.get('outside_capacity_kwh', 0):.3f}); "
            f"{co2_words(got, 3)}"
        )
    if res.chargeback is not None:
        out.append(table(res.chargeback))
    return "\n".join(out) + ("\n" if out else "")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_text(name: str) -> str:
    """A name from the data (account, user, queue: whatever the scheduler was told) as a CSV cell
    a spreadsheet shows as text: one starting like a formula (``=HYPERLINK(...)``, ``+``, ``-``,
    ``@``, a tab or CR) gets a leading apostrophe, as OWASP's CSV-injection advice says."""
    return f"'{name}" if name.startswith(_FORMULA_START) else name


def write_csv(bill: Any, path: str) -> None:
    """The bill's lines as CSV at ``path``, whole or not at all (core.fileio.write_outputs)."""
    from gpuslo.core.fileio import write_outputs

    fh = io.StringIO(newline="")
    w = csv.writer(fh)
    w.writerow(CSV_COLUMNS)
    for dim in ("account", "user", "queue"):
        for r in bill.rows(dim):
            w.writerow([dim, csv_text(str(r[dim])), *(r[c] for c in CSV_COLUMNS[2:])])
    t = bill.totals
    w.writerow(["total", "", *(t[c] for c in CSV_COLUMNS[2:])])
    write_outputs({path: fh.getvalue().encode("utf-8")})


def cmd_chargeback(a: argparse.Namespace) -> int:
    from gpuslo.app.cli import _on_window
    from gpuslo.app.text import terminal_safe
    from gpuslo.rules.chargeback import ChargebackError, compute

    def run(store: Any, cfg: Any) -> Any:
        return compute(store, cfg, a.frm, a.to, a.cluster)

    try:
        rc, bill = _on_window(a, "chargeback", run)
    except ChargebackError as exc:
        print(f"gpuslo chargeback: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if rc != EXIT_OK:
        return int(rc)
    if a.csv:
        try:
            write_csv(bill, a.csv)
        except OSError as exc:
            print(f"gpuslo chargeback: cannot write {a.csv}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
    print(json.dumps(bill.to_json(), indent=2, sort_keys=True) if a.json else terminal_safe(table(bill)))
    if bill.unpriced:
        models = ", ".join(sorted({repr(u["model"]) for u in bill.unpriced}))
        print(
            f"gpuslo chargeback: no price for GPU model(s) {models}: their GPU-hours are listed as "
            "`unpriced` and cost nothing; add them to chargeback.per_gpu_hour (or set default_per_gpu_hour)",
            file=sys.stderr,
        )
        return EXIT_PARTIAL
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    from gpuslo.app.cli import _add_window_args

    p = sub.add_parser(
        "chargeback", parents=[common], help="GPU-hours, energy and cost per account for a window"
    )
    _add_window_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--csv", type=path_arg, metavar="FILE", help="also write the lines (per account, user, queue) as CSV"
    )
    p.set_defaults(func=cmd_chargeback)
