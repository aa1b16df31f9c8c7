"""A row type of the rules built in more than one place has no field defaults.

``Incident`` (rules/model.py) is made by ``rules.evaluate.incidents`` (positionally, from the
starvation query's columns: ``map(Incident, ...)``) and by ``rules.evaluate._incident`` (from a
row, for the job report). A field added with a default is left at it by whichever builder was not
changed, and no test fails (a positional ``map`` given one column fewer fills the last field with
its default); without a default, the builder that lacks it raises in every test that builds one.
"""

from __future__ import annotations

import dataclasses

from gpuslo.rules.model import Incident


def test_an_incident_has_no_field_defaults() -> None:
    defaults = [
        f.name
        for f in dataclasses.fields(Incident)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert not defaults, (
        f"Incident: {defaults} have defaults; both builders (rules/evaluate.py incidents and _incident) "
        "must set every field"
    )
