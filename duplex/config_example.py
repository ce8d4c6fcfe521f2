"""Configuration as TOML text, rendered from `Config` itself: every key, its value and
its help text as a comment. ``duplex config --example`` prints the defaults (the file
checked in as ``deploy/duplex.toml``, which a test regenerates and compares, so it
cannot drift from the code); ``duplex config`` prints the configuration a service
started with the same file, environment and flags would run with.

Keys whose value is unset (``None``) have no TOML form: they are written commented
out, with the type they take. Secrets that are set are never printed.
"""

from __future__ import annotations

import json
import textwrap

from duplex.config import ENV_PREFIX, FIELDS, Config, _field_type

WIDTH = 96
HEADER = """\
# duplex configuration ({what}).
#
# Layers, each over the one before: these defaults < this file (--config FILE, or
# DUPLEX_CONFIG=FILE) < DUPLEX_* environment variables < command-line flags.
# Each key below is also DUPLEX_<KEY> in the environment and --<key> on the command line.
# Keep secrets ({secrets}) out of this file: put them in the
# service's environment file instead (see deploy/duplex.service).
"""
TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def render(config: Config, what: str) -> str:
    """``config`` as TOML: one commented block per key, in `Config`'s order."""
    secrets = ", ".join(name for name, f in FIELDS.items() if f.metadata["secret"])
    blocks = [HEADER.format(what=what, secrets=secrets)]
    for name, f in FIELDS.items():
        help_text = f.metadata["help"]
        if f.metadata["choices"]:
            help_text += f" (one of: {', '.join(f.metadata['choices'])})"
        if f.metadata["secret"]:
            help_text += f"; a secret: better as {ENV_PREFIX}{name.upper()} in the environment"
        lines = textwrap.wrap(help_text, WIDTH - 2)
        lines = [f"# {line}" for line in lines]
        lines.append(_assignment(name, getattr(config, name), f.metadata["secret"]))
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def example() -> str:
    """The defaults: the text of ``deploy/duplex.toml``."""
    return render(Config(), "every key, set to its default")


def _assignment(name: str, value: object, secret: bool) -> str:
    if value is None:
        return f"# {name} = (unset; {TYPE_NAMES[_field_type(name)]})"
    if secret:
        return f"# {name} = (set; not shown)"
    return f"{name} = {_toml_value(value)}"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # 8000, 60.0, 0.5: TOML reads Python's forms of these back
    assert isinstance(value, str), f"config values are bool, int, float or str, not {value!r}"
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
