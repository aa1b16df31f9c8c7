"""The top layer: the command line, the embedded stack and its terminal text. Imports every
component; nothing imports it."""
