# syntax=docker/dockerfile:1
#
# payments-worker image.
#
#   docker build -t payments-worker:dev .
#   docker run --rm -p 8080:8080 -e WORKER_KAFKA__BOOTSTRAP_SERVERS=... payments-worker:dev
#
# Configuration comes only from WORKER_* environment variables (docs/contracts.md);
# nothing is baked into the image but the health/metrics bind address (below). The default command is `service run`; pass
# `retry-scheduler` as the command to run only the retry scheduler, `db migrate` to apply
# the PostgreSQL effects store's migrations (compose's `migrate`, the k8s migration Job).
#
# Both stages use the same pinned base so the virtualenv built in the first one
# (which records the interpreter path /usr/local/bin/python3) works in the second.
# For reproducible production builds, also pin the digest:
#   FROM python:3.11.14-slim-bookworm@sha256:<digest>

############################ builder ############################
FROM python:3.11.14-slim-bookworm AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# A self-contained virtualenv that the runtime stage copies as a whole.
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Only what the install needs: the build metadata, the readme it references, the package,
# the pinned versions of every dependency, and the engine's wheels (wheels/: the engine
# when the project takes it from there; only a README when it comes from your index).
COPY pyproject.toml README.md constraints.txt ./
COPY service ./service
COPY wheels ./wheels

# Build the project's wheel (hatchling runs in pip's isolated build environment and
# does not end up in /opt/venv), then install it with its runtime dependencies: the engine
# (reliable-consumer, at the version pyproject.toml pins, with its `postgres` and `console`
# extras: psycopg 3 with its own libpq, binary wheel, no apt packages) and every other
# distribution at the version constraints.txt pins. Nothing from the `dev` extra (the
# test kit, the embedded dev servers) reaches the image. The engine's and the project's
# SQL migrations travel inside the wheels (reliable_consumer/engine/postgres/sql/, service/migrations/).
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip install --find-links wheels -c constraints.txt "$(ls /wheels/payments_worker-*.whl)" \
 && pip check

############################ runtime ############################
FROM python:3.11.14-slim-bookworm AS runtime

LABEL org.opencontainers.image.title="payments-worker" \
      org.opencontainers.image.description="Reliable Kafka consumer: idempotent handlers, Redis retries, dead letters, PostgreSQL effects" \
      org.opencontainers.image.licenses="Apache-2.0"

# The worker's own default bind is loopback (a process on a laptop publishes nothing); in a
# container the port is reached through the container's address (kubelet probes, -p, the
# compose network), so the image listens on every interface of its own network namespace.
# Who may connect is the network's business: deploy/k8s/networkpolicy.yaml.
# The image holds the installed package, not pyproject.toml, so it names the app
# declaration itself (service/app.py; docs/contracts.md, WORKER_APP).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    WORKER_APP=service.app:app \
    WORKER_HTTP__HOST=0.0.0.0

# Fixed UID/GID so Kubernetes can assert runAsUser: 10001 / runAsNonRoot.
RUN groupadd --system --gid 10001 worker \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin worker

# Owned by root and read-only for the worker: the image works with a read-only root filesystem.
COPY --from=builder /opt/venv /opt/venv

WORKDIR /app
USER 10001:10001

EXPOSE 8080

# Liveness over the stdlib (the slim image has no curl). Any exception, including an
# HTTP 503 from /healthz, exits 1 = unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('WORKER_HTTP__PORT', '8080') + '/healthz', timeout=3)"]

# Exec form: the Python process is PID 1 and receives SIGTERM directly. The worker
# installs its own SIGTERM handler and drains within WORKER_SHUTDOWN_GRACE_S; keep the
# orchestrator's grace period (compose stop_grace_period, k8s
# terminationGracePeriodSeconds) longer than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["service"]
CMD ["run"]
