"""Run SQL on whatever chDB this interpreter has; stdlib and chdb only.

Reads a JSON list of steps on stdin: {"sql": "...", "params": {name: text}} and prints a
JSON list of results (rows as lists, or {"error": "..."}). Used by the tests to run the
project's DDL and rule SQL on chDB 2.1 = ClickHouse 24.8, the oldest server we support,
from a virtual environment of its own (two chDB versions cannot share one)."""

from __future__ import annotations

import json
import sys
import tempfile

from chdb import session


def main() -> int:
    steps = json.load(sys.stdin)
    out = []
    with tempfile.TemporaryDirectory() as d:
        s = session.Session(d)
        out.append({"version": str(s.query("SELECT version()", "TSV")).strip()})
        # chDB 2.1 keeps no tables in its "default" database of a session: use one of ours
        s.query("CREATE DATABASE IF NOT EXISTS gpuslo ENGINE = Atomic")
        for step in steps:
            sets = "".join(
                "SET param_{} = '{}'; ".format(k, str(v).replace("\\", "\\\\").replace("'", "\\'"))
                for k, v in step.get("params", {}).items()
            )
            try:
                res = s.query("USE gpuslo; " + sets + step["sql"], "JSONCompact")
                text = str(res).strip()
                out.append({"rows": json.loads(text)["data"] if text else []})
            except Exception as exc:  # reported to the test, which fails with it
                out.append({"error": str(exc)[:3000]})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
