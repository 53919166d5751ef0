"""The server's own settings (the engine's are an `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from morion.config import EngineConfig
from morion.errors import MorionError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# The largest schema, regex or forced-tools grammar (its JSON text) a request may ask to compile; time and
# memory are bounded by the compiler process too (`grammar_worker.py`).
MAX_GRAMMAR_SOURCE_BYTES = 64 * 2**10


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"  # loopback unless asked: the server has no TLS
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the known model's name, or the file / directory name
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    read_timeout: float = 30.0  # seconds a client gets to send a request's headers, and then its body
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); "*": any
    grammar_timeout: float = 10.0  # seconds one grammar (schema, regex, forced tools) may take to compile
    grammar_memory_gb: float = 1.0  # memory one grammar's compilation may take
    tool_call_parser: str | None = None  # None: from the chat template (see server/chat_tools.py)
    reasoning_parser: str | None = None  # None: no reasoning split
    profile: str | None = None  # the --config file, reported in the startup summary
    log_level: str = "info"  # morion's and uvicorn's loggers, in both processes
    log_requests: bool = False  # one line per request (server/request_log.py)
    allowed_local_media_path: str | None = None  # file:// images are read under it (None: refused)

    def __post_init__(self) -> None:
        path = self.allowed_local_media_path
        if path is not None and not Path(path).is_dir():
            raise MorionError(f"--allowed-local-media-path {path}: not a directory")
