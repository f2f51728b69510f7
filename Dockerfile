# The Charlie image used by docker-compose.yml for workers, beat, Flower and migrations.
FROM python:3.11-slim
# git for the devbox's workspaces; bubblewrap for run_command's sandbox (a container must allow
# user namespaces for it, or run_command is refused: `charlie doctor` says which); passt (pasta)
# connects the commands whose task allows the network, in their own network namespace.
RUN apt-get update && apt-get install -y --no-install-recommends git bubblewrap passt && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY charlie ./charlie
# A plain install, no extras: the same step CI's fresh-install round checks (.ci/fresh-install),
# which brings the Redis and RabbitMQ transports and both PostgreSQL drivers.
RUN pip install --no-cache-dir .
RUN useradd --create-home charlie && mkdir -p /data && chown charlie /data
USER charlie
ENV CHARLIE_HOME=/data
