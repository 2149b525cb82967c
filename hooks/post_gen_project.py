"""Complete the rendered project from the template checkout (docs/template.md).

cookiecutter renders only the files that vary per project; this hook finds the
template checkout this generation comes from and hands over to hooks/generation.py,
which copies the shared code in and applies the answers. If anything fails the hook
exits 1 and cookiecutter removes the half-made project.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

# cookiecutter renders this string with the answers as JSON (which never holds three " in a row).
CONTEXT_JSON = r"""{{ {
    "project_slug": cookiecutter.project_slug,
    "first_topic": cookiecutter.first_topic,
    "consumer_group": cookiecutter.consumer_group,
    "redis_key_prefix": cookiecutter.redis_key_prefix,
    "image_name": cookiecutter.image_name,
    "python_version": cookiecutter.python_version,
    "include_k8s": cookiecutter.include_k8s,
    "include_pipeline": cookiecutter.include_pipeline,
    "effects_store": cookiecutter.effects_store,
    "library_source": cookiecutter.library_source,
    "library_version": cookiecutter._library_version,
    "_repo_dir": cookiecutter.get("_repo_dir", "") | string,
    "_template": cookiecutter.get("_template", "") | string,
    "_commit": cookiecutter.get("_commit", "") | string,
} | tojson }}"""


def is_template(path: Path) -> bool:
    return (path / "cookiecutter.json").is_file() and (path / "hooks" / "generation.py").is_file()


def head_commit(path: Path) -> str:
    result = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def template_checkout(context: dict[str, str], scratch: Path) -> Path:
    """The template files this generation is rendered from.

    cookiecutter passes ``_repo_dir`` (relative when the template was given as a
    relative path; this hook runs inside the new project, so resolve it against the
    caller's directory). cruft passes no ``_repo_dir`` but records ``_template`` and
    ``_commit``; while the hook runs, cookiecutter and cruft both sit in the checkout,
    so on Linux the parent's working directory is it. Otherwise clone that commit.
    """
    commit = context["_commit"]
    candidates: list[Path] = []
    if context["_repo_dir"]:
        repo_dir = Path(context["_repo_dir"]).expanduser()
        candidates.append(
            repo_dir if repo_dir.is_absolute() else Path(os.environ.get("PWD", "/")) / repo_dir
        )
    candidates.append(Path(f"/proc/{os.getppid()}/cwd"))
    for candidate in candidates:
        if is_template(candidate) and (not commit or head_commit(candidate) == commit):
            return candidate.resolve()
    if context["_template"] and commit:
        clone = scratch / "template"
        for command in (
            ["git", "clone", "--quiet", "--no-checkout", "--", context["_template"], str(clone)],
            ["git", "-C", str(clone), "checkout", "--quiet", commit],
        ):
            subprocess.run(command, check=True, stdin=subprocess.DEVNULL)
        if is_template(clone):
            return clone
    raise RuntimeError(
        "cannot find the template checkout (tried "
        + ", ".join(str(c) for c in candidates)
        + "); give cookiecutter the template as an absolute path or a git URL"
    )


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("service_template_generation", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def remove_rendered_copy() -> None:
    """Delete this file when it is the copy cookiecutter rendered into the temp dir.

    cookiecutter runs a hook from a rendered copy it writes there and never removes, so
    every generation (a refused one too) would leave one per hook; the template's own hook
    file (in hooks/) is never touched. Python has read the file already: running goes on.
    """
    me = Path(__file__).resolve()
    if me.parent == Path(tempfile.gettempdir()).resolve() and me.name.startswith("tmp"):
        me.unlink(missing_ok=True)


def main() -> int:
    remove_rendered_copy()
    context = json.loads(CONTEXT_JSON)
    with tempfile.TemporaryDirectory(prefix="service-template-") as scratch:
        try:
            template = template_checkout(context, Path(scratch))
            generation = load(template / "hooks" / "generation.py")
            generation.post_generate(Path.cwd(), template, context)
        except Exception as exc:  # report it as the hook's failure, not a traceback
            print(f"error: generating the project failed: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
