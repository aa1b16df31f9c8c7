# The gpuslo image: agent, ingest and rules are subcommands of one console script.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gpuslo ./gpuslo
COPY agent ./agent
COPY ingest ./ingest
COPY rules ./rules
COPY dashboards ./dashboards
RUN pip install --no-cache-dir -c constraints.txt . && useradd --system --uid 10001 gpuslo && mkdir -p /var/lib/gpuslo/spool \
    && chown -R gpuslo /var/lib/gpuslo
USER gpuslo
ENTRYPOINT ["gpuslo"]
