"""The command line's config errors in one line: a missing `--config` file, an unknown
`--config.X` field (with the closest known names), instead of absl's traceback."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import sys

from ml_collections import ConfigDict


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), with an unknown config
    field said in one line (`unknown_field`) instead of a traceback."""
    from absl import flags
    path = config_path(argv)
    if path and not os.path.isfile(path.partition(":")[0]):
        sys.exit(f"--config {path}: no such file ({os.path.abspath(path.partition(':')[0])})")
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        message = unknown_field(argv)
        if message:
            sys.exit(message)
        if isinstance(e, flags.Error):
            sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
        raise


@contextlib.contextmanager
def one_line_config_errors(default_config: str | None = None):
    """Around `config_flags.DEFINE_config_file` with a default config, which applies the command
    line's overrides as it loads it: an unknown field then fails there."""
    try:
        yield
    except (AttributeError, KeyError):
        message = unknown_field(sys.argv, default_config)
        if message:
            sys.exit(message)
        raise


def config_path(argv: list[str], default_config: str | None = None) -> str | None:
    """The `--config` of `argv` (FILE or FILE:ARG), else `default_config`."""
    path = default_config
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def unknown_field(argv: list[str], default_config: str | None = None) -> str | None:
    """"unknown config field 'rl.bta'; did you mean rl.beta?" for the first `--config.X` of `argv`
    that the config file (`--config`, else `default_config`) does not have; None if all exist."""
    path = config_path(argv, default_config)
    if not path:
        return None
    file, _, arg = path.partition(":")
    try:
        spec = importlib.util.spec_from_file_location("_config_for_flags", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - the config's own error is shown by absl instead
        return None
    for arg in argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        if name.startswith("config.") and not _has(config, name[7:]):
            close = difflib.get_close_matches(name[7:], _paths(config), n=3, cutoff=0.5)
            return f"unknown config field {name[7:]!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
    return None


def _has(config: ConfigDict, path: str) -> bool:
    node = config
    for part in path.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def _paths(config: ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k, v in config.items():
        out += _paths(v, f"{prefix}{k}.") if isinstance(v, ConfigDict) else [f"{prefix}{k}"]
    return out
