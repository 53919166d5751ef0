"""`--config FILE.toml`: a profile whose keys are the command's flags (`port = 8000`,
`kv-cache-tokens = 4096`, `no-prefix-cache = true`). Its values become the parser's defaults, so a flag
given on the command line wins; each value is checked by the flag's own parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from morion.errors import MorionError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def apply_profile(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """Sets the profile's values as `parser`'s defaults; returns the destinations it set."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise MorionError(f"cannot read config file {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise MorionError(f"config file {path} is not valid TOML: {error}") from None
    flags = {
        option.removeprefix("--").replace("-", "_"): action
        for action in parser._actions  # argparse has no public listing of its actions
        for option in action.option_strings
        if option.startswith("--") and action.dest not in ("help", "config")
    }
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        action = flags.get(key.replace("-", "_"))
        if action is None:
            raise MorionError(
                f"config file {path}: unknown setting {key!r} (settings are the flags of the command)"
            )
        defaults[action.dest] = _value(path, key, action, value)
    parser.set_defaults(**defaults)
    return sorted(defaults)


def _value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"config file {path}: {key}"
    if action.nargs == 0:  # a switch: true means "the flag is given"
        if not isinstance(value, bool):
            raise MorionError(f"{where} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value != key.replace("-", "_").startswith("no_")
        return action.const if value else action.default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise MorionError(f"{where} must be a string or a number, got {value!r}")
    try:
        result = str(value) if action.type is None else action.type(str(value))  # type: ignore[misc]
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise MorionError(f"{where}: {error}") from None
    if action.choices is not None and result not in action.choices:
        raise MorionError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return result
