"""Service configuration: defaults < TOML file < ``DUPLEX_*`` environment < CLI flags.

Every key is declared once, in `Config`; its type, default and help text drive the
TOML reader, the environment reader and the CLI flags alike. Unknown keys and
invalid values raise `ConfigError`, which names the key and where it came from.
The TOML file is flat (``port = 8000``, ``llm = "/models/my-llm"``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.llm import LlmConfig

ENV_PREFIX = "DUPLEX_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
LLM_QUANTIZATIONS = ("auto", "int8", "int4", "none")


class ConfigError(Exception):
    def __init__(self, key: str, message: str, origin: str = "") -> None:
        self.key = key
        self.origin = origin
        where = f" (from {origin})" if origin else ""
        super().__init__(f"{key}{where}: {message}")


def _opt(default: Any, help: str, secret: bool = False, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "secret": secret, "choices": choices})


@dataclass(frozen=True)
class Config:
    host: str = _opt("127.0.0.1", "address the HTTP and gRPC listeners bind")
    port: int = _opt(8000, "HTTP port (demo page, WebRTC, telephony, realtime WS, /healthz, /metrics)")
    grpc_port: int = _opt(50051, "gRPC port (Duplex service, health, reflection)")
    log_level: str = _opt("info", "log level", choices=LOG_LEVELS)
    log_format: str = _opt("text", "log format: text for people, json for log pipelines", choices=LOG_FORMATS)
    cache_dir: str | None = _opt(None, "where converted models and engine caches live (default: XDG cache)")
    vad: str | None = _opt(None, "Silero VAD .onnx/.jit file (default: bundled)")
    asr: str | None = _opt(None, "CTranslate2 Whisper directory or hub id (default: bundled tiny.en)")
    voice: str | None = _opt(None, "piper voice .onnx file, .onnx.json beside it (default: bundled joe)")
    llm: str | None = _opt(None, "LLM: Hugging Face directory, .gguf file, or hub id (default: SmolLM2-135M)")
    llm_url: str | None = _opt(
        None,
        "URL of an LLM service (vLLM's OpenAI-compatible server, or a router before several): no LLM "
        "runs in this process; llm names the same model, for its tokenizer (default: in-process vLLM)",
    )
    llm_api_key: str | None = _opt(None, "API key the LLM service at llm_url asks for (Bearer)", secret=True)
    llm_dtype: str = _opt(
        "auto",
        "LLM dtype in vLLM (auto: bfloat16 with quantized weights and on GPU; on CPU, by the CPU's kind)",
        choices=LLM_DTYPES,
    )
    llm_quantization: str = _opt(
        "auto",
        "LLM weights of a GGUF model on vLLM's CPU kernels: int8 (W8A8), int4 (W4A8: faster, "
        "less accurate), none (full weights); auto: the fastest right on this kind of CPU",
        choices=LLM_QUANTIZATIONS,
    )
    llm_execution: str = _opt(
        "auto",
        "compiled: torch.compile (a first start ~2 min, later starts load the cache), or eager; "
        "auto: compiled on GPU, on CPU by the CPU's kind",
        choices=("auto", "compiled", "eager"),
    )
    llm_kv_cache_gib: float = _opt(1.0, "KV cache size on CPU, GiB")
    llm_gpu_memory_fraction: float = _opt(0.5, "share of GPU memory vLLM may take, on GPUs")
    llm_max_context: int = _opt(4096, "tokens of conversation the LLM keeps (older turns are dropped)")
    llm_max_tokens: int = _opt(96, "longest reply in tokens (spoken replies are short)")
    llm_temperature: float = _opt(0.0, "sampling temperature (0: greedy)")
    system_prompt: str | None = _opt(None, "the assistant's instructions (default: a brief voice assistant)")
    asr_workers: int = _opt(1, "ASR passes that may run at once (one core each)")
    auth_token: str | None = _opt(
        None, "if set, clients must present this token (Bearer or ?token=)", secret=True
    )
    allow_unauthenticated: bool = _opt(
        False, "serve a host other machines can reach without auth_token (warned on every start)"
    )
    allowed_origins: str | None = _opt(
        None,
        "web origins (https://host[:port], comma-separated) whose pages may open sessions, besides this "
        "server's own page addressed by IP or localhost (a page under a domain name needs its origin here)",
    )
    max_message_bytes: int = _opt(1 << 20, "largest accepted HTTP body or gRPC message")
    max_sessions: int = _opt(16, "conversations at once, over all transports (more are refused)")
    session_idle_timeout_s: float = _opt(60.0, "a session whose client sends nothing this long is closed")
    max_session_s: float = _opt(14_400.0, "longest a session may last, seconds (then it is told and closed)")
    handshake_timeout_s: float = _opt(
        10.0,
        "a connection that has not begun its session this long is closed (gRPC before its "
        "SessionConfig, Twilio before 'start'); meanwhile it holds one of max_sessions",
    )
    slow_reader_timeout_s: float = _opt(
        10.0, "a client that reads nothing of what is sent to it this long is closed (WebSocket, gRPC)"
    )
    shutdown_timeout_s: float = _opt(4.0, "seconds to drain on SIGINT/SIGTERM before closing")
    webrtc_ice_servers: str | None = _opt(
        None, "STUN/TURN URLs for WebRTC, comma-separated (none by default: direct connections only)"
    )
    webrtc_ice_username: str | None = _opt(None, "username for the TURN servers")
    webrtc_ice_credential: str | None = _opt(None, "credential for the TURN servers", secret=True)
    webrtc_host_addresses: str | None = _opt(
        None,
        "local addresses offered as WebRTC host candidates, comma-separated (default: all, and 127.0.0.1)",
    )
    webrtc_connect_timeout_s: float = _opt(
        15.0, "a WebRTC peer not connected this long after its offer is closed"
    )
    sip_port: int | None = _opt(None, "UDP port of the SIP/RTP listener (off unless set)")
    sip_username: str | None = _opt(None, "SIP digest username callers must give (with sip_password)")
    sip_password: str | None = _opt(None, "SIP digest password", secret=True)
    sip_allow: str | None = _opt(
        None, "addresses that may call over SIP, comma-separated IPs or CIDRs (default: any)"
    )
    sip_public_address: str | None = _opt(
        None, "the IPv4 address to put in SDP (default: the listener's, or the route's to the caller)"
    )
    twilio_stream_url: str | None = _opt(
        None, "the wss:// URL Twilio should stream calls to (default: from the webhook request's host)"
    )

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def webrtc_ice_urls(self) -> list[str]:
        return _split(self.webrtc_ice_servers)

    @property
    def webrtc_hosts(self) -> list[str] | None:
        return _split(self.webrtc_host_addresses) if self.webrtc_host_addresses is not None else None

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(o.rstrip("/").lower() for o in _split(self.allowed_origins))

    @property
    def exposed(self) -> bool:
        """The listeners bind an address other machines can reach (not loopback)."""
        return self.host != "localhost" and not ipaddress.ip_address(self.host).is_loopback

    def unauthenticated_warning(self) -> str | None:
        """What to warn of on every start when `allow_unauthenticated` lets an exposed
        host serve without a token (None: nothing to warn of)."""
        if not self.exposed or self.auth_token:
            return None
        return (
            f"serving {self.host} without auth_token (allow_unauthenticated): anyone who can "
            "reach these ports can open sessions and read the instructions"
        )

    @property
    def host_for_url(self) -> str:
        """The host as it appears in a URL or a gRPC address (IPv6 in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    def llm_eager(self, model_path: str) -> bool:
        """Eager execution, by choice or where it was measured faster (`models.cpu_variant`)."""
        from models.cpu_variant import choose, cpu_backend
        from models.quantize import weights_of

        if self.llm_execution != "auto":
            return self.llm_execution == "eager"
        if not cpu_backend():
            return False
        return choose(weights_of(model_path), self.llm_dtype, "auto").execution == "eager"

    def llm_weights(self) -> str:
        """The LLM weights to prepare: none beyond the model's own when it runs elsewhere
        (``llm_url``: the local copy only gives the tokenizer)."""
        return "none" if self.llm_url else self.llm_quantization

    def llm_config(self, model_path: str) -> LlmConfig:
        """The AR stage's settings, for a prepared model directory."""
        from models.llm import DEFAULT_SYSTEM_PROMPT, LlmConfig

        return LlmConfig(
            model=model_path,
            dtype=self.llm_dtype,
            enforce_eager=self.llm_eager(model_path),
            kv_cache_gib=self.llm_kv_cache_gib,
            gpu_memory_fraction=self.llm_gpu_memory_fraction,
            max_model_len=self.llm_max_context,
            max_tokens=self.llm_max_tokens,
            temperature=self.llm_temperature,
            system_prompt=self.system_prompt if self.system_prompt is not None else DEFAULT_SYSTEM_PROMPT,
        )

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with secrets masked, for logs."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.metadata["secret"] and value else value
        return out


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _field_type(name: str) -> type:
    annotation = str(FIELDS[name].type)
    for t in (bool, int, float, str):
        if annotation.startswith(t.__name__):
            return t
    raise AssertionError(f"config field {name} has an unsupported type {annotation}")


def coerce(key: str, value: Any, origin: str) -> Any:
    """Check or convert one value; strings (env, flags) are parsed, TOML values checked."""
    if key not in FIELDS:
        raise ConfigError(key, f"unknown configuration key (known: {', '.join(FIELDS)})", origin)
    t = _field_type(key)
    shown = "a value" if FIELDS[key].metadata["secret"] else repr(value)  # never echo a secret
    if t is bool:
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False}
        parsed = words.get(value.strip().lower()) if isinstance(value, str) else value
        if not isinstance(parsed, bool):
            raise ConfigError(key, f"expected true or false, got {shown}", origin)
        return parsed
    if isinstance(value, str) and t is not str:
        try:
            return t(value)
        except ValueError:
            raise ConfigError(key, f"expected {t.__name__}, got {shown}", origin) from None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, t) or isinstance(value, bool):
        raise ConfigError(key, f"expected {t.__name__}, got {type(value).__name__} {shown}", origin)
    return value


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def _validate(config: Config) -> None:
    for name, f in FIELDS.items():
        choices = f.metadata["choices"]
        value = getattr(config, name)
        if choices and value not in choices:
            raise ConfigError(name, f"{value!r} is not one of {', '.join(choices)}")
    for name in ("port", "grpc_port", "sip_port"):
        port = getattr(config, name)
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(name, f"port {port} is outside 0-65535")
    if config.host != "localhost":
        try:
            ipaddress.ip_address(config.host)
        except ValueError:
            raise ConfigError("host", f"{config.host!r} is not an IP address or localhost") from None
    if not 0 < config.llm_kv_cache_gib <= 1024:
        raise ConfigError("llm_kv_cache_gib", "must be within (0, 1024]")
    if not 0 < config.llm_gpu_memory_fraction <= 1:
        raise ConfigError("llm_gpu_memory_fraction", "must be within (0, 1]")
    if not 256 <= config.llm_max_context <= 1 << 20:
        raise ConfigError("llm_max_context", "must be within 256-1048576")
    if not 1 <= config.llm_max_tokens < config.llm_max_context // 2:
        raise ConfigError("llm_max_tokens", "must be at least 1 and under half of llm_max_context")
    if not 0 <= config.llm_temperature <= 2:
        raise ConfigError("llm_temperature", "must be within [0, 2]")
    if not 1 <= config.asr_workers <= 64:
        raise ConfigError("asr_workers", "must be within 1-64")
    if not 1 <= config.max_sessions <= 10_000:
        raise ConfigError("max_sessions", "must be within 1-10000")
    if not 1 <= config.session_idle_timeout_s <= 86_400:  # also refuses nan
        raise ConfigError("session_idle_timeout_s", "must be within 1-86400 s")
    for name, low, high in (
        ("max_session_s", 10, 30 * 86_400),
        ("handshake_timeout_s", 1, 300),
        ("slow_reader_timeout_s", 1, 300),
    ):
        if not low <= getattr(config, name) <= high:  # also refuses nan
            raise ConfigError(name, f"must be within {low}-{high} s")
    if bool(config.sip_username) != bool(config.sip_password):
        raise ConfigError("sip_username", "sip_username and sip_password go together")
    try:
        ipaddress.ip_address(config.sip_public_address or "127.0.0.1")
        for network in _split(config.sip_allow):
            ipaddress.ip_network(network, strict=False)
    except ValueError as e:
        raise ConfigError("sip_allow", f"not an address or network: {e}") from None
    if config.max_message_bytes < 1024:
        raise ConfigError("max_message_bytes", "must be at least 1024")
    if not 0 < config.shutdown_timeout_s <= 4.5:  # also refuses nan
        raise ConfigError("shutdown_timeout_s", "must be within (0, 4.5]: SIGTERM must stop us within 5 s")
    for url in config.webrtc_ice_urls:
        if not url.startswith(("stun:", "stuns:", "turn:", "turns:")):
            raise ConfigError("webrtc_ice_servers", f"{url!r} is not a stun:, stuns:, turn: or turns: URL")
    for address in config.webrtc_hosts or []:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ConfigError("webrtc_host_addresses", f"{address!r} is not an IP address") from None
    if not 1 <= config.webrtc_connect_timeout_s <= 300:  # also refuses nan
        raise ConfigError("webrtc_connect_timeout_s", "must be within 1-300 s")
    if config.auth_token is not None and len(config.auth_token) < 8:
        raise ConfigError("auth_token", "must be at least 8 characters")
    for origin in config.origins:
        if not origin.startswith(("http://", "https://")) or "/" in origin.split("://", 1)[1]:
            raise ConfigError("allowed_origins", f"{origin!r} is not an origin (http[s]://host[:port])")
    if config.exposed and not config.auth_token and not config.allow_unauthenticated:
        raise ConfigError(
            "host",
            f"{config.host} is reachable from other machines and no auth_token is set: set "
            "auth_token (clients then present it), or allow_unauthenticated = true to serve anyway",
        )


def read_toml(path: Path) -> dict[str, Any]:
    origin = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("config", "no such file", origin) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError("config", f"unreadable TOML: {e}", origin) from None
    return {key: coerce(key, value, origin) for key, value in data.items()}


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for var, value in environ.items():
        if var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            key = var[len(ENV_PREFIX) :].lower()
            if key not in FIELDS:
                raise ConfigError(var, "unknown configuration variable", "environment")
            values[key] = coerce(key, value, f"environment {var}")
    return values


def load_config(config_file: Path | None, environ: Mapping[str, str], flags: Mapping[str, Any]) -> Config:
    """Merge the layers; ``flags`` holds only the options given on the command line."""
    merged: dict[str, Any] = {}
    if config_file is None and environ.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(environ[ENV_PREFIX + "CONFIG"])
    if config_file is not None:
        merged.update(read_toml(config_file))
    merged.update(read_env(environ))
    merged.update({k: coerce(k, v, f"--{k.replace('_', '-')}") for k, v in flags.items()})
    return Config(**merged)
