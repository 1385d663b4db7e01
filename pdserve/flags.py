"""Command-line flags from a service's frozen config dataclass: one flag per field.

Owns the mapping of a field to a flag (`max_num_seqs` -> `--max-num-seqs`, typed by the field's
annotation: int, float, a true/false word for bool, else a string) so each service's
`__main__` stays a thin shell over its config. Must not validate values: the config does.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def truth(text: str) -> bool:
    """An argparse type for true/false words."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_flags(parser: argparse.ArgumentParser, config_cls, skip: tuple[str, ...] = ()
                     ) -> argparse.ArgumentParser:
    """One `--field-name` flag per field of `config_cls` not in `skip`, defaulting to the
    field's default. Annotations are read as strings (`from __future__ import annotations`)."""
    for f in fields(config_cls):
        if f.name in skip:
            continue
        kind = {"int": int, "float": float, "bool": truth}.get(str(f.type), str)
        default = None if f.default is MISSING else f.default
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default)
    return parser
