"""What the post-generation hook does: bring in the example service, apply the answers,
and give the project its engine.

A generated service holds only its team's files; the engine is the library
``reliable-consumer`` (packages/reliable-consumer), a pinned dependency. The template
repository's top level *is* the example service (``service/``, ``tests/``, ``deploy/``,
``Dockerfile``): cookiecutter renders just the files that vary per project (the folder
``{{cookiecutter.project_slug}}/``), and this module copies the example's files from the
template checkout into the new project, rewrites the few places in them that name the
project (``SITES`` below), binds the first topic, and builds the library's wheels into
``wheels/`` (answer ``library_source=wheels``). Generated with the default answers, every
copied file is byte-identical to the repository's (hooks/tests/template proves it).

Loaded by ``hooks/post_gen_project.py`` from the checkout, by file path, and run in
whatever interpreter runs cookiecutter: standard library only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

TEMPLATE_DIR = "{{cookiecutter.project_slug}}"
# Copied from the template checkout into every generated project: the example service.
SHARED = (
    "service",
    "tests",
    "docs",
    "deploy",
    "Dockerfile",
    ".dockerignore",
    ".gitignore",
    "constraints.txt",
)
# The library and its pipeline: built into the project's wheels/, never copied as code.
LIBRARY = "packages/reliable-consumer"
PIPELINE_LIBRARY = "packages/reliable-consumer-pipeline"
WHEELS = "wheels"
# Dropped when the answer is "no".
OPTIONAL: dict[str, tuple[str, ...]] = {"include_k8s": ("deploy/k8s",)}
# Test modules elsewhere under tests/ that need a dropped part are dropped with it. Today
# tests/deploy/test_deploy_artifacts.py reads deploy/k8s at import time, so a project
# without Kubernetes manifests loses that whole module (docs/template.md); a project
# without the pipeline loses any test that imports it.
OPTIONAL_TESTS = {
    "include_k8s": re.compile(r"""["']k8s["']|deploy/k8s"""),
    "include_pipeline": re.compile(r"\breliable_consumer_pipeline\b"),
}
# The worked example every project keeps (make run, the integration tests use it).
EXAMPLE_HANDLER = "payments"
EXAMPLE_MODEL = "PaymentSucceeded"
# The same example keeping its grants in PostgreSQL (service/handlers/purchases.py: same
# model, same dedupe key); the answer effects_store=postgres binds it instead.
POSTGRES_EXAMPLE = "purchases"
EXAMPLES = {"redis": EXAMPLE_HANDLER, "postgres": POSTGRES_EXAMPLE}
# deploy/README.md's test record for a scaffolded first handler: its model's one required
# field (reliable_consumer/dev/scaffold.py); tests/template/test_own_names.py runs it through it.
SCAFFOLD_SAMPLE_ID = "evt_1"


class GenerationError(Exception):
    """Generation cannot complete; cookiecutter then removes the half-made project."""


@dataclasses.dataclass(frozen=True)
class Answers:
    """The answers, plus what follows from them once the first handler is bound."""

    slug: str
    group: str
    prefix: str
    image: str
    topic: str
    python: str
    include_k8s: bool
    include_pipeline: bool
    effects_store: str = "redis"
    library_source: str = "wheels"
    library_version: str = ""
    first_handler: str = EXAMPLE_HANDLER
    first_model: str = EXAMPLE_MODEL
    topics: tuple[tuple[str, str], ...] = ((EXAMPLE_HANDLER, "payments"),)

    @classmethod
    def from_context(cls, context: Mapping[str, Any]) -> Answers:
        return cls(
            slug=context["project_slug"],
            group=context["consumer_group"],
            prefix=context["redis_key_prefix"],
            image=context["image_name"],
            topic=context["first_topic"],
            python=context["python_version"],
            include_k8s=context["include_k8s"] == "yes",
            include_pipeline=context["include_pipeline"] == "yes",
            effects_store=context["effects_store"],
            library_source=context.get("library_source", "wheels"),
            library_version=context.get("library_version", ""),
        )

    @property
    def example(self) -> str:
        """The example handler this project binds where it binds one."""
        return EXAMPLES[self.effects_store]

    @property
    def wheel(self) -> str:
        """The wheel file's name prefix (PEP 427 escapes '-' and '.')."""
        return re.sub(r"[-_.]+", "_", self.slug).lower()

    @property
    def topics_json(self) -> str:
        """WORKER_TOPICS as the deploy files spell it."""
        return json.dumps(dict(self.topics))

    @property
    def base_topics_json(self) -> str:
        """WORKER_TOPICS of the base deploy files, which need no database: the example on
        its Redis twin (``payments``), every other binding as service/app.py has it."""
        return self._topics_with_example(EXAMPLE_HANDLER)

    @property
    def postgres_topics_json(self) -> str:
        """WORKER_TOPICS of the deploy files' postgres overlays: the example on its
        PostgreSQL twin (``purchases``), every other binding as it is."""
        return self._topics_with_example(POSTGRES_EXAMPLE)

    def _topics_with_example(self, example: str) -> str:
        twins = set(EXAMPLES.values())
        return json.dumps({example if n in twins else n: t for n, t in self.topics})

    @property
    def deploy_first_handler(self) -> str:
        """The first topic's handler in the base deploy files (the example's Redis twin)."""
        return EXAMPLE_HANDLER if self.first_handler in EXAMPLES.values() else self.first_handler

    @property
    def python_regex(self) -> str:
        return self.python.replace(".", "\\.")


# The repository's own values: what the shared files say, and what the default answers are.
DEFAULTS = Answers(
    slug="payments-worker",
    group="payments-worker",
    prefix="payments-worker",
    image="registry.example.com/payments-worker",
    topic="payments",
    python="3.11",
    include_k8s=True,
    include_pipeline=True,
)

Value = Callable[[Answers, str], str]


@dataclasses.dataclass(frozen=True)
class Site:
    """A place in the shared files that names the project: the regex group ``old``
    becomes ``value(answers, old)``.

    ``required`` sites must match somewhere in their files (when any of those files
    exist): if a shared file changes and a site vanishes, generation stops and says
    which, instead of shipping a project that still names the payments worker.
    Sites in tests and prose are best-effort; the generated project's own test run is
    their check. ``yaml_scalar`` quotes a value YAML would not read as a string.
    """

    paths: tuple[str, ...]
    pattern: str
    value: Value
    required: bool = False
    yaml_scalar: bool = False


def _token(literal: str) -> str:
    """``literal`` as a whole name: not part of a longer name (names use . _ -)."""
    return rf"(?<![A-Za-z0-9._-])(?P<old>{re.escape(literal)})(?![A-Za-z0-9_-])"


def _slug(a: Answers, old: str) -> str:
    return a.slug


def _group(a: Answers, old: str) -> str:
    return a.group


def _prefix(a: Answers, old: str) -> str:
    return a.prefix


def _image(a: Answers, old: str) -> str:
    return a.image


def _wheel(a: Answers, old: str) -> str:
    return a.wheel


def _topic(a: Answers, old: str) -> str:
    return a.topic


def _topics_json(a: Answers, old: str) -> str:
    return a.topics_json


def _base_topics_json(a: Answers, old: str) -> str:
    return a.base_topics_json


def _postgres_topics_json(a: Answers, old: str) -> str:
    return a.postgres_topics_json


def _first_model(a: Answers, old: str) -> str:
    return a.first_model


def _sample_record(a: Answers, old: str) -> str:
    """A record the first topic's handler accepts, as ``key|value`` for the console producer."""
    if a.deploy_first_handler == EXAMPLE_HANDLER:
        return old
    return f"{SCAFFOLD_SAMPLE_ID}|{json.dumps({'event_id': SCAFFOLD_SAMPLE_ID})}"


def _sample_effect(a: Answers, old: str) -> str:
    """The redis-cli command that shows the sample record's effect: the key its handler writes."""
    if a.deploy_first_handler == EXAMPLE_HANDLER:
        return f"XRANGE {{{a.prefix}}}:ledger:purchases - +"
    return f"HGETALL {{{a.prefix}}}:{a.first_handler}:{SCAFFOLD_SAMPLE_ID}"


def _deploy_first_handler(a: Answers, old: str) -> str:
    return a.deploy_first_handler


def _part_of(a: Answers, old: str) -> str:
    # The system the service belongs to; the template's is "payments", a new one is its own.
    return old if a.slug == DEFAULTS.slug else a.slug


def _python_image(a: Answers, old: str) -> str:
    # The repository pins a patch release; for another minor version pin the minor.
    return old if a.python == DEFAULTS.python else a.python


def _python_regex(a: Answers, old: str) -> str:
    return a.python_regex


# fnmatch patterns on POSIX paths relative to the project; `*` also matches `/`.
YAML = ("deploy/*.yml", "deploy/*.yaml")
COMPOSE = ("deploy/docker-compose.yml",)
K8S = ("deploy/k8s/*.yaml",)
DEPLOY = ("deploy/*",)
DOCKERFILE = ("Dockerfile",)
DOCS = ("docs/*.md", "deploy/README.md")
DEPLOY_README = ("deploy/README.md",)
TESTS = ("tests/*.py",)
NAME = "payments-worker"
NAME_TOKEN = _token(NAME)
# The project's name, also inside longer names: payments-worker-config, payments-worker.json.
NAME_ANYWHERE = r"(?<![A-Za-z0-9._-])(?P<old>payments-worker)(?![A-Za-z0-9_])"
OUTCOMES = r"(?<![A-Za-z0-9._-])(?P<old>payments-worker)(?=\.outcomes\b)"
TOPICS_LITERAL = r"(?P<old>\{\"payments\": \"payments\"\})"
POSTGRES_TOPICS_LITERAL = r"(?P<old>\{\"purchases\": \"payments\"\})"

# Where sites overlap the first one listed wins: the specific ones come before the
# generic project name at the end.
SITES: tuple[Site, ...] = (
    # The image: the wheel the Dockerfile installs, the base image, the image name.
    Site(DOCKERFILE, r"/wheels/(?P<old>payments_worker)-\*\.whl", _wheel, required=True),
    Site(DOCKERFILE, r"python:(?P<old>3\.11\.\d+)-slim", _python_image, required=True),
    Site(DOCS, r"python:(?P<old>3\.11\.\d+)-slim", _python_image),
    Site(TESTS, r"python:(?P<old>3\\\.11)", _python_regex),
    Site(DEPLOY, r"(?P<old>registry\.example\.com/payments-worker)(?![\w./-])", _image, True),
    # The consumer group, and the outcomes topic named after it.
    Site(YAML, r"WORKER_KAFKA__GROUP_ID:\s*\"?" + NAME_TOKEN, _group, True, yaml_scalar=True),
    Site(K8S, r"consumerGroup:\s*\"?" + NAME_TOKEN, _group, required=True),
    Site(COMPOSE, OUTCOMES, _group, required=True),
    Site((*DOCS, *TESTS), OUTCOMES, _group),
    Site(DOCS, r"WORKER_KAFKA__GROUP_ID \|[^|\n]*\| " + NAME_TOKEN, _group),
    Site(DOCS, r"WORKER_KAFKA__CLIENT_ID \|[^|\n]*\| " + NAME_TOKEN, _slug),
    Site(TESTS, r"group_id == \"(?P<old>payments-worker)\"", _group),
    # The Redis key prefix.
    Site(YAML, r"WORKER_REDIS__KEY_PREFIX:\s*\"?" + NAME_TOKEN, _prefix, True, yaml_scalar=True),
    Site(DOCS, r"WORKER_REDIS__KEY_PREFIX \|[^|\n]*\| " + NAME_TOKEN, _prefix),
    # The least-privilege Redis ACL user (docs/security.md): its keys are the tagged prefix's.
    Site(DOCS, r"^user (?P<old>payments-worker) on ", _slug, required=True),
    Site(DOCS, r" ~\{(?P<old>payments-worker)\}:\* ", _prefix, required=True),
    # deploy/README.md's test record: produced to the first topic, so it is one that
    # topic's handler accepts, and the effect shown is the one that handler writes.
    Site(DEPLOY_README, r"payload model: `(?P<old>PaymentSucceeded)`", _first_model, True),
    Site(DEPLOY_README, r"`service/handlers/(?P<old>payments)\.py`", _deploy_first_handler, True),
    Site(DEPLOY_README, r"^(?P<old>pay_1\|\{\"payment_id\".*)$", _sample_record, True),
    Site(
        DEPLOY_README, r"redis-cli (?P<old>XRANGE \S+:ledger:purchases - \+)", _sample_effect, True
    ),
    Site(DOCS, r"(?<![A-Za-z0-9._-])(?P<old>payments-worker)(?=\}?:ledger:)", _prefix),
    Site(TESTS, r"key_prefix == \"(?P<old>payments-worker)\"", _prefix),
    # The topic bindings and the first topic.
    # The base deploy files run the example on Redis, the postgres overlays (compose,
    # deploy/k8s/postgres) on PostgreSQL, whichever twin service/app.py binds.
    Site(YAML, r"WORKER_TOPICS:\s*'" + TOPICS_LITERAL + "'", _base_topics_json, required=True),
    Site(YAML, r"WORKER_TOPICS:\s*'" + POSTGRES_TOPICS_LITERAL + "'", _postgres_topics_json, True),
    Site(DOCS, r"WORKER_TOPICS \|[^|\n]*\| " + TOPICS_LITERAL, _topics_json),
    Site(TESTS, r"topics == " + TOPICS_LITERAL, _topics_json),
    Site(COMPOSE, r"create (?P<old>payments)(?= \d| *\n)", _topic, required=True),
    Site(COMPOSE, r"create (?P<old>payments)(?=\.dlq\b)", _topic, required=True),
    Site(COMPOSE, r"--topic (?P<old>payments)(?![\w.-])", _topic, required=True),
    Site(K8S, r"\btopic:\s*\"(?P<old>payments)\"", _topic, required=True),
    Site(DEPLOY, r"`(?P<old>payments)(?=(\.dlq)?`)", _topic),
    Site(DEPLOY, r"--topic (?P<old>payments)(?![\w.-])", _topic),
    # The ACL list of docs/security.md (`service acls`) and its example refusal.
    Site(DOCS, r"Topic '(?P<old>payments)(?=(\.dlq)?')", _topic),
    Site(DOCS, r"User:(?P<old>payments-worker)(?=(-operator)?[: ])", _group),
    Site(DOCS, r"Group (prefix )?'(?P<old>payments-worker)(?=(\.redrive)?')", _group),
    Site(TESTS, r"PAYMENTS_TOPIC = \"(?P<old>payments)\"", _topic),
    # Everything else that names the project: Kubernetes names, labels, compose, Grafana.
    Site(K8S, r"part-of: (?P<old>payments)$", _part_of),
    Site((*DEPLOY, *DOCKERFILE), NAME_ANYWHERE, _slug, required=True),
)

YAML_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def post_generate(project: Path, template: Path, context: Mapping[str, Any]) -> None:
    """Turn the freshly rendered folder into a complete project."""
    answers = Answers.from_context(context)
    copy_shared(template, project, answers)
    answers = bind_first_topic(project, template, answers)
    apply_answers(project, answers)
    sync_deploy(project, template)
    build_wheels(template, project, answers)


def copy_shared(template: Path, project: Path, answers: Answers) -> None:
    """Copy the shared files in; the template's rendered files take precedence."""
    rendered_root = template / TEMPLATE_DIR
    rendered = {
        p.relative_to(rendered_root).as_posix() for p in rendered_root.rglob("*") if p.is_file()
    }
    skip: set[str] = set()
    dropped = [answer for answer in OPTIONAL_TESTS if not getattr(answers, answer)]
    for answer in dropped:
        skip.update(OPTIONAL.get(answer, ()))
    ignored = _gitignore(template / ".gitignore")
    for top in SHARED:
        if not (template / top).exists():
            raise GenerationError(f"the template checkout has no {top}")
        for relative in _walk(template, top, skip, ignored):
            if relative in rendered or _needs_dropped_part(template, relative, dropped):
                continue
            target = project / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(template / relative, target)


def _needs_dropped_part(template: Path, relative: str, dropped: list[str]) -> bool:
    if not dropped or not relative.startswith("tests/") or not relative.endswith(".py"):
        return False
    source = (template / relative).read_text(encoding="utf-8")
    return any(OPTIONAL_TESTS[answer].search(source) for answer in dropped)


def bind_first_topic(project: Path, template: Path, answers: Answers) -> Answers:
    """Give the first topic its own handler (scaffolded), or bind the example to it.

    The default answer (``payments``) is bound by the rendered service/app.py. Any
    other topic gets a handler named after it, written by the project's own
    ``service new-handler`` code, so what generation writes and what the scaffold writes
    can never differ; in the answer's store (``effects_store=postgres``: a postgres
    handler, its table's migration and its real-database test).
    """
    scaffold = _import_dev_module(template, "scaffold")
    if answers.topic != DEFAULTS.topic:
        name = scaffold.handler_name_for_topic(answers.topic)
        if name == EXAMPLE_HANDLER:  # e.g. `Payments`: the example is the right handler
            scaffold.bind(project, answers.example, answers.topic)
        else:
            scaffold.new_handler(project, name, answers.topic, answers.effects_store)
    bindings: dict[str, str] = scaffold.read_bindings(project)
    first = next(n for n, t in bindings.items() if t == answers.topic)
    model = EXAMPLE_MODEL if first in EXAMPLES.values() else scaffold.model_name(first)
    return dataclasses.replace(
        answers, first_handler=first, first_model=model, topics=tuple(bindings.items())
    )


def apply_answers(project: Path, answers: Answers) -> None:
    """Rewrite every site in the shared files; fail if a required site has gone."""
    counts = dict.fromkeys(range(len(SITES)), 0)
    present = dict.fromkeys(range(len(SITES)), False)
    for path in sorted(p for p in project.rglob("*") if p.is_file()):
        relative = path.relative_to(project).as_posix()
        sites = [i for i, s in enumerate(SITES) if _matches(relative, s.paths)]
        if not sites:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # not text: nothing to rewrite
            continue
        claimed: list[tuple[int, int, str]] = []
        for i in sites:
            present[i] = True
            site = SITES[i]
            for match in re.finditer(site.pattern, text, flags=re.MULTILINE):
                start, end = match.span("old")
                if any(s < end and start < e for s, e, _ in claimed):
                    continue
                counts[i] += 1
                new = site.value(answers, match["old"])
                quoted = start > 0 and text[start - 1] in "\"'"
                if site.yaml_scalar and not quoted and not _yaml_plain(new):
                    new = json.dumps(new)
                claimed.append((start, end, new))
        for start, end, new in sorted(claimed, reverse=True):
            text = text[:start] + new + text[end:]
        path.write_text(text, encoding="utf-8")
    missing = [SITES[i] for i in counts if SITES[i].required and present[i] and not counts[i]]
    if missing:
        listed = "\n".join(f"  {', '.join(s.paths)}: {s.pattern}" for s in missing)
        raise GenerationError(
            "the shared files no longer contain these answer sites; update SITES in "
            f"hooks/generation.py (docs/template.md):\n{listed}"
        )
    _rename_named_files(project / "deploy", answers.slug)


def _rename_named_files(root: Path, slug: str) -> None:
    for path in sorted(root.rglob(f"*{NAME}*"), reverse=True):
        path.rename(path.with_name(path.name.replace(NAME, slug)))


def _yaml_plain(value: str) -> bool:
    return bool(YAML_PLAIN.match(value)) and value.lower() not in YAML_WORDS


def _matches(relative: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(relative, p) for p in patterns)


def _gitignore(path: Path) -> list[str]:
    """The template's .gitignore, so local clutter (.venv, caches, .env) is never copied."""
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith(("#", "!"))]


def _ignored(relative: str, is_dir: bool, patterns: list[str]) -> bool:
    """A subset of gitignore: name globs anywhere, ``dir/`` for directories, ``a/b`` anchored."""
    name = relative.rsplit("/", 1)[-1]
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if dir_only and not is_dir:
            continue
        if "/" in pattern:
            if fnmatch.fnmatchcase(relative, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _walk(root: Path, top: str, skip: set[str], ignored: list[str]) -> Iterator[str]:
    """Files under ``root/top`` (or ``top`` itself), as POSIX paths relative to ``root``."""
    if (root / top).is_file():
        yield top
        return
    for current, dirs, files in os.walk(root / top):
        base = Path(current).relative_to(root).as_posix()
        dirs[:] = sorted(
            d
            for d in dirs
            if f"{base}/{d}" not in skip and not _ignored(f"{base}/{d}", True, ignored)
        )
        for name in sorted(files):
            relative = f"{base}/{name}"
            if not _ignored(relative, False, ignored):
                yield relative


def sync_deploy(project: Path, template: Path) -> None:
    """The deploy files' bindings, topic creation and KEDA triggers, derived from the
    project's service/app.py as ``service deploy sync`` derives them."""
    deploy_sync = _import_dev_module(template, "deploy_sync")
    try:
        deploy_sync.sync(project)
    except deploy_sync.DeploySyncError as exc:
        raise GenerationError(f"deriving the deploy files' bindings: {exc}") from None


def _import_dev_module(template: Path, module: str) -> types.ModuleType:
    """The library's ``reliable_consumer.dev.<module>`` (the scaffold, the deploy sync), from
    the template checkout, without running the library's ``__init__``.

    That package imports pydantic and the rest of the library's dependencies, which the
    interpreter running cookiecutter does not have; these modules and the naming rules they
    use need only the standard library.
    """
    name = "reliable_consumer"
    saved = {k: v for k, v in sys.modules.items() if k == name or k.startswith(f"{name}.")}
    for key in saved:
        del sys.modules[key]
    package = types.ModuleType(name)
    package.__path__ = [str(template / LIBRARY / "src" / name)]
    sys.modules[name] = package
    try:
        return importlib.import_module(f"{name}.dev.{module}")
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
            del sys.modules[key]
        sys.modules.update(saved)


def build_wheels(template: Path, project: Path, answers: Answers) -> None:
    """Build the library (and its pipeline, when the project includes it) into ``wheels/``.

    ``wheels/`` always exists (the Dockerfile copies it); with ``library_source=index`` it
    holds only its README.

    The project installs the engine from there (its Makefile and Dockerfile pass
    ``--find-links wheels``), so a fresh machine needs no package index of the team's. The
    wheel's version must be the one the project pins: a checkout whose library says
    otherwise stops generation here rather than at the project's first ``make``.
    """
    out = project / WHEELS
    out.mkdir(exist_ok=True)
    shutil.copy2(template / WHEELS / "README.md", out / "README.md")
    if answers.library_source != "wheels":  # the engine comes from the team's index
        return
    sources = [LIBRARY] + ([PIPELINE_LIBRARY] if answers.include_pipeline else [])
    for source in sources:
        version = _declared_version(template / source / "pyproject.toml")
        if answers.library_version and version != answers.library_version:
            raise GenerationError(
                f"{source}/pyproject.toml says version {version}, but cookiecutter.json's "
                f"_library_version is {answers.library_version}: make them agree"
            )
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
        if importlib.util.find_spec("hatchling") is not None:
            # The build backend is here already: skip pip's isolated build environment,
            # which fetches it from the index for every build (~10 s each).
            command.append("--no-build-isolation")
        command += ["--wheel-dir", str(out), str(template / source)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise GenerationError(
                f"building the wheel of {source} failed (pip wheel, exit {result.returncode}); "
                "generate with library_source=index to take the engine from your package "
                f"index instead:\n{result.stdout}{result.stderr}"
            )


def _declared_version(pyproject: Path) -> str:
    with pyproject.open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])
