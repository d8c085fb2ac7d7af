"""What the command lines share below train: the composition of train's config tree, one-line errors.

The data command lines take train's override syntax: `conf/config.yaml` composed as
`python -m train` composes it (`compose_tree`), with its `data` subtree typed by `DataConfig` and
every other key left untyped (those are train's to check, and train sits above this module).
`sources=[{kind:files,path:"x/{split}.jsonl"}]` here is `data.sources=...` there, and group options
(`data=pg19`, `experiment=micro`) work too. Every error is one `error: ...` line with errors.py's
exit status (`exit_code`):

- 2, usage: the command line is wrong (an unknown key or bad value, a file where a directory is
  expected, an unavailable device);
- 1, unusable input: a file it names is missing, or its content is unusable (`DataError`: an
  empty or binary corpus, no documents for a split, a file that is not a tokenizer model,
  malformed results JSON, a corpus file that does not parse).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from typing import NoReturn, TypeVar, get_args, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import errors
from data.config import REPO_ROOT, DataConfig
from errors import EXIT_INPUT, EXIT_USAGE, ConfigError, one_line

CONF_DIR = REPO_ROOT / "conf"
_GROUPS = ("data", "experiment")  # train config groups that may select data settings
T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def compose_tree(config_name: str, overrides: list[str], register: Callable[[], None], job_name: str) -> DictConfig:
    """`conf/<config_name>.yaml` composed with command-line overrides once `register` has put its
    schema in Hydra's store: the one composition of every command (train, eval, the data CLIs). A
    bad override is a `ConfigError` of one line (with the options of a group that has no such
    option, or how to write an override that does not parse)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=job_name):
            return compose(config_name=config_name, overrides=overrides)
    except MissingConfigException as error:
        options = ", ".join(error.options or [])
        raise ConfigError(f"{one_line(error)} (available: {options})" if options else one_line(error)) from None
    except OverrideParseException as error:
        raise ConfigError(f"{one_line(error)}: write key=value") from None
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise ConfigError(one_line(error)) from None


def _field_type(schema: type, key: str) -> object:
    """The type of the dotted field `key` of a dataclass schema (Optional[X] read as X), or None
    where the key is not a field (a group, a `+key`: composition judges those)."""
    kind: object = schema
    for part in key.split("."):
        if not is_dataclass(kind) or part not in {f.name for f in fields(kind)}:
            return None
        kind = get_type_hints(kind)[part]
        kind = next((k for k in get_args(kind) if k is not type(None)), kind)  # Optional[X] -> X
    return kind


def booleans_only(schema: type, overrides: list[str]) -> None:
    """Refuse an override that gives a boolean field of `schema` anything but true or false
    (`model.doc_mask=2`): composition would read 2, "yes", "on" or "1" as true."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    for item in overrides:
        try:
            (override,) = OverridesParser.create().parse_overrides([item])
            value = override.value()
        except HydraException:
            continue  # composition says what is wrong with its syntax
        if _field_type(schema, override.key_or_group) is bool and not isinstance(value, bool) and value is not None:
            raise ConfigError(f"{override.key_or_group}={override.get_value_element_as_str()} is not a boolean: "
                              "write true or false")


@cache
def _structured(schema: type) -> DictConfig:
    """The schema as a structured config, built once (about half of a validation's time; `merge`
    copies it, never changes it)."""
    return OmegaConf.structured(schema)


def validated(schema: type[T], cfg: DictConfig) -> T:
    """The validated dataclass (every `__post_init__` check run) of a composed config; `+key`
    additions are refused too (merging onto the schema rejects them)."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=False)
        return OmegaConf.to_object(OmegaConf.merge(_structured(schema), plain))
    except (OmegaConfBaseException, ValueError, TypeError) as error:
        raise ConfigError(one_line(error)) from None


@dataclass
class _Data:
    """What the data command lines read of train's tree, validated under its full key names (`data.x`)."""

    data: DataConfig = field(default_factory=DataConfig)


def _register_data_view() -> None:
    """`conf/config.yaml`'s root schema as the data command lines see it: `data` typed by
    `DataConfig`, the rest open, so that presets and group options setting train's keys compose;
    the `model` group's options are the flavors (`model.config.FLAVORS`), as train registers them."""
    from hydra.core.config_store import ConfigStore

    from model.config import FLAVORS, flavor

    store = ConfigStore.instance()
    store.store(name="train_schema", node={"data": DataConfig})
    for name in FLAVORS:
        store.store(group="model", name=name, node=flavor(name))


def data_config(overrides: list[str]) -> DataConfig:
    """A DataConfig from `key=value` overrides of its keys (`data.` is implied), composed and
    type-checked as train's `data`; a bad override is a `ConfigError` with train's one-line message."""

    def scoped(item: str) -> str:
        key = item.split("=", 1)[0].lstrip("+~")
        sign = item[: len(item) - len(item.lstrip("+~"))]  # `+key` adds, `~key` deletes: before `data.`
        return item if key in _GROUPS or key.startswith("data.") else f"{sign}data.{item[len(sign):]}"

    composed = compose_tree("config", [scoped(o) for o in overrides], _register_data_view, job_name="data")
    return validated(_Data, OmegaConf.masked_copy(composed, ["data"])).data


def exit_code(error: BaseException) -> int | None:
    """errors.py's rule (`errors.exit_code`: a `DataError` is EXIT_INPUT), with what data knows:
    EXIT_INPUT for a corpus file that `datasets` could not parse (pyarrow's `ArrowInvalid`),
    EXIT_USAGE for Hydra's and OmegaConf's errors (a bad override); None for a bug."""
    import pyarrow as pa
    from hydra.errors import HydraException

    if isinstance(error, pa.ArrowInvalid):
        return EXIT_INPUT
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        return EXIT_USAGE
    return errors.exit_code(error)


def fail(error: BaseException) -> NoReturn:
    """Exit with `error` as one line and its exit status; re-raise what is not an input error."""
    raise SystemExit(errors.report_error(error, exit_code(error)))
