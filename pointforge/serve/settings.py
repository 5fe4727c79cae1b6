"""What `pointforge serve` is told, and the rules that refuse an unsafe or impossible setting."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pointforge.errors import UserError

__all__ = ["ServeSettings", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses of the loopback network (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServeSettings:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_upload_mb: float = 512.0
    max_disk_gb: float = 20.0
    ensemble: int = 5
    sampler: str = "ddim"
    steps: int | None = None
    public_url: str | None = None  # the address browsers use behind a reverse proxy (https://host[:port])
    max_voxels: int = 640**3  # refuses a volume whose header promises more (a decompression bomb) before reading it

    @property
    def public_origin(self) -> tuple[str, str] | None:
        """(origin, host) of ``public_url``: what a browser behind the proxy sends as Origin and Host."""
        if self.public_url is None:
            return None
        parsed = urlsplit(self.public_url)
        return f"{parsed.scheme}://{parsed.netloc}", parsed.netloc

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def max_disk_bytes(self) -> int:
        return int(self.max_disk_gb * 1024**3)

    def check_reach(self, has_tokens: bool) -> None:
        """Beyond loopback (or behind a proxy) only people with a named token may use the service."""
        if has_tokens:
            return
        reach = f"--public-url {self.public_url}" if self.public_url is not None else f"--host {self.host}"
        if self.public_url is not None or not is_loopback(self.host):
            raise UserError(
                f"{reach} makes the service reachable by others, and {self.data_dir} has no tokens; make one per "
                f"person first: pointforge serve token add NAME --data-dir {self.data_dir}"
            )

    def validate(self) -> None:
        if self.public_url is not None:
            parsed = urlsplit(self.public_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.path not in ("", "/"):
                raise UserError(f"--public-url must be like https://implants.example.org, got {self.public_url!r}")
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if not 0 <= self.port < 65536:
            raise UserError(f"--port must be between 0 and 65535, got {self.port}")
        if self.max_upload_mb <= 0 or self.max_disk_gb <= 0:
            raise UserError("--max-upload-mb and --max-disk-gb must be positive")
