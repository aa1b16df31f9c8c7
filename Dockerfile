# The gpuslo images: agent, ingest and rules are subcommands of one console script.
#   docker build -t gpuslo:0.1.0 .                          the whole set, gpuslo[all] (ingest, rules, dashboards)
#   docker build --target agent -t gpuslo-agent:0.1.0 .     the node agent alone, gpuslo[agent]: no chDB, pyarrow,
#                                                           ClickHouse driver or grafanalib (docs/deployment.md)
FROM python:3.11-slim AS source
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gpuslo ./gpuslo
COPY agent ./agent
COPY ingest ./ingest
COPY rules ./rules
COPY dashboards ./dashboards
RUN useradd --system --uid 10001 gpuslo && mkdir -p /var/lib/gpuslo/spool && chown -R gpuslo /var/lib/gpuslo

FROM source AS agent
RUN pip install --no-cache-dir -c constraints.txt '.[agent]'
USER gpuslo
ENTRYPOINT ["gpuslo"]

# the last stage is the default target
FROM source AS full
RUN pip install --no-cache-dir -c constraints.txt '.[all]'
USER gpuslo
ENTRYPOINT ["gpuslo"]
