"""The bottom layer beside the wire schema: settings, the in-process bus, file and YAML helpers,
Kafka error classes. Imports nothing of gpuslo but `gpuslo.wire`."""
