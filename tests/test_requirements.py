"""The install the README names is the install each README command needs: every third-party module
an entry point can import (its import closure through the project's own modules, read with `ast`,
deferred imports included) belongs to a distribution that its requirements file declares:
`requirements.txt` for the user's commands, `requirements-dev.txt` for the tests and benchmarks."""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("train", "train.export_hf", "eval", "eval.report", "eval.replicate", "eval.dose", "eval.publish",
           "eval.qk_clip_log", "generate", "data.tokenizer", "data.prepare", "data.documents")
DEV_ONLY_PACKAGES = ("bench", "tests")


def _module_file(name: str) -> Path | None:
    """The file that runs for `import name` in the repository (a package's `__init__.py`)."""
    base = REPO.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _project_name(name: str, importer: str) -> str | None:
    """`name` as a dotted path from the repository root when the project provides it: a package or
    module at the root, or (as for a test importing `run_checks`) one beside the importing module."""
    for prefix in ("", importer.rpartition(".")[0]):
        full = f"{prefix}.{name}" if prefix else name
        top = REPO.joinpath(*full.split(".")[: len(prefix.split(".")) + 1 if prefix else 1])
        if top.is_dir() or top.with_suffix(".py").is_file():
            return full
    return None


def _entry_modules(command: str) -> list[str]:
    """What `python -m command` runs: the module (a package's `__main__` too) and its parent packages."""
    parts = command.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    if (REPO.joinpath(*parts) / "__main__.py").is_file():
        names.append(f"{command}.__main__")
    return names


@functools.cache
def _imported_names(path: Path, module: str) -> frozenset[str]:
    """Every dotted name `path` imports anywhere in it (a `from a import b` gives `a` and `a.b`);
    relative imports resolved against the module's package. Cached: the commands' closures share
    most of their files."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = ".".join(part for part in (base, node.module) if part)
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return frozenset(names)


def third_party_imports(command: str) -> dict[str, str]:
    """Top-level third-party name -> the project module that imports it, over the command's closure."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    todo = _entry_modules(command)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is None:
            continue
        for name in _imported_names(path, module):
            project = _project_name(name, module)
            top = name.split(".")[0]
            if project is not None:
                parts = project.split(".")
                todo.extend(".".join(parts[: i + 1]) for i in range(len(parts)))
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, module)
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


NO_DEPS = re.compile(r"#\s*pip install --no-deps (\S+)\s*$")


def declared(requirements: Path, no_deps: bool = False) -> set[str]:
    """The distributions a requirements file names, following `-r other.txt`; with `no_deps`, also
    those a comment line says to install as `pip install --no-deps X` (no requirements line can:
    requirements-dev.txt's litgpt, whose own pins transformers>=5 cannot meet)."""
    names = set()
    for raw in requirements.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r"):
            names |= declared(requirements.parent / line[2:].strip(), no_deps)
        elif line:
            names.add(_normal(Requirement(line).name))
        elif no_deps and (match := NO_DEPS.fullmatch(raw.strip())):
            names.add(_normal(Requirement(match[1]).name))
    return names


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """Installed import name -> its distributions (reading them all takes about 0.3 s: once)."""
    return packages_distributions()


def undeclared(command: str, requirements: Path, no_deps: bool = False) -> list[str]:
    """`module imports name (distribution)` for each third-party import no declared distribution
    provides. An import that no installed distribution provides (an optional one, such as
    bench.train's litgpt, on a machine without it) is taken to come from the distribution of its
    own name."""
    distributions = _distributions()
    allowed = declared(requirements, no_deps)
    missing = []
    for name, module in sorted(third_party_imports(command).items()):
        providers = {_normal(d) for d in distributions.get(name, [])}
        if not (providers or {_normal(name)}) & allowed:
            missing.append(f"{module} imports {name} ({', '.join(sorted(providers)) or 'not installed'})")
    return missing


def _dev_commands() -> list[str]:
    scripts = [p for package in DEV_ONLY_PACKAGES for p in sorted((REPO / package).glob("*.py"))]
    return [".".join(p.relative_to(REPO).with_suffix("").parts) for p in scripts]


@pytest.mark.parametrize("command", RUNTIME)
def test_each_user_command_needs_only_requirements_txt(command):
    assert not undeclared(command, REPO / "requirements.txt")


@pytest.mark.parametrize("command", _dev_commands())
def test_each_benchmark_and_test_needs_only_requirements_dev_txt(command):
    assert not undeclared(command, REPO / "requirements-dev.txt", no_deps=True)


USER_DOCS = ("README.md", "docs/GUIDE.md", "docs/BENCHMARKS.md", "docs/GPU.md", "docs/OPTIMIZERS.md")


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_documented_command_is_checked(doc):
    """A `python -m X` or `python X.py` in the README or the user docs it points to is a runtime or a
    dev-only command above."""
    text = (REPO / doc).read_text()
    commands = set(re.findall(r"python -m ([\w.]+)", text))
    commands |= {".".join(Path(p).with_suffix("").parts) for p in re.findall(r"python ([\w/]+\.py)", text)}
    commands -= {"pytest", "pip", "venv"}
    assert commands, f"no commands found in {doc}"
    unchecked = {c for c in commands if c not in RUNTIME and c.split(".")[0] not in DEV_ONLY_PACKAGES}
    assert not unchecked, unchecked


def test_readme_opens_with_the_install_and_stays_short():
    """A newcomer meets the install command on the first screen, and the README stays a front page
    (the narrative lives in docs/)."""
    lines = (REPO / "README.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("pip install -r requirements.txt"))
    assert first <= 40 and len(lines) <= 400, (first, len(lines))


def _pins(path: Path) -> dict[str, str]:
    """`constraints.txt`'s `name==version` lines, by normalised name."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not a pin"
            pins[_normal(requirement.name)] = spec.version
    return pins


def unpinned(requirements: Path, constraints: Path) -> list[str]:
    """Each requirement (but torch, which the user installs for their hardware) that the constraints
    file does not pin to a version the requirement admits."""
    pins = _pins(constraints)
    problems = []
    for name in sorted(declared(requirements) - {"torch"}):
        if name not in pins:
            problems.append(f"{name} has no pin")
    for raw in requirements.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line and not line.startswith("-r"):
            requirement = Requirement(line)
            pin = pins.get(_normal(requirement.name))
            if pin is not None and not requirement.specifier.contains(pin, prereleases=True):
                problems.append(f"{requirement.name}=={pin} is outside {requirement.specifier}")
    return problems


def test_constraints_pin_every_requirement_within_its_range():
    """The tested versions CI and the README install (`-c constraints.txt`) cover every requirement
    and agree with its range, so a fresh machine gets what CI passed with."""
    constraints = REPO / "constraints.txt"
    assert "torch" not in _pins(constraints)
    for requirements in ("requirements.txt", "requirements-dev.txt"):
        assert not unpinned(REPO / requirements, constraints)


def test_an_unpinned_or_conflicting_requirement_is_caught(tmp_path):
    """The check fails when a requirement has no pin, or a pin its range excludes."""
    pins = (REPO / "constraints.txt").read_text().splitlines()
    dropped = tmp_path / "dropped.txt"
    dropped.write_text("\n".join(line for line in pins if not line.lower().startswith("scipy==")) + "\n")
    assert "scipy has no pin" in unpinned(REPO / "requirements.txt", dropped)
    narrow = tmp_path / "requirements.txt"
    narrow.write_text("scipy<1\n")
    assert any(line.startswith("scipy==") for line in unpinned(narrow, REPO / "constraints.txt"))


def test_the_closure_follows_project_modules_and_deferred_imports():
    """The reader sees through the project: `train.export_hf` imports neither safetensors nor
    tokenizers itself; it reaches them through hf/ and data/, tokenizers only inside functions
    there (which of the importing modules is found first depends on the traversal order)."""
    found = third_party_imports("train.export_hf")
    assert found["safetensors"] in ("hf.export", "hf.imports", "hf.names")
    assert found["tokenizers"] in ("hf.export", "data.tokenizer")
    assert "deepspeed" in third_party_imports("train")


def test_a_dropped_requirement_is_caught(tmp_path):
    """The check fails for a requirements file that lacks what the exporter imports."""
    kept = [line for line in (REPO / "requirements.txt").read_text().splitlines()
            if not line.startswith("safetensors")]
    trimmed = tmp_path / "requirements.txt"
    trimmed.write_text("\n".join(kept) + "\n")
    assert any("safetensors" in line for line in undeclared("train.export_hf", trimmed))


def test_a_no_deps_install_counts_for_the_dev_file_only(tmp_path):
    """bench.train's optional litgpt is declared by requirements-dev.txt's `pip install --no-deps`
    comment, which counts for dev commands only (requirements.txt has none): without it the check
    reports the import."""
    dev = REPO / "requirements-dev.txt"
    assert "litgpt" in declared(dev, no_deps=True) and "litgpt" not in declared(dev)
    assert "litgpt" not in declared(REPO / "requirements.txt", no_deps=True)
    (tmp_path / "requirements.txt").write_text((REPO / "requirements.txt").read_text())
    trimmed = tmp_path / "requirements-dev.txt"
    trimmed.write_text("\n".join(line for line in dev.read_text().splitlines() if "--no-deps litgpt" not in line))
    missing = undeclared("bench.train", trimmed, no_deps=True)
    assert any(line.startswith("bench.train imports litgpt") for line in missing), missing
