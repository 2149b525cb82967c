"""What makes this service this one: its name and its default bindings.

The project template renders this file from the answers given at generation time;
everything else in ``service/`` is shared code copied from the template repository
(docs/template.md). Environment variables override each value at run time.
``service new-handler`` adds its bindings to ``TOPICS``.
"""

from __future__ import annotations

# The distribution name; also the default Kafka client id (WORKER_KAFKA__CLIENT_ID).
SERVICE_NAME = "{{ cookiecutter.project_slug }}"
# The consumer group the worker joins (WORKER_KAFKA__GROUP_ID).
CONSUMER_GROUP = "{{ cookiecutter.consumer_group }}"
# Prefix of every Redis key the worker writes (WORKER_REDIS__KEY_PREFIX).
REDIS_KEY_PREFIX = "{{ cookiecutter.redis_key_prefix }}"
# Handler name -> the topic it consumes (WORKER_TOPICS replaces the whole mapping).
TOPICS: dict[str, str] = {
{%- if cookiecutter.first_topic == "payments" and cookiecutter.effects_store == "postgres" %}
    "purchases": "payments",
{%- elif cookiecutter.first_topic == "payments" %}
    "payments": "payments",
{%- endif %}
}
