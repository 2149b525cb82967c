"""Generating projects from this repository the way users do, in subprocesses.

cookiecutter runs as its command-line program with an isolated config (no user
replay or clone cache is read or written), and a generated project's own tests run
with the interpreter of this suite: its environment already has every dependency a
generated project declares, so nothing is installed per project. ``PYTHONPATH``
points at the generated project so that *its* ``service`` package is the one
imported, not this repository's (which the editable install puts on the path too);
``project_python`` checks that.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]  # the template repository
HOOKS = ROOT / "hooks"

# Lines of a generated project that name the template on purpose: (file, the line's text,
# why it stays). test_own_names.py fails on an entry no longer used: a fixed leftover goes.
NAMES_THAT_STAY = (
    ("README.md", "generated from the payments-worker template", "names the template"),
    ("docs/template.md", "git.example.com/platform/payments-worker", "the template's URL"),
    ("docs/template.md", "cookiecutter /path/to/payments-worker", "the template's checkout"),
    ("docs/template.md", "WORKER_KAFKA__GROUP_ID: payments-worker", "how SITES work"),
    ("docs/template.md", "`create payments 6`, ...)", "how SITES work"),
    ("docs/template.md", "still says `payments-worker`", "how SITES work"),
    ("docs/template.md", "no `payments-worker` is left", "what the template tests prove"),
)


def load_module(path: Path, name: str) -> ModuleType:
    """Import a hook file by path (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cookiecutter_config(tmp: Path) -> Path:
    config = tmp / "cookiecutter-config.yaml"
    if not config.exists():
        config.write_text(
            f"cookiecutters_dir: {tmp / 'cookiecutters'}\nreplay_dir: {tmp / 'replay'}\n"
        )
    return config


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment minus anything that would configure the worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "PYTEST_"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def run_cookiecutter(
    out: Path, answers: dict[str, str], template: Path = ROOT, temp_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``cookiecutter TEMPLATE --no-input -o OUT key=value ...``, as a user types it;
    ``temp_dir`` is its TMPDIR (where it writes each hook's rendered copy)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [f"{key}={value}" for key, value in answers.items()]
    env = clean_env(COOKIECUTTER_CONFIG=str(cookiecutter_config(out.parent)))
    if temp_dir is not None:
        env["TMPDIR"] = str(temp_dir)
    return subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(template), "--no-input", "-o", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def generate(out: Path, answers: dict[str, str], template: Path = ROOT) -> Path:
    """Generate and return the project folder; fail the test with cookiecutter's output."""
    result = run_cookiecutter(out, answers, template)
    assert result.returncode == 0, result.stdout + result.stderr
    (project,) = (p for p in out.iterdir() if p.is_dir())
    return project


def project_python(
    project: Path, *args: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run this suite's interpreter inside ``project``, importing the project's own code."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=clean_env(PYTHONPATH=str(project)),
    )


def assert_imports_its_own_service(project: Path) -> None:
    probe = project_python(project, "-c", "import service; print(service.__file__)")
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).resolve() == (project / "service" / "__init__.py").resolve()


def run_project_tests(project: Path, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    assert_imports_its_own_service(project)
    return project_python(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args)


def repository_files(*tops: str) -> set[str]:
    """Files of this checkout under ``tops`` that git would track (ignored ones left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *tops],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {f for f in listed.split("\0") if f and (ROOT / f).is_file()}


def project_files(project: Path, *tops: str) -> set[str]:
    found = set()
    for top in tops:
        path = project / top
        if path.is_file():
            found.add(top)
        for p in path.rglob("*") if path.is_dir() else ():
            if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts:
                found.add(p.relative_to(project).as_posix())
    return found
