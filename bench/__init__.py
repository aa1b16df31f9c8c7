"""Benchmarks: ``python -m bench`` lists them, ``python -m bench NAME`` runs one.

Each prints readable lines and ends with one line holding a JSON object of its
figures; a figure with a baseline also comes as a ratio measured in the same run."""
