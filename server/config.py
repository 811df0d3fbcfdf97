"""Server settings: what the CLI flags (`--host`, `--temp`, ...) turn into."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1024 * 1024


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    model_alias: str | None = None  # the name the API serves; None = ModelInfo.model_id
    allowed_origins: list[str] = field(default_factory=list)  # CORS; [] = no CORS headers
    api_key: str | None = None  # require `Authorization: Bearer <key>` (or `x-api-key`)
    # Defaults for requests that leave a field out (mlx_lm.server's --max-tokens/--temp/--top-p).
    # None = the room the prompt leaves in the context (OpenAI's behaviour); always capped by it
    default_max_tokens: int | None = None
    default_temperature: float | None = None  # None = 1.0, OpenAI's default
    default_top_p: float | None = None  # None = 1.0
    max_request_bytes: int = 8 * MiB  # larger bodies get 413
    max_choices: int = 128  # prompts x n in one request
    log_level: str = "INFO"
    # threads that render chat templates and tokenize, off the event loop (server.prepare)
    prepare_threads: int = 2

    @property
    def temperature(self) -> float:
        return 1.0 if self.default_temperature is None else self.default_temperature

    @property
    def top_p(self) -> float:
        return 1.0 if self.default_top_p is None else self.default_top_p
