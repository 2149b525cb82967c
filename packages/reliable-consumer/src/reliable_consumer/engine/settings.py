"""Every knob of the worker, validated once at start.

Read from the environment (prefix ``WORKER_``, nested fields joined by ``__``) and
from a ``.env`` file. Invalid values stop the process before it connects anywhere,
with the setting's name in the message. Secrets are ``SecretStr`` so they never
appear in reprs, logs or error messages.

This module is long because it holds every knob, one model per part of the worker, and the
checks that tie parts together (``Settings._consistent``, ``Settings._no_loops``) need
them all in one place.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reliable_consumer.engine.declaration.location import APP_SETTING, current_app, current_app_spec
from reliable_consumer.engine.declaration.naming import KEY_PREFIX, TOPIC_NAME, check_bindings
from reliable_consumer.engine.declaration.naming import check_topic as _check_topic
from reliable_consumer.engine.handlers.policies import BreakerPolicy, RetryPolicy
from reliable_consumer.engine.kafka.outcome_events import Layout
from reliable_consumer.engine.redis.keys import tagged_prefix
from reliable_consumer.engine.redis.url import url_problem


def _secret_text(value: str | SecretStr | None) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value or ""


class KafkaSettings(BaseModel):
    """How to reach the brokers and which group to join."""

    bootstrap_servers: str = "localhost:9092"
    # Defaults from the app declaration (service/app.py): its name and its consumer group.
    client_id: str = Field(default_factory=lambda: current_app().name)
    group_id: str = Field(default_factory=lambda: current_app().consumer_group)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: SecretStr | None = None
    # A new group starts from the beginning: skipping records is never the safe default.
    auto_offset_reset: Literal["earliest", "latest", "none"] = "earliest"
    max_poll_records: int = Field(default=2000, ge=1, le=100_000)
    max_poll_interval_ms: int = Field(default=300_000, ge=1000)
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    fetch_max_bytes: int = Field(default=52_428_800, ge=1024)
    max_partition_fetch_bytes: int = Field(default=1_048_576, ge=1024)
    # read_committed so records of aborted producer transactions are never granted.
    isolation_level: Literal["read_uncommitted", "read_committed"] = "read_committed"
    producer_linger_ms: int = Field(default=5, ge=0, le=1000)
    request_timeout_ms: int = Field(default=30_000, ge=1000)

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap_has_hosts(cls, value: str) -> str:
        hosts = [h.strip() for h in value.split(",") if h.strip()]
        if not hosts or any(":" not in h for h in hosts):
            raise ValueError("expected a comma-separated list of host:port")
        return ",".join(hosts)

    @field_validator("group_id")
    @classmethod
    def _group_id_legal(cls, value: str) -> str:
        if not TOPIC_NAME.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits, '.', '_' or '-' (1-249)")
        return value

    @model_validator(mode="after")
    def _sasl_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL"):
            # An empty value (an unset secret rendered as "") is as missing as no value.
            missing = [
                name
                for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                if not _secret_text(getattr(self, name))
            ]
            if missing:
                raise ValueError(
                    f"WORKER_KAFKA__SECURITY_PROTOCOL={self.security_protocol} needs "
                    + ", ".join(f"WORKER_KAFKA__{m.upper()}" for m in missing)
                )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("WORKER_KAFKA__SSL_CERTFILE and WORKER_KAFKA__SSL_KEYFILE go together")
        return self


class RedisSettings(BaseModel):
    """Where idempotency markers, the retry queue and handler effects live."""

    url: SecretStr = SecretStr("redis://localhost:6379/0")
    key_prefix: str = Field(default_factory=lambda: current_app().redis_key_prefix)
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    socket_timeout_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=32, ge=2)
    # What a write must reach before the worker treats it as durable (see docs/durability.md).
    durability: Literal["local", "wait_replicas", "wait_aof"] = "local"
    wait_replicas: int = Field(default=1, ge=1)
    wait_timeout_ms: int = Field(default=1000, ge=1)
    # Refuse to start when Redis has persistence off: a parked retry would die with the server.
    require_persistence: bool = True
    # A Redis Cluster (managed cluster mode): connections go to the primary owning the
    # service's hash slot (docs/redis-cluster.md). The key names are the same either way.
    cluster: bool = False

    @property
    def effective_prefix(self) -> str:
        """What every key of the service starts with: ``{prefix}``, a hash tag, on one Redis
        and on a cluster alike, so all keys hash to one slot and one layout serves both
        (an older layout without the tag is moved by ``service redis migrate``)."""
        return tagged_prefix(self.key_prefix)

    @model_validator(mode="after")
    def _cluster_url(self) -> RedisSettings:
        if not self.cluster:
            return self
        raw = self.url.get_secret_value()
        if raw.startswith("unix://"):
            raise ValueError(
                "WORKER_REDIS__CLUSTER=true needs a redis:// or rediss:// WORKER_REDIS__URL "
                "(a cluster's nodes are reached over TCP)"
            )
        path = raw.partition("://")[2].partition("?")[0].partition("/")[2].strip("/")
        if path not in ("", "0"):
            raise ValueError(
                "WORKER_REDIS__CLUSTER=true needs database 0 in WORKER_REDIS__URL "
                "(a Redis Cluster has no other)"
            )
        return self

    @field_validator("url")
    @classmethod
    def _url_usable(cls, value: SecretStr) -> SecretStr:
        """Judged by redis-py's own parser now, not by a traceback at the first connect."""
        raw = value.get_secret_value()
        if not raw.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        problem = url_problem(raw)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix_plain(cls, value: str) -> str:
        if not KEY_PREFIX.fullmatch(value):
            raise ValueError("use 1-64 letters, digits, '.', '_' or '-' (no ':' or braces)")
        return value


class RetrySettings(BaseModel):
    """Backoff of the delay queue: min(max, base * multiplier**(attempt-1)), with ± jitter."""

    base_delay_ms: int = Field(default=1_000, ge=0)
    multiplier: float = Field(default=2.0, ge=1.0)
    max_delay_ms: int = Field(default=600_000, ge=0)
    jitter: float = Field(default=0.2, ge=0.0, le=1.0)
    # When retries are spent: after this many runs, or this long after the first failure,
    # whichever comes first (at least one set). A record waits out an outage of hours
    # rather than being dead-lettered (the circuit breaker keeps an outage from spending
    # them); a handler may declare its own policy on @handler(retry=RetryPolicy(...)).
    max_attempts: int | None = Field(default=None, ge=1, le=100_000)
    max_age_s: float | None = Field(default=12 * 3600, gt=0)
    # How long a claimed retry may run before the reaper hands it to someone else.
    lease_ms: int = Field(default=60_000, ge=100)
    poll_interval_ms: int = Field(default=250, ge=10)
    claim_batch: int = Field(default=200, ge=1, le=10_000)
    # A fresh delivery that finds its key claimed elsewhere is parked this long.
    busy_delay_ms: int = Field(default=2_000, ge=0)
    # While the oldest retry not yet run (due, or claimed and still running) is later than
    # this, the worker's intake fetches no fresh records (its own scheduler measures it), so
    # retries keep their moment under a fresh backlog; 0 or None: off. One such pause lasts
    # at most priority_max_pause_ms, and fresh records then get as long as it lasted: retries
    # hold them back half the time at most.
    priority_after_ms: int | None = Field(default=50, ge=0, le=3_600_000)
    priority_max_pause_ms: int = Field(default=2_000, ge=10, le=60_000)
    # Meanwhile the fresh records fetched before the pause wait too, before their handlers
    # (batch/lane.py), and retries' async calls go first in the handler pool; false: only
    # the fetches pause, and what was fetched runs on beside the retries.
    priority_holds_fetched: bool = True
    # A retry falling due while fresh waves run inline: they yield the loop every 64 records
    # at once, and wait for its claim once it is this late unclaimed (a turn: 50 ms at
    # most, then as long for them; batch/lane.py). 0 or None: neither.
    turn_after_ms: int | None = Field(default=10, ge=0, le=60_000)

    @model_validator(mode="after")
    def _delays_ordered(self) -> RetrySettings:
        if self.max_delay_ms < self.base_delay_ms:
            raise ValueError("WORKER_RETRY__MAX_DELAY_MS must be >= WORKER_RETRY__BASE_DELAY_MS")
        if self.max_attempts is None and self.max_age_s is None:
            raise ValueError(
                "set WORKER_RETRY__MAX_ATTEMPTS, WORKER_RETRY__MAX_AGE_S or both: "
                "retries must end somewhere"
            )
        return self

    def policy(self) -> RetryPolicy:
        """The backoff and limits, as the policy of handlers that declare none."""
        return RetryPolicy(
            base_delay_ms=self.base_delay_ms,
            multiplier=self.multiplier,
            max_delay_ms=self.max_delay_ms,
            jitter=self.jitter,
            max_attempts=self.max_attempts,
            max_age_s=self.max_age_s,
        )


class IdempotencySettings(BaseModel):
    """How long a done-marker is remembered and how long a claim is held.

    ``ttl_s`` None (the default): done and dead markers never expire, so "granted" is
    permanent whatever is replayed or redelivered later (docs/contracts.md gives the memory
    it costs). With a TTL, a record is granted only inside the dedupe window, timestamps in
    ``[now - ttl_s + window_margin_s, now + window_margin_s]``: older ones could find their
    marker expired, so they are dead-lettered as ``beyond_dedupe_window`` instead.
    """

    ttl_s: int | None = Field(default=None, ge=60)
    # Slack for clocks (producers set record timestamps) and for the time between a
    # record's timestamp and its marker being written.
    window_margin_s: int = Field(default=3600, ge=0)
    lease_ms: int = Field(default=60_000, ge=100)

    @model_validator(mode="after")
    def _window_fits(self) -> IdempotencySettings:
        if self.ttl_s is not None and self.ttl_s <= 2 * self.window_margin_s:
            raise ValueError(
                "WORKER_IDEMPOTENCY__TTL_S must be more than twice "
                f"WORKER_IDEMPOTENCY__WINDOW_MARGIN_S ({self.window_margin_s} s), or unset "
                "(markers that never expire)"
            )
        return self

    def window_refusal(self, timestamp_ms: int, now_ms: int) -> str | None:
        """Why a record with this Kafka timestamp must not be granted, or None when it may."""
        if self.ttl_s is None:
            return None
        oldest = now_ms - (self.ttl_s - self.window_margin_s) * 1000
        newest = now_ms + self.window_margin_s * 1000
        if timestamp_ms < oldest:
            return (
                f"record timestamp {timestamp_ms} is older than the dedupe window "
                f"(WORKER_IDEMPOTENCY__TTL_S={self.ttl_s} minus a margin of "
                f"{self.window_margin_s} s): its done-marker may have expired"
            )
        if timestamp_ms > newest:
            return (
                f"record timestamp {timestamp_ms} is more than {self.window_margin_s} s in the "
                "future: its done-marker could expire before its redeliveries end"
            )
        return None


class OutcomeSettings(BaseModel):
    """The audit trail: one event per record to a topic that reconciliation reads."""

    enabled: bool = True
    topic: str | None = None
    # batch: a document per finished batch and source partition; record: a Kafka record per
    # event, as layout 1 did, for outside readers not yet able to read documents.
    layout: Layout = "batch"

    @field_validator("topic")
    @classmethod
    def _topic_legal(cls, value: str | None) -> str | None:
        return None if value is None else _check_topic(value)


class DeadLetterSettings(BaseModel):
    topic_template: str = "{topic}.dlq"

    @field_validator("topic_template")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if "{topic}" not in value:
            raise ValueError("must contain {topic}")
        _check_topic(value.replace("{topic}", "t"))
        return value


class OutboxSettings(BaseModel):
    """The relay that publishes handlers' emitted records from the outbox (docs/outbox.md)."""

    # Entries read, published and acknowledged as one step.
    batch_size: int = Field(default=500, ge=1, le=10_000)
    # How long a relay's hold on a store lasts unless renewed: a killed relay's store is
    # taken over by another worker after at most this long.
    lease_ms: int = Field(default=10_000, ge=1000, le=600_000)
    # How often an idle relay looks for entries another process wrote (FINISH in its own
    # process wakes it at once), and how often a worker without the lease tries to take it.
    poll_interval_ms: int = Field(default=500, ge=10, le=60_000)
    # Entries kept in the trail of what was published (``service trace``), newest last.
    published_trail: int = Field(default=100_000, ge=0, le=10_000_000)
    # Consecutive failed publish rounds before the relay reports the outbox_relay_failing stall.
    stall_after_failures: int = Field(default=3, ge=1, le=1000)
    # Kafka's idempotent producer for the relay: "auto" uses it when the broker grants a
    # producer id and else publishes with plain acks=all (one log line says why); "on"
    # refuses to start without it; "off" never asks (engine/outbox/producer.py).
    idempotence: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="after")
    def _lease_outlasts_poll(self) -> OutboxSettings:
        if self.poll_interval_ms * 2 > self.lease_ms:
            raise ValueError(
                "WORKER_OUTBOX__LEASE_MS must be at least twice WORKER_OUTBOX__POLL_INTERVAL_MS "
                "(the lease is renewed once per poll)"
            )
        return self


class HttpSettings(BaseModel):
    """The health and metrics endpoint (no authentication: who may reach it is the network's
    business, see deploy/README.md)."""

    enabled: bool = True
    # Loopback unless told otherwise: a worker run on a laptop must not publish its metrics.
    # The image sets 0.0.0.0 (the kubelet probes the pod's IP; deploy/k8s/networkpolicy.yaml
    # says who else may connect).
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # A request head not complete by then is dropped (slow or idle clients hold no thread).
    read_timeout_s: float = Field(default=5.0, gt=0, le=300)
    # Connections open at once; over it the oldest incomplete one is dropped, else the new one.
    max_connections: int = Field(default=64, ge=1, le=10_000)
    # Threads answering complete requests (a connection gets one only once its head is in).
    threads: int = Field(default=4, ge=1, le=64)
    # A listening socket handed over by the process that started this one (the supervisor
    # of `service run --processes N` gives each worker one on loopback): serve it instead
    # of opening host:port, so no port is chosen in one process and bound in another.
    fd: int | None = Field(default=None, ge=0)

    @field_validator("host")
    @classmethod
    def _host_literal(cls, value: str) -> str:
        import ipaddress

        if value == "localhost":
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"{value!r}: use an IP address to listen on (127.0.0.1 loopback only, "
                "0.0.0.0 or :: every interface) or localhost"
            ) from None
        return value


class SwarmSettings(BaseModel):
    """`service run --processes N`: N workers in one container, each a member of the group.

    One Python process uses one core; a pod given more runs more workers under one
    supervisor, which restarts a worker that dies or stops answering its liveness probe,
    and serves the pod's one health and metrics endpoint (engine/swarm/).
    """

    # How many workers: a number, or "auto" for the cores this container may use (its CPU
    # affinity, bounded by its cgroup CPU quota: a pod's CPU limit).
    processes: int | Literal["auto"] = 1
    # A worker that died is started again after 1 s, doubling while it keeps dying, to this.
    restart_backoff_max_s: float = Field(default=30.0, ge=1, le=3600)
    # A worker that died this long ago or more without staying up, or whose liveness probe
    # has failed this long, makes the pod's liveness fail (the kubelet restarts the pod).
    unhealthy_after_s: float = Field(default=120.0, ge=5, le=86_400)
    # A worker whose liveness probe has failed this long is stopped and started again.
    restart_unlive_after_s: float = Field(default=30.0, ge=1, le=86_400)

    @field_validator("processes")
    @classmethod
    def _bounded(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 64:
            raise ValueError(f"{value}: between 1 and 64 worker processes, or auto")
        return value


class ConsoleSettings(BaseModel):
    """``service console``: the operators' web pages, a process of its own (not the worker's).

    Read-only unless a token is set; with one, the actions (retry now, redrive, drop) ask
    for it on every request. Loopback by default, like the metrics endpoint.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8081, ge=0, le=65535)
    # Actions are refused without it; set it from a secret (WORKER_CONSOLE__TOKEN).
    token: SecretStr | None = None
    # How often the partitions page refreshes itself, seconds.
    refresh_s: float = Field(default=5.0, ge=1, le=3600)

    @field_validator("token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """An empty variable (compose passing an unset one through) means read-only."""
        if value == "" or (isinstance(value, SecretStr) and not value.get_secret_value()):
            return None
        return value

    @field_validator("token")
    @classmethod
    def _token_strong(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (or unset: a read-only console)")
        return value

    @field_validator("host")
    @classmethod
    def _host_literal(cls, value: str) -> str:
        return HttpSettings._host_literal(value)


class PostgresSettings(BaseModel):
    """The PostgreSQL effects store (``@handler(store="postgres")``; the ``postgres`` extra).

    Unset (no URL) unless a bound handler keeps its effects there. The inbox table is made
    by ``service db migrate`` (reliable_consumer/engine/postgres/sql/); the worker refuses to start
    without it.
    """

    # libpq URI or key=value string, e.g. postgresql://worker:secret@db:5432/orders.
    url: SecretStr | None = None
    # Connections kept open; a batch's wave holds one for its transaction.
    pool_min: int = Field(default=1, ge=0, le=1000)
    pool_max: int = Field(default=16, ge=1, le=1000)
    # How long a wave waits for a connection (and a connection attempt) before the wave's
    # records count as failed for a reason outside them (retried; the breaker sees it).
    connect_timeout_s: float = Field(default=10.0, gt=0, le=600)
    # Refuse to start when a committed transaction could be lost in a crash (fsync=off,
    # synchronous_commit=off): an inbox row would vanish and a grant be made twice.
    require_durable_commit: bool = True
    # The project's migrations, run after the engine's by ``service db migrate``; unset
    # means the app declaration's folder (service/migrations/; the engine's inbox schema
    # ships inside the package, reliable_consumer/engine/postgres/sql/).
    migrations_dir: str | None = None
    # The outbox (kafka_outbox): a published row is kept this long for `service trace`, then
    # deleted, at most ``outbox_prune_batch`` rows per relay round so a backlog of old rows
    # never becomes one long DELETE.
    outbox_retention_h: float = Field(default=24.0, ge=0, le=24 * 90)
    outbox_prune_batch: int = Field(default=1000, ge=1, le=100_000)

    @field_validator("url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        if value == "" or (isinstance(value, SecretStr) and not value.get_secret_value()):
            return None
        return value

    @field_validator("url")
    @classmethod
    def _url_usable(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        raw = value.get_secret_value()
        if raw.startswith(("postgresql://", "postgres://")):
            return value
        if "=" in raw and not raw.startswith(("redis", "http")):  # key=value conninfo
            return value
        raise ValueError("must be a postgresql:// URI or a libpq key=value string")

    @model_validator(mode="after")
    def _pool_sane(self) -> PostgresSettings:
        if self.pool_min > self.pool_max:
            raise ValueError("WORKER_POSTGRES__POOL_MIN must be <= WORKER_POSTGRES__POOL_MAX")
        return self


class SchemaRegistrySettings(BaseModel):
    """The schema registry of handlers reading registry-framed values (``RegistryAvro``).

    Unset (no URL) unless a bound handler declares ``value_format=RegistryAvro(...)``; the
    worker refuses to start such a handler without it. Needs the ``avro`` extra.
    """

    # The Confluent-compatible API's base URL, e.g. http://registry:8081 (Confluent) or
    # http://registry:8080/apis/ccompat/v7 (Apicurio).
    url: str | None = None
    username: str | None = None
    password: SecretStr | None = None
    # One look-up's bound: a registry slower than this counts as not answering (retried,
    # counted in worker_schema_registry_requests{result="timeout"}).
    timeout_s: float = Field(default=5.0, gt=0, le=120)
    # How long an id the registry does not know stays known as unknown (its records are
    # dead-lettered ``malformed``) before it is asked again.
    unknown_id_ttl_s: float = Field(default=60.0, ge=0, le=86_400)

    @field_validator("url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("url")
    @classmethod
    def _url_usable(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value


class Settings(BaseSettings):
    """The worker's whole configuration."""

    model_config = SettingsConfigDict(
        env_prefix="WORKER_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
        # WORKER_RETRY__MAX_AGE_S=none (or WORKER_IDEMPOTENCY__TTL_S=none): unset a limit.
        env_parse_none_str="none",
    )

    # The app declaration the defaults below come from, as module:attribute. Chosen once
    # per process, before the settings are read (reliable_consumer/engine/declaration/location.py:
    # the --app option, this, or [tool.service] app in pyproject.toml).
    app: str = Field(default_factory=lambda: current_app_spec().target)
    # Built when the settings are, not at import: their defaults name the app.
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    retry: RetrySettings = RetrySettings()
    # The circuit breaker of handlers that declare none on @handler (WORKER_BREAKER__*).
    breaker: BreakerPolicy = BreakerPolicy()
    idempotency: IdempotencySettings = IdempotencySettings()
    outcomes: OutcomeSettings = OutcomeSettings()
    dead_letter: DeadLetterSettings = DeadLetterSettings()
    http: HttpSettings = HttpSettings()
    swarm: SwarmSettings = SwarmSettings()
    console: ConsoleSettings = ConsoleSettings()
    postgres: PostgresSettings = PostgresSettings()
    schema_registry: SchemaRegistrySettings = SchemaRegistrySettings()
    outbox: OutboxSettings = OutboxSettings()

    # Handler name -> the topic it consumes; the default is the app declaration's topics
    # (service/app.py), where `service new-handler` binds new handlers.
    topics: dict[str, str] = Field(default_factory=lambda: dict(current_app().topics))
    # Records fetched and not yet done, in total and per partition (memory and redelivery bound).
    max_in_flight: int = Field(default=5000, ge=1)
    max_in_flight_per_partition: int = Field(default=2500, ge=1)
    # And their bytes (key + value + headers): 5000 records of up to 1 MiB would be 5 GB.
    # 128 MiB leaves the 512Mi pod of deploy/k8s room for the fetch buffer and the heap.
    max_in_flight_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    # A partition's fetched records are processed in batches of at most this many.
    max_batch_records: int = Field(default=500, ge=1, le=10_000)
    # Async handlers running at once (what the services they call see as concurrency).
    max_concurrent_handlers: int = Field(default=200, ge=1)
    # Order inside a partition: per Kafka key (default), whole partition, or none. "key" and
    # "partition" also keep a key's records in order across retries (a record waits behind an
    # earlier one of its key in the delay queue; docs/architecture.md, Per-key order), which
    # a handler may turn off with @handler(ordering="none").
    ordering: Literal["key", "partition", "none"] = "key"
    # Commit the contiguous watermark this often, or after this many completions.
    commit_interval_ms: int = Field(default=1000, ge=10)
    commit_every_records: int = Field(default=5000, ge=1)
    handler_timeout_s: float = Field(default=30.0, gt=0)
    # A handler past its timeout is cancelled again on every watchdog tick; one that still
    # runs this much later (it ignores cancellation) is abandoned: its record is retried or
    # dead-lettered as for a timeout, and the handler_stuck stall lasts while it still runs.
    handler_cancel_grace_s: float = Field(default=5.0, gt=0)
    max_record_bytes: int = Field(default=1_048_576, ge=1)
    revoke_grace_s: float = Field(default=10.0, ge=0)
    shutdown_grace_s: float = Field(default=25.0, ge=0)
    # Freeze the startup heap, collect young objects less often, and collect everything when
    # the memory asks (runtime.tune_gc and collect_when_memory_grows).
    tune_gc: bool = True
    # With tune_gc: a full collection once the process's RSS has grown this much since the
    # last one, and at least this often whatever the memory does.
    gc_collect_growth_mb: int = Field(default=32, ge=1, le=4096)
    gc_collect_max_interval_s: float = Field(default=5.0, ge=1.0, le=3600.0)
    # The event loop: uvloop when installed (auto), or one of the two by name.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    # Start-up check of the dead-letter and outcome topics' replication factor and
    # min.insync.replicas (docs/durability.md): "auto" refuses to start when
    # WORKER_REDIS__DURABILITY is not "local" and only warns when it is.
    topic_durability: Literal["auto", "off", "warn", "require"] = "auto"
    topic_min_insync_replicas: int = Field(default=2, ge=1)
    # Run the retry scheduler inside the worker (it can also run as its own process).
    run_retry_scheduler: bool = True
    # Fault injection from record headers (x-fault); for demos and chaos tests, never production.
    fault_injection: bool = False
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "console"] = "json"
    # While Redis or a Kafka topic keeps failing, a summary line this often (one line when it
    # starts, one when it clears; each failed try only at DEBUG).
    outage_summary_interval_s: float = Field(default=10.0, gt=0)

    @field_validator("app")
    @classmethod
    def _the_process_app(cls, value: str) -> str:
        """The app is chosen once, before the settings: a different one here would mix
        this app's defaults with another's name."""
        chosen = current_app_spec()
        if value != chosen.target:
            raise ValueError(
                f"{value!r} is not the app this process runs ({chosen.describe()}); "
                f"the app is chosen at start: pass --app or set {APP_SETTING} before it"
            )
        return value

    @field_validator("topics")
    @classmethod
    def _topics_legal(cls, value: dict[str, str]) -> dict[str, str]:
        return check_bindings(value)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_in_flight_per_partition > self.max_in_flight:
            raise ValueError("WORKER_MAX_IN_FLIGHT_PER_PARTITION must be <= WORKER_MAX_IN_FLIGHT")
        if self.max_in_flight_bytes < self.kafka.max_partition_fetch_bytes:
            raise ValueError(
                "WORKER_MAX_IN_FLIGHT_BYTES must be >= WORKER_KAFKA__MAX_PARTITION_FETCH_BYTES "
                f"({self.kafka.max_partition_fetch_bytes}), or a fetched record may never fit"
            )
        if self.handler_timeout_s * 1000 >= self.idempotency.lease_ms:
            raise ValueError(
                "WORKER_IDEMPOTENCY__LEASE_MS must exceed WORKER_HANDLER_TIMEOUT_S (in ms), "
                "or a slow handler's claim expires while it still runs"
            )
        if self.handler_timeout_s * 1000 >= self.retry.lease_ms:
            raise ValueError("WORKER_RETRY__LEASE_MS must exceed WORKER_HANDLER_TIMEOUT_S (in ms)")
        return self

    @model_validator(mode="after")
    def _no_loops(self) -> Settings:
        """What the worker produces must never be a topic it consumes: each failure (or
        each outcome event) would come back as a new record, forever."""
        bound = set(self.topics.values())
        dead_letters: dict[str, str] = {}
        for topic in self.topics.values():
            dlq = self.dead_letter_topic(topic)
            try:
                _check_topic(dlq)
            except ValueError as exc:
                raise ValueError(
                    f"WORKER_DEAD_LETTER__TOPIC_TEMPLATE for {topic!r}: {exc}"
                ) from None
            if dlq in bound:
                raise ValueError(
                    f"WORKER_DEAD_LETTER__TOPIC_TEMPLATE={self.dead_letter.topic_template!r} "
                    f"sends the dead letters of {topic!r} to the bound topic {dlq!r}: a loop "
                    "(use e.g. '{topic}.dlq')"
                )
            dead_letters[dlq] = topic
        outcomes = self.outcomes_topic()
        if outcomes is not None and (outcomes in bound or outcomes in dead_letters):
            what = "a bound topic" if outcomes in bound else "a dead-letter topic"
            source = "" if self.outcomes.topic else " (from WORKER_KAFKA__GROUP_ID)"
            raise ValueError(
                f"WORKER_OUTCOMES__TOPIC: the outcomes topic {outcomes!r}{source} is {what}: "
                "a loop (outcome events would be consumed as records, or mixed with dead "
                "letters); name another topic"
            )
        return self

    def dead_letter_topic(self, topic: str) -> str:
        return self.dead_letter.topic_template.replace("{topic}", topic)

    def outcomes_topic(self) -> str | None:
        if not self.outcomes.enabled:
            return None
        return self.outcomes.topic or f"{self.kafka.group_id}.outcomes"


def load_settings(**overrides: object) -> Settings:
    """Load settings, turning validation errors into one readable ConfigurationError."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from reliable_consumer.engine.errors import ConfigurationError

    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigurationError(describe_validation_error(exc)) from None
    except SettingsError as exc:
        # e.g. WORKER_KAFKA='{not json': the message names the field, never the value; the
        # cause (which holds the raw text, secrets included) is dropped.
        raise ConfigurationError(f"invalid settings:\n  {exc}") from None


def describe_validation_error(exc: object) -> str:
    """Name each bad setting as its environment variable, without echoing secret input."""
    from pydantic import ValidationError

    assert isinstance(exc, ValidationError)
    lines = ["invalid settings:"]
    for err in exc.errors(include_input=False, include_url=False):
        path = [str(p) for p in err["loc"]]
        env = "WORKER_" + "__".join(p.upper() for p in path) if path else "WORKER_*"
        lines.append(f"  {env} ({'.'.join(path) or 'settings'}): {err['msg']}")
    return "\n".join(lines)
