"""The deployment files in deploy/: the systemd unit passes ``systemd-analyze verify``
(no systemd needs to run for that: it works in a container) and keeps its hardening;
the example TOML is what `Config` renders, so it cannot drift from the code, and
duplex's own loader reads it back as the defaults."""

from __future__ import annotations

import configparser
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from duplex.config import FIELDS, Config, load_config
from duplex.config_example import example, render
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "duplex.service"
EXAMPLE_TOML = DEPLOY / "duplex.toml"
INSTALLED_DUPLEX = "/opt/duplex/bin/duplex"  # where the unit expects the venv's script
CONFIG_ERROR = 2  # duplex's exit status for a bad configuration (duplex/cli.py `_fail`)
ENGINE_GAVE_UP = 1  # duplex/service.py `_give_up`: an engine could not be kept running


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: `make test` installs it (Debian's systemd, DEB_TEST)"
    return path


def unit_here(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this venv's duplex: verify checks that the
    command exists and is executable, and /opt/duplex is not installed here."""
    here = Path(sys.executable).parent / "duplex"
    assert here.is_file(), f"{here} is missing: `make setup` installs the duplex script"
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_DUPLEX} serve" in text
    path = tmp_path / "duplex.service"
    path.write_text(text.replace(INSTALLED_DUPLEX, str(here)))
    return path


def unit_sections() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_the_unit_passes_systemd_analyze_verify_without_a_warning(tmp_path):
    result = subprocess.run(
        [systemd_analyze(), "verify", str(unit_here(tmp_path))], capture_output=True, text=True, timeout=60
    )
    # a misspelt key is only a warning ("Unknown key ..., ignoring"): none may appear
    assert result.returncode == 0 and not result.stdout and not result.stderr, result


def test_a_broken_unit_fails_the_same_check(tmp_path):
    """The check above can fail: an unknown key and a missing command are reported."""
    broken = tmp_path / "broken.service"
    broken.write_text(UNIT.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    result = subprocess.run([systemd_analyze(), "verify", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0  # /opt/duplex/bin/duplex is not here
    assert "Unknown key 'NoNewPrivilege'" in result.stderr and INSTALLED_DUPLEX in result.stderr


def test_the_unit_is_hardened(tmp_path):
    # systemd's own exposure score, offline (0 safe .. 10 unsafe, in tenths here): 2.9
    # today, "OK"; the threshold fails the test if an edit drops the sandbox
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", "--threshold=35", str(unit_here(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    service = unit_sections()["Service"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "CapabilityBoundingSet": "",
        "User": "duplex",
    }.items():
        assert service.get(key) == value, key


def test_the_unit_restarts_on_what_restarting_can_cure():
    """Restart on failure (an engine that gave up exits 1), not on a bad configuration
    (exit 2: a restart would fail the same way); stop through duplex's own drain."""
    service = unit_sections()["Service"]
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"].split() == [
        str(CONFIG_ERROR)
    ]
    assert ENGINE_GAVE_UP != CONFIG_ERROR
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    assert service["EnvironmentFile"].lstrip("-") == "/etc/duplex/duplex.env"
    assert service["ExecStart"] == f"{INSTALLED_DUPLEX} serve --config /etc/duplex/duplex.toml"
    # shutdown_timeout_s is at most 4.5 s: systemd waits longer than that before SIGKILL
    assert float(service["TimeoutStopSec"]) > 4.5


def test_a_bad_configuration_exits_2_which_the_unit_does_not_restart(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("port = 'eighty'\n")
    result = subprocess.run(
        [sys.executable, "-m", "duplex", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == CONFIG_ERROR
    assert "port" in result.stderr and "Traceback" not in result.stderr


def test_the_example_toml_is_what_config_renders():
    assert EXAMPLE_TOML.read_text() == example(), (
        "deploy/duplex.toml is out of date: regenerate it with `duplex config --example > deploy/duplex.toml`"
    )


def test_the_example_toml_holds_every_key_with_its_help_and_loads_as_the_defaults():
    text = EXAMPLE_TOML.read_text()
    lines = text.splitlines()
    for name, f in FIELDS.items():
        assigned = [i for i, line in enumerate(lines) if line.lstrip("# ").startswith(f"{name} = ")]
        assert len(assigned) == 1, name
        above = " ".join(line.removeprefix("# ") for line in lines[assigned[0] - 3 : assigned[0]])
        assert f.metadata["help"].split()[-1] in above, name  # its help text, just above it
        if f.default is None:
            assert lines[assigned[0]].startswith(f"# {name} = (unset"), name
    assert load_config(EXAMPLE_TOML, {}, {}) == Config()


def test_a_rendered_configuration_reads_back_as_itself(tmp_path):
    """Every kind of value survives the round trip through TOML (quotes and newlines in
    strings, floats, booleans); a set secret is left out, never printed."""
    config = Config(
        host="0.0.0.0",
        port=9000,
        log_format="json",
        llm_temperature=0.7,
        llm_kv_cache_gib=2.5,
        system_prompt='Say "hello" first.\nThen\tlisten. \u00e9\\',
        allowed_origins="https://app.example:8443",
        sip_port=5070,
        allow_unauthenticated=True,
        auth_token="a-secret-token",
    )
    text = render(config, "a test")
    assert "a-secret-token" not in text
    path = tmp_path / "duplex.toml"
    path.write_text(text)
    assert load_config(path, {}, {}) == dataclasses.replace(config, auth_token=None)


@pytest.mark.parametrize("extra", [[], ["--example"]])
def test_duplex_config_prints_it(extra, tmp_path):
    """``duplex config --example`` regenerates deploy/duplex.toml; ``duplex config``
    prints what the file, the environment and the flags make."""
    command = [sys.executable, "-m", "duplex", "config", "--config", str(EXAMPLE_TOML), "--port", "9001"]
    result = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if extra:
        assert result.stdout == EXAMPLE_TOML.read_text()
    else:
        assert "\nport = 9001\n" in result.stdout and "\ngrpc_port = 50051\n" in result.stdout
