"""`dsv4 train --config FILE [KEY=VALUE ...]`: every training setting from a file and the command line
(issue #21, item 6).

Why: a run has about 35 knobs (:class:`train.trainer.TrainConfig`) and only five had a command-line
option; the rest could only be changed in Python. Here every one is a key, and the keys are generated
(:func:`settings`), so none can be forgotten when a knob is added:

* every field of ``TrainConfig`` (``dataclasses.fields``), its value parsed by the field's type;
* every option of the command the file is given to (``train``, ``full-train``): the run's choices
  (``impl``, ``kernel_backend``, ``quant``, ``hardware``, ``dtype``, ``tp``, ``cp``, ``ep``, ``model``, ...)
  and the job's (``mode``, ``steps``, ``run_dir``, ``resume``), parsed by the option's click type.
  ``--compile`` is the field ``compile_blocks``.

Files are TOML (``.toml``) or JSON (``.json``): keys at the top level or in the optional tables ``[run]``
and ``[train]`` (grouping only; a key may stand in either). A run folder's ``train_config.json`` reads as
the run it describes (its ``mode``, ``train`` fields and ``run`` choices), so ``--config
RUN_DIR/train_config.json`` repeats that run. ``KEY=VALUE`` arguments take text: numbers, ``true`` /
``false``, ``none`` for an optional value, lists as ``0.9,0.95`` or ``[0.9, 0.95]``. Dashes in keys read
as underscores (``save-every=5``).

Precedence, lowest first: the defaults, the ``--config`` file, options given on the command line,
``KEY=VALUE`` arguments. A bad file, an unknown key (with the nearest valid one) or a value of the wrong
type is a :class:`ConfigFileError`, one line naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from core.errors import UserInputError

__all__ = ["ConfigFileError", "Setting", "settings", "read_file", "parse_overrides", "resolve", "to_toml",
           "SECTIONS", "OPTION_FIELDS"]

SECTIONS = ("run", "train")
# command-line options that set a TrainConfig field of another name
OPTION_FIELDS = {"compile": "compile_blocks"}
# options of the commands that are not settings
NOT_SETTINGS = frozenset({"config", "print_config", "quiet", "verbose", "debug", "help"})
LISTING = "`dsv4 train --print-config` lists every key"
_NONE = ("none", "null")
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class ConfigFileError(UserInputError):
    """A config file or ``KEY=VALUE`` argument that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Setting:
    """One key: how its value is parsed, and whether it is a TrainConfig field."""

    name: str
    parse: Callable[[Any], Any]   # raises ValueError (or click.BadParameter) on a bad value
    expects: str                  # what the value must be, for messages
    train_field: bool


# -- parsing by type -----------------------------------------------------------

def _literal(text: str) -> Any:
    """A TOML literal (number, boolean, array, quoted string), or the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_none(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() in _NONE)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        return int(v.strip())
    raise ValueError


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return float(v.strip())
    raise ValueError


def _str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise ValueError


def _sequence(v: Any) -> list:
    if isinstance(v, str):
        text = v.strip()
        v = _literal(text) if text.startswith("[") else [x.strip() for x in text.split(",") if x.strip()]
    if not isinstance(v, (list, tuple)):
        raise ValueError
    return list(v)


def _parser(tp) -> Tuple[Callable[[Any], Any], str]:
    """``(parse, what it expects)`` for a field's type annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        nullable = len(inner) < len(args)
        parsers = [_parser(a) for a in inner]

        def parse_union(v):
            if nullable and _is_none(v):
                return None
            for parse, _ in parsers:
                try:
                    return parse(v)
                except (ValueError, TypeError):
                    continue
            raise ValueError

        return parse_union, " or ".join([e for _, e in parsers] + (["none"] if nullable else []))
    if origin is typing.Literal:
        def parse_literal(v):
            for choice in args:
                if v == choice or (isinstance(v, str) and not isinstance(choice, str) and _literal(v) == choice):
                    return choice
            raise ValueError

        return parse_literal, "one of " + ", ".join(repr(a) for a in args)
    if tp is bool:
        return _bool, "true or false"
    if tp is int:
        return _int, "an integer"
    if tp is float:
        return _float, "a number"
    if tp is str:
        return _str, "a string"
    if tp in (tuple, list) or origin in (tuple, list):
        container = tuple if tuple in (tp, origin) else list
        if args and not (len(args) == 2 and args[1] is Ellipsis):
            items = [_parser(a)[0] for a in args]

            def parse_fixed(v):
                seq = _sequence(v)
                if len(seq) != len(items):
                    raise ValueError
                return container(p(x) for p, x in zip(items, seq))

            return parse_fixed, f"a list of {len(items)} values"
        item = _parser(args[0])[0] if args else (lambda x: _literal(x) if isinstance(x, str) else x)
        return (lambda v: container(item(x) for x in _sequence(v))), "a list"
    # any other annotation (Any, dict, ...): a TOML value as is, text read as a TOML literal
    return (lambda v: _literal(v) if isinstance(v, str) else v), "a value"


def _option_parser(param) -> Tuple[Callable[[Any], Any], str]:
    """``(parse, what it expects)`` for a click option: its own type converts (choices, ranges, flags)."""
    if getattr(param, "is_flag", False):
        return _bool, "true or false"

    def parse(v):
        if param.default is None and _is_none(v):   # an option not given (`--print-config` writes "none")
            return None
        return param.type.convert(v, param, None)

    return parse, f"a value of --{param.name.replace('_', '-')} ({param.type.name})"


# -- the keys ----------------------------------------------------------------

def train_config_type():
    from train.trainer import TrainConfig

    return TrainConfig


def settings(command) -> Dict[str, Setting]:
    """Every key ``command`` (a click command) accepts: its options and TrainConfig's fields."""
    import click

    cls = train_config_type()
    hints = typing.get_type_hints(cls)
    table: Dict[str, Setting] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in NOT_SETTINGS or param.name in OPTION_FIELDS:
            continue
        parse, expects = _option_parser(param)
        table[param.name] = Setting(param.name, parse, expects, train_field=False)
    for field in dataclasses.fields(cls):  # a field's own type wins over an option of the same name
        parse, expects = _parser(hints[field.name])
        table[field.name] = Setting(field.name, parse, expects, train_field=True)
    return table


def _norm(key: Any) -> str:
    return str(key).strip().replace("-", "_")


# Other trainers' names (Hugging Face TRL / transformers, verl, OpenRLHF, Megatron-LM) of dsv4's settings:
# refused, each naming dsv4's key, so a setting is never silently dropped or half-understood.
OTHER_TRAINERS_NAMES = {
    "learning_rate": ("lr", ""),
    "num_steps": ("steps", ""),
    "max_steps": ("steps", ""),
    "train_iters": ("steps", ""),
    "total_training_steps": ("steps", ""),
    "global_batch_size": ("batch_size", "SFT's sequences per step; a GRPO step has prompts_per_step x group_size samples"),
    "train_batch_size": ("batch_size", "SFT's sequences per step; a GRPO step has prompts_per_step x group_size samples"),
    "per_device_train_batch_size": ("micro_batch_size", "samples per forward/backward on each rank"),
    "rollout_batch_size": ("prompts_per_step", "prompts per GRPO step; each is sampled group_size times"),
    "n_samples_per_prompt": ("group_size", ""),
    "num_generations": ("group_size", ""),
    "rollout_n": ("group_size", ""),
    "max_response_length": ("max_new_tokens", ""),
    "max_completion_length": ("max_new_tokens", ""),
    "kl_coeff": ("kl_coef", ""),
    "clip_ratio": ("clip_low", "and clip_high: the lower and upper clip range of the ratio"),
    "eps_clip": ("clip_low", "and clip_high: the lower and upper clip range of the ratio"),
    "random_seed": ("seed", ""),
    "max_grad_norm": ("grad_clip", ""),
    "clip_grad": ("grad_clip", ""),
    "save_steps": ("save_every", ""),
    "save_interval": ("save_every", ""),
    "output_dir": ("run_dir", ""),
}


def _unknown(key: str, where: str, valid: Iterable[str]) -> ConfigFileError:
    valid = list(valid)
    ours, note = OTHER_TRAINERS_NAMES.get(key, (None, ""))
    if ours in valid:
        return ConfigFileError(f"unknown key {key!r} in {where}; did you mean {ours!r}? (dsv4's name of that "
                               f"setting{': ' + note if note else ''}) Fix: write {ours}=... ({LISTING})")
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if near:
        return ConfigFileError(f"unknown key {key!r} in {where}; did you mean {near[0]!r}? Fix: write "
                               f"{near[0]}=... ({LISTING})")
    return ConfigFileError(f"unknown key {key!r} in {where}. Fix: use one of dsv4's keys ({LISTING})")


def _parse(table: Mapping[str, Setting], key: str, value: Any, where: str) -> Any:
    import click

    setting = table.get(key)
    if setting is None:
        raise _unknown(key, where, table)
    try:
        return setting.parse(value)
    except click.BadParameter as exc:
        raise ConfigFileError(f"key {key!r} = {value!r} in {where}: {exc.message}") from None
    except (ValueError, TypeError):
        raise ConfigFileError(f"key {key!r} = {value!r} in {where}: expected {setting.expects}") from None


# -- files and KEY=VALUE ---------------------------------------------------------

def _flatten(data: Mapping[str, Any], where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            if k not in SECTIONS:
                near = difflib.get_close_matches(str(k), SECTIONS, n=1)
                hint = f"did you mean [{near[0]}]? " if near else ""
                raise ConfigFileError(f"unknown section [{k}] in {where}; {hint}sections are optional: "
                                      f"[{'], ['.join(SECTIONS)}]")
            items = list(v.items())
        else:
            items = [(k, v)]
        for key, value in items:
            if isinstance(value, dict):
                raise ConfigFileError(f"{where}: {key!r} is a table; settings are single values")
            key = _norm(key)
            if key in out:
                raise ConfigFileError(f"key {key!r} is given twice in {where}")
            out[key] = value
    return out


def _saved_run(data: Mapping[str, Any]) -> Dict[str, Any]:
    """A run folder's ``train_config.json`` as settings: its mode, TrainConfig fields and run choices."""
    out = {"mode": data.get("mode"), **data["train"]}
    for key, value in (data.get("run") or {}).items():
        if key in ("providers", "job", "world"):   # the rank count: give --nproc-per-node (or torchrun) again
            continue
        out["model" if key == "model_name" else key] = value
    return {k: v for k, v in out.items() if v is not None or k in data["train"]}


def read_file(path) -> Dict[str, Any]:
    """The raw settings of a TOML or JSON file (sections flattened)."""
    path = Path(path)
    where = str(path)
    from core.bounded_io import (MAX_JSON_DEPTH, SMALL_JSON_LIMIT, BoundedReadError, json_depth, loads_bounded,
                                 read_text)

    try:
        text = read_text(path, limit=SMALL_JSON_LIMIT, what="--config")
    except BoundedReadError as exc:
        raise ConfigFileError(str(exc)) from None
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc})") from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        if json_depth(text.encode("utf-8")) > MAX_JSON_DEPTH:     # arrays and inline tables nest alike
            raise ConfigFileError(f"--config {path} nests more than {MAX_JSON_DEPTH} levels deep; a settings file "
                                  f"is a flat table of keys. Fix: check the path")
        try:
            return _flatten(tomllib.loads(text), where)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"{path}: not valid TOML ({exc})") from None
    if suffix == ".json":
        try:
            data = loads_bounded(text.encode("utf-8"), source=path, what="--config")
        except BoundedReadError as exc:
            raise ConfigFileError(str(exc)) from None
        except json.JSONDecodeError as exc:
            raise ConfigFileError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigFileError(f"{path}: a config file holds an object of settings")
        if isinstance(data.get("train"), dict) and "model_config" in data:   # a run folder's train_config.json
            data = _saved_run(data)
        return _flatten(data, where)
    raise ConfigFileError(f"--config {path}: unknown format {suffix or '(no suffix)'!r}; use a .toml or .json file")


def parse_overrides(args: Sequence[str]) -> Dict[str, str]:
    """``["lr=1e-3", "steps=2"]`` -> ``{"lr": "1e-3", "steps": "2"}`` (the last of a repeated key wins)."""
    out = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ConfigFileError(f"unexpected argument {arg!r}: settings are KEY=VALUE (e.g. lr=1e-3); {LISTING}")
        out[_norm(key)] = value
    return out


def resolve(command, *, config: Optional[Path], cli: Mapping[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """The settings given anywhere, parsed: the ``config`` file, then ``cli`` (options given on the command
    line, already parsed by click; ``compile`` is ``compile_blocks``), then ``overrides`` (``KEY=VALUE``).
    Keys nobody gave are absent (their defaults apply)."""
    table = settings(command)
    values: Dict[str, Any] = {}
    if config is not None:
        for key, value in read_file(config).items():
            values[key] = _parse(table, key, value, str(config))
    values.update({OPTION_FIELDS.get(k, k): v for k, v in cli.items() if v is not None})
    for key, value in parse_overrides(overrides).items():
        values[key] = _parse(table, key, value, f"the argument {key}={value}")
    return values


# -- writing -------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def to_toml(sections: Mapping[str, Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    """``{section: {key: value}}`` as TOML that :func:`read_file` reads back to the same values."""
    lines = [f"# {h}" for h in header]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
