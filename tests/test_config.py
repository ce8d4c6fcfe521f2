import subprocess
from pathlib import Path

import pytest

from duplex.cli import build_parser
from duplex.config import FIELDS, Config, ConfigError, load_config
from tests.conftest import duplex_command

pytestmark = pytest.mark.background  # no pace: beside the paced tests in make test (tests/lanes.py)


def test_defaults_bind_loopback():
    config = load_config(None, {}, {})
    assert (config.host, config.port, config.grpc_port) == ("127.0.0.1", 8000, 50051)


def test_layers_flags_beat_env_beat_file(tmp_path: Path):
    toml = tmp_path / "duplex.toml"
    toml.write_text('port = 9000\ngrpc_port = 9001\nlog_level = "debug"\n')
    config = load_config(toml, {"DUPLEX_PORT": "9100", "DUPLEX_LOG_FORMAT": "json"}, {"port": "9200"})
    assert config.port == 9200  # flag
    assert config.log_format == "json"  # env
    assert (config.grpc_port, config.log_level) == (9001, "debug")  # file


def test_config_file_from_the_environment(tmp_path: Path):
    toml = tmp_path / "c.toml"
    toml.write_text("shutdown_timeout_s = 3\n")
    assert load_config(None, {"DUPLEX_CONFIG": str(toml)}, {}).shutdown_timeout_s == 3.0


@pytest.mark.parametrize(
    ("toml", "env", "flags", "key"),
    [
        ("prot = 1\n", {}, {}, "prot"),  # unknown key in the file
        ('port = "eighty"\n', {}, {}, "port"),  # wrong type in the file
        ("port = 70000\n", {}, {}, "port"),  # out of range
        ("port = true\n", {}, {}, "port"),  # bool is not an int
        ("", {"DUPLEX_GRPC_PORT": "x"}, {}, "grpc_port"),
        ("", {"DUPLEX_NOPE": "1"}, {}, "DUPLEX_NOPE"),
        ("", {}, {"log_level": "loud"}, "log_level"),
        ("", {}, {"host": "example.com"}, "host"),
        ("", {}, {"auth_token": "short"}, "auth_token"),
        ("[server]\nport = 1\n", {}, {}, "server"),  # tables are not keys
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, toml, env, flags, key):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, env, flags)
    assert info.value.key == key
    assert str(info.value).startswith(key)


def test_unreadable_toml_is_a_config_error(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("port = = 1")
    with pytest.raises(ConfigError, match="unreadable TOML"):
        load_config(path, {}, {})
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml", {}, {})


def test_secrets_are_masked_in_the_logged_config():
    config = Config(auth_token="s3cret-token-value")
    assert config.redacted()["auth_token"] == "***"
    assert "s3cret" not in repr(config.redacted())


def run_duplex(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(duplex_command(*args), env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--port", "http"], "--port"),  # argparse: not an int
        (["serve", "--log-level", "loud"], "--log-level"),
        (["serve", "--grpc-port", "99999"], "grpc_port"),
    ],
)
def test_cli_bad_flag_exits_2_naming_it(offline_env, args, needle):
    result = run_duplex(args, offline_env)
    assert result.returncode == 2
    assert needle in result.stderr


def test_cli_unknown_toml_key_exits_2_naming_it(tmp_path: Path, offline_env):
    toml = tmp_path / "duplex.toml"
    toml.write_text('hots = "127.0.0.1"\n')
    result = run_duplex(["serve", "--config", str(toml)], offline_env)
    assert result.returncode == 2
    assert "hots" in result.stderr and str(toml) in result.stderr


def test_cli_unknown_env_var_exits_2_naming_it(offline_env):
    result = run_duplex(["serve"], offline_env | {"DUPLEX_PROT": "1"})
    assert result.returncode == 2
    assert "DUPLEX_PROT" in result.stderr


@pytest.mark.parametrize("stage", ["vad", "asr", "voice", "llm"])
def test_cli_missing_model_path_names_model_and_path(tmp_path: Path, offline_env, stage):
    missing = tmp_path / f"no-such-{stage}"
    for command in ("serve", "prepare"):
        result = run_duplex([command, f"--{stage}", str(missing)], offline_env)
        assert result.returncode == 2, result.stderr
        assert f"{stage} model not found" in result.stderr
        assert str(missing) in result.stderr


def test_cli_wrong_kind_of_model_file_is_explained(tmp_path: Path, offline_env):
    voice = tmp_path / "voice.onnx"
    voice.write_bytes(b"\x00")
    result = run_duplex(["prepare", "--voice", str(voice)], offline_env)
    assert result.returncode == 2
    assert "voice.onnx.json" in result.stderr and ".onnx.json config is missing" in result.stderr


def test_cli_corrupt_gguf_is_refused_with_the_path(tmp_path: Path, offline_env):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    result = run_duplex(
        ["prepare", "--no-progress", "--llm", str(gguf), "--cache-dir", str(tmp_path / "c")], offline_env
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot convert this GGUF" in result.stderr and str(gguf) in result.stderr
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "c" / "models").glob(".*partial*"))  # staging cleaned up


def test_secret_values_are_not_echoed_in_errors(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("auth_token = 1234567890123\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {}, {})
    assert "1234567890123" not in str(info.value) and info.value.key == "auth_token"


@pytest.mark.parametrize("value", ["nan", "inf", "10", "0"])
def test_shutdown_timeout_must_fit_the_5s_promise(value):
    with pytest.raises(ConfigError, match="shutdown_timeout_s"):
        load_config(None, {"DUPLEX_SHUTDOWN_TIMEOUT_S": value}, {})


def test_ipv6_hosts_are_bracketed_in_addresses():
    assert load_config(None, {}, {"host": "::1"}).host_for_url == "[::1]"
    assert Config().host_for_url == "127.0.0.1"


def test_llm_settings_reach_the_engine_config():
    config = load_config(
        None,
        {"DUPLEX_LLM_MAX_CONTEXT": "2048", "DUPLEX_SYSTEM_PROMPT": "Be terse."},
        {"llm_temperature": "0.3", "llm_kv_cache_gib": "2"},
    )
    llm = config.llm_config("/models/x")
    assert (llm.model, llm.max_model_len, llm.temperature, llm.kv_cache_gib) == ("/models/x", 2048, 0.3, 2.0)
    assert llm.system_prompt == "Be terse."
    assert "voice assistant" in Config().llm_config("/m").system_prompt


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llm_max_context", "100"),
        ("llm_max_tokens", "5000"),
        ("llm_temperature", "-1"),
        ("llm_kv_cache_gib", "0"),
        ("llm_gpu_memory_fraction", "1.5"),
        ("asr_workers", "0"),
    ],
)
def test_llm_settings_are_checked(key, value):
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, {key: value})
    assert info.value.key == key


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7"])
def test_a_host_others_can_reach_needs_a_token_or_an_explicit_allowance(host):
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, {"host": host})
    assert info.value.key == "host"
    assert "auth_token" in str(info.value) and "allow_unauthenticated" in str(info.value)
    with_token = load_config(None, {}, {"host": host, "auth_token": "a-long-token"})
    assert with_token.exposed and with_token.unauthenticated_warning() is None
    allowed = load_config(None, {"DUPLEX_ALLOW_UNAUTHENTICATED": "true"}, {"host": host})
    warning = allowed.unauthenticated_warning()
    assert warning is not None and host in warning and "without auth_token" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_serves_without_a_token_and_without_a_warning(host):
    config = load_config(None, {}, {"host": host})
    assert not config.exposed and config.unauthenticated_warning() is None


def test_allow_unauthenticated_is_a_boolean_in_every_layer(tmp_path: Path):
    toml = tmp_path / "c.toml"
    toml.write_text("allow_unauthenticated = true\n")
    assert load_config(toml, {}, {}).allow_unauthenticated is True
    assert load_config(None, {"DUPLEX_ALLOW_UNAUTHENTICATED": "no"}, {}).allow_unauthenticated is False
    for bad_toml, bad_env in (
        ("allow_unauthenticated = 1\n", {}),
        ("", {"DUPLEX_ALLOW_UNAUTHENTICATED": "maybe"}),
    ):
        toml.write_text(bad_toml)
        with pytest.raises(ConfigError) as info:
            load_config(toml, bad_env, {})
        assert info.value.key == "allow_unauthenticated"


def test_cli_refuses_an_exposed_host_without_a_token_and_takes_the_switch(offline_env):
    result = run_duplex(["serve", "--host", "0.0.0.0"], offline_env)
    assert result.returncode == 2
    assert "allow_unauthenticated" in result.stderr and "auth_token" in result.stderr
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allow-unauthenticated"])
    assert args.allow_unauthenticated == "true"
    flags = {key: value for key, value in vars(args).items() if key in FIELDS and value is not None}
    assert load_config(None, {}, flags).allow_unauthenticated is True
