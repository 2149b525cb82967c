"""The schema registry's HTTP API, asked for a writer's schema by id (httpx, asynchronous).

Speaks the Confluent API (``GET {url}/schemas/ids/{id}``), which Confluent's registry and the
compatible ones (Apicurio under ``/apis/ccompat/v7``, Karapace, Redpanda) serve. Every call
is bounded by the settings' timeout. The answer sorts into three: the schema; the registry
saying there is no such id (``SchemaNotFound``: the record's fault); anything else, a
registry that is down, slow, failing or refusing us (``RegistryUnavailable``: nobody's
record's fault, retried until it answers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from reliable_consumer.engine.observation.metrics import Metrics

INSTALL_HINT = "pip install 'reliable-consumer[avro]'"


class SchemaNotFound(LookupError):
    """The registry answered that no schema has this id."""


class RegistryUnavailable(ConnectionError):
    """The registry did not give an answer about the id (down, timed out, 5xx, refused us)."""


@dataclass(frozen=True, slots=True)
class RegistrySchema:
    schema_id: int
    schema_type: str  # AVRO, JSON, PROTOBUF
    text: str
    references: int  # how many other schemas it references (not supported yet)


class RegistryClient:
    """One connection pool to the registry; ``schema_by_id`` is the only question asked."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        metrics: Metrics | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        try:
            import httpx
        except ImportError:
            from reliable_consumer.engine.errors import ConfigurationError

            raise ConfigurationError(f"a schema registry needs httpx: {INSTALL_HINT}") from None
        self._httpx = httpx
        self.url = url.rstrip("/")
        self._metrics = metrics
        auth = httpx.BasicAuth(username, password or "") if username else None
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s),
            auth=auth,
            headers={"Accept": "application/vnd.schemaregistry.v1+json, application/json"},
        )

    async def schema_by_id(self, schema_id: int) -> RegistrySchema:
        httpx = self._httpx
        started = time.monotonic()
        try:
            answer = await self._client.get(f"/schemas/ids/{schema_id}")
        except httpx.TimeoutException as exc:
            self._count("timeout", started)
            raise RegistryUnavailable(f"{self.url} did not answer in time: {exc!r}") from None
        except httpx.HTTPError as exc:
            self._count("error", started)
            raise RegistryUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        if answer.status_code == 404:
            self._count("unknown", started)
            raise SchemaNotFound(f"the schema registry has no schema id {schema_id}")
        if answer.status_code != 200:
            self._count("error", started)
            raise RegistryUnavailable(
                f"{self.url} answered HTTP {answer.status_code} for schema id {schema_id}: "
                f"{answer.text[:200]}"
            )
        try:
            body = answer.json()
            text = body["schema"]
        except (ValueError, KeyError, TypeError):
            self._count("error", started)
            raise RegistryUnavailable(
                f"{self.url} answered schema id {schema_id} without a schema: {answer.text[:200]}"
            ) from None
        self._count("found", started)
        return RegistrySchema(
            schema_id,
            str(body.get("schemaType") or "AVRO"),
            str(text),
            len(body.get("references") or ()),
        )

    def _count(self, result: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.schema_registry_requests.labels(result).inc()
            self._metrics.schema_registry_seconds.observe(time.monotonic() - started)

    async def aclose(self) -> None:
        await self._client.aclose()
