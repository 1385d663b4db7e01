"""Command-line flags from a service's frozen config dataclass, and back: one flag per field.

Owns the mapping of a field to a flag and its inverse. A field `max_num_seqs` is the flag
`--max-num-seqs`, typed by its annotation: int, float, a true/false word for bool, a string,
`X | None` (X, default None), `tuple[str, ...]` (comma-separated). A field's metadata, written
with `flag(...)` where the field is declared, may rename its flag (`model_path` -> `--model`),
make a bool a switch that takes no value, and give choices and help: the config stays the one
place a setting is described. `add_config_flags` builds a parser's flags; `config_argv` writes
the flags that reproduce a config, its exact inverse. Must not validate values: the config does.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields, replace
from typing import Any


def truth(text: str) -> bool:
    """An argparse type for true/false words."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def addresses(text: str) -> tuple[str, ...]:
    """An argparse type for comma-separated values (blanks dropped): `a:1,b:2`."""
    return tuple(a.strip() for a in text.split(",") if a.strip())


def flag(default: Any = MISSING, *, name: str | None = None, help: str | None = None,
         switch: bool = False, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with how its flag is spelled: `name` (e.g. "--model"), `switch` (a
    bool that is set by naming the flag alone, or given a true/false word; its default must be
    False), `choices`, `help`."""
    meta = {"flag": name, "help": help, "switch": switch, "choices": choices}
    return field(default=default, metadata={k: v for k, v in meta.items() if v})


def flag_name(f) -> str:
    """The flag of a dataclass field (`--field-name` unless its metadata renames it)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


_SCALARS = {"int": int, "float": float, "bool": truth, "str": str}
_TUPLE = "tuple[str, ...]"


def _kind(f) -> tuple[Any, bool]:
    """(the argparse type of a field's flag, whether None is its absent value)."""
    text = str(f.type).replace(" ", "")
    optional = text.endswith("|None")
    base = text[:-len("|None")] if optional else text
    if base == _TUPLE.replace(" ", ""):
        return addresses, optional
    if base not in _SCALARS:
        raise TypeError(f"{f.name}: no flag for a field of type {f.type}")
    return _SCALARS[base], optional


def add_config_flags(parser: argparse.ArgumentParser, config_cls, skip: tuple[str, ...] = (),
                     defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """One flag per field of `config_cls` not in `skip`, defaulting to the field's default
    (or to `defaults[name]`, for a default known only at run time, such as a host name); a
    field without either is required. Annotations are read as strings (`from __future__
    import annotations`). Each flag's dest is its field's name."""
    defaults = defaults or {}
    for f in fields(config_cls):
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        options: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help")}
        if f.metadata.get("switch"):
            if default is not False:
                raise TypeError(f"{f.name}: a switch defaults to False")
            # Named alone it is on; a true/false word may follow, as the environment form
            # (`PDSERVE_<KIND>_<FLAG>=true`, pdserve.entrypoints) always gives one.
            options.update(nargs="?", const=True, type=truth, default=False,
                           metavar="true|false")
        else:
            kind, _ = _kind(f)
            options.update(type=kind, choices=f.metadata.get("choices"),
                           metavar=flag_name(f)[2:].replace("-", "_").upper())
            if default is MISSING:
                options["required"] = True
            else:
                options["default"] = default
        parser.add_argument(flag_name(f), **options)
    return parser


def config_from_args(config_cls, args: argparse.Namespace, **more: Any):
    """`config_cls` from the parsed flags of its fields (others in `args` ignored) and `more`."""
    names = {f.name for f in fields(config_cls)}
    return config_cls(**{k: v for k, v in vars(args).items() if k in names}, **more)


def config_argv(cfg, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make `add_config_flags`' parser give back `cfg`: those of the fields
    that differ from their default (every field without one), so a command line names only
    what was chosen. A field a config derives when left None (e.g. a bound computed from
    another) is left out when leaving it None derives the same value."""
    out: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or (f.default is not MISSING and value == f.default):
            continue
        if f.default is None and _derived(cfg, f.name):
            continue
        out += _flag_value(f, value)
    return out


def _derived(cfg, name: str) -> bool:
    """Whether `cfg` comes out the same with field `name` left None (its config derives it)."""
    try:
        return replace(cfg, **{name: None}) == cfg
    except ValueError:  # the config needs it set (ConfigError is a ValueError)
        return False


def _flag_value(f, value: Any) -> list[str]:
    name = flag_name(f)
    if f.metadata.get("switch"):
        return [name] if value else []
    kind, optional = _kind(f)
    if value is None:
        raise ValueError(f"{f.name}: None has no flag (its default is {f.default!r})")
    if kind is addresses:
        if any("," in v or v != v.strip() or not v for v in value):
            raise ValueError(f"{f.name}: {value!r} cannot be written comma-separated")
        text = ",".join(value)
    elif kind is truth:
        text = "true" if value else "false"
    elif kind is float:
        text = repr(float(value))
    else:
        text = str(value)
    if text == "--":  # argparse reads it as the end of the flags, whichever way it is written
        raise ValueError(f"{f.name}: '--' cannot be given on a command line")
    # A value that starts with "-" would read as a flag of its own.
    return [f"{name}={text}"] if text.startswith("-") else [name, text]
