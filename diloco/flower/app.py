"""A Flower app directory for ``flwr run``: pyproject with [tool.flwr.app] and two modules.

:func:`write_app` writes a pyproject whose ``[tool.flwr.app.config]`` declares every key of
:data:`~diloco.flower.config.APP_CONFIG` (Flower only accepts overrides of declared keys), with
its meaning as a comment, and a package whose ``app`` objects come from :mod:`diloco.flower` —
so the directory holds no logic of its own. ``examples/flower_diloco`` is exactly its output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from diloco.flower.config import APP_CONFIG, APP_CONFIG_DEFAULTS
from lowband.errors import ConfigError

APP_PACKAGE = "flower_diloco"


def toml_value(value: Any) -> str:
    """A TOML scalar (bool, int, float, str) — JSON string escapes are valid TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise ConfigError("run-config", f"{value!r} is not a TOML scalar")


def app_pyproject(
    config: Mapping[str, Any] | None = None, *, name: str = "lowband-flower-diloco"
) -> str:
    """The app's pyproject.toml; ``config`` overrides defaults of the run config."""
    values = dict(APP_CONFIG_DEFAULTS)
    for k, v in (config or {}).items():
        if k not in values:
            raise ConfigError("run-config", f"unknown key {k!r}; known: {sorted(values)}")
        values[k] = v
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f"name = {json.dumps(name)}",
        'version = "1.0.0"',
        'description = "Streaming DiLoCo on Flower: one round = one outer step of one fragment, '
        'pseudo-gradients encoded with lowband codecs"',
        'license = "Apache-2.0"',
        'dependencies = ["flwr>=1.20", "lowband[flower]"]',
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "lowband"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{APP_PACKAGE}.server_app:app"',
        f'clientapp = "{APP_PACKAGE}.client_app:app"',
        "",
        "[tool.flwr.app.config]",
    ]
    for k, v in values.items():
        lines += [f"# {APP_CONFIG[k][1]}", f"{k} = {toml_value(v)}"]
    return "\n".join(lines) + "\n"


APP_MODULES = {
    "__init__.py": (
        '"""Flower DiLoCo app: the ServerApp and ClientApp of lowband (diloco.flower)."""\n'
    ),
    "server_app.py": (
        '"""ServerApp: DiLoCoStrategy rounds, server-side evaluation, metrics and checkpoints."""\n'
        "\nfrom diloco.flower.server import make_server_app\n\napp = make_server_app()\n"
    ),
    "client_app.py": (
        '"""ClientApp: H/P inner steps per round, codec-encoded pseudo-gradient replies."""\n'
        "\nfrom diloco.flower.client import make_client_app\n\napp = make_client_app()\n"
    ),
}


def write_app(directory: Path, config: Mapping[str, Any] | None = None) -> Path:
    """Write (or overwrite) a runnable Flower app directory; returns it."""
    pkg = directory / APP_PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(app_pyproject(config))
    for name, text in APP_MODULES.items():
        (pkg / name).write_text(text)
    return directory
