"""The container images the container back-end starts: one place, the same as docker-compose.yml
(tests/test_containers.py parses the compose file and requires both to agree)."""

from __future__ import annotations

# compose service -> image
IMAGES = {
    "kafka": "apache/kafka:4.1.0",
    "clickhouse": "clickhouse/clickhouse-server:24.8",
    "grafana": "grafana/grafana:12.2.0",
    "alertmanager": "prom/alertmanager:v0.28.1",
}
# Grafana's GF_INSTALL_PLUGINS, as docker-compose.yml sets it (no version there: Grafana installs
# the plugin's newest release compatible with the image's Grafana version)
GRAFANA_PLUGINS = "grafana-clickhouse-datasource"
# the oldest ClickHouse server version the schema supports (README); the image's must be >= it
CLICKHOUSE_MIN = (24, 8)


def image_version(image: str) -> tuple[int, ...]:
    """The numeric version of an image tag: ``clickhouse/clickhouse-server:24.8`` -> (24, 8)."""
    tag = image.rsplit(":", 1)[1].lstrip("v")
    return tuple(int(p) for p in tag.split("."))
