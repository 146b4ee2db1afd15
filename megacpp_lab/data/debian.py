"""Hand-written C++ from Debian's packages: pinned `.deb` files, fetched, checked and unpacked in Python.

    pkgs = resolve_packages(["libfmt-dev", "nlohmann-json3-dev"])   # from PINNED; an unknown name fails closed
    path = fetch_deb(pkgs[0], cache / "debs")                        # apt-get download, else the archive's pool
    files = list(cpp_members(path, pkgs[0]))                         # (install path, bytes) of its C++ files

Every package is pinned by version, pool path and sha256 (Debian 12 "bookworm", the archive these machines
reach). `fetch_deb` keeps a verified copy in the cache and refetches nothing it holds; a download whose sha256
differs from the pin is deleted and fails closed, naming the package. A `.deb` is an `ar` archive holding
`data.tar.{xz,gz,zst}`: `deb_data_members` reads it with the standard library alone (zstd needs the optional
`zstandard` module and says so).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEBIAN_MIRROR",
    "DebPackage",
    "PINNED",
    "cpp_members",
    "deb_data_members",
    "fetch_deb",
    "is_cpp_header",
    "resolve_packages",
]

DEBIAN_MIRROR = "http://deb.debian.org/debian"
# the suffixes of C and C++ sources and their included fragments (.inc, .tcc, .ipp: template bodies)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".inl", ".ipp", ".tcc", ".inc", ".cuh",
                   ".c", ".cc", ".cpp", ".cxx", ".cu")  # fmt: skip


@dataclass(frozen=True)
class DebPackage:
    """One pinned binary package: what apt would fetch, and the licence its files carry (the package's main
    licence from its Debian copyright file; files under another licence in a mixed package are not told apart)."""

    name: str
    version: str
    pool_path: str  # under the mirror root: pool/main/...
    size: int
    sha256: str
    license: str
    role: str = "train"  # "train": split into train/val/test by file; "heldout": a whole library held out

    @property
    def file_name(self) -> str:
        return self.pool_path.rsplit("/", 1)[1]


# Debian 12 (bookworm), amd64/all: the header-only and header-heavy libraries of the issue, and the C++ standard
# library's headers. CGAL is the held-out library: a different domain (computational geometry), whole.
PINNED: tuple[DebPackage, ...] = (
    DebPackage("libboost1.81-dev", "1.81.0-5+deb12u1", "pool/main/b/boost1.81/libboost1.81-dev_1.81.0-5+deb12u1_amd64.deb",
               10372400, "bfe6d942c9fa4d68c8455e712a16fe3911f85d92959a0753cb22e5c13c2067de", "BSL-1.0"),
    DebPackage("libeigen3-dev", "3.4.0-4", "pool/main/e/eigen3/libeigen3-dev_3.4.0-4_all.deb",
               1040780, "1a167bb381acb90c1d8450a8f3e66a09d216dbc64b33ac8a082a0912513ef939", "MPL-2.0"),
    DebPackage("libabsl-dev", "20220623.1-1+deb12u2", "pool/main/a/abseil/libabsl-dev_20220623.1-1+deb12u2_amd64.deb",
               972632, "24cdc091cd8e88754401f9d18e3be3d354ef96c453934ff138106fcb0245958b", "Apache-2.0"),
    DebPackage("libfmt-dev", "9.1.0+ds1-2", "pool/main/f/fmtlib/libfmt-dev_9.1.0+ds1-2_amd64.deb",
               171348, "c8fa00dd0269e6eda9fd06668df3d720de4b5a1f647dcd3c6e0ba63f0cbf2150", "MIT"),
    DebPackage("nlohmann-json3-dev", "3.11.2-2", "pool/main/n/nlohmann-json3/nlohmann-json3-dev_3.11.2-2_all.deb",
               258828, "ec57940def6b6186c30be0e0ee81d1e58f86d11a54a145b28686a1e3e4aae801", "MIT"),
    DebPackage("libstdc++-12-dev", "12.2.0-14+deb12u1", "pool/main/g/gcc-12/libstdc++-12-dev_12.2.0-14+deb12u1_amd64.deb",
               2047292, "d28def6c23630432b57cb38a4c2fd67a79d4e0484027386ca6e8d6005c3d7a73",
               "GPL-3.0-or-later WITH GCC-exception-3.1"),
    DebPackage("libcgal-dev", "5.5.1-2", "pool/main/c/cgal/libcgal-dev_5.5.1-2_amd64.deb",
               4865728, "b49f0c8c541d71fb0d63771a472eaf09a3481a5468b40523d886239ce70c8ba3",
               "GPL-3.0-or-later OR LGPL-3.0-or-later (per file)", role="heldout"),
)  # fmt: skip


def resolve_packages(names: Sequence[str] | None = None) -> list[DebPackage]:
    """The pinned packages named (all of them when None), in PINNED's order. An unknown or repeated name fails
    closed: only a pinned package (version and sha256 known) can enter the corpus."""
    if names is None:
        return list(PINNED)
    known = {p.name: p for p in PINNED}
    seen: set[str] = set()
    for name in names:
        if name not in known:
            raise ValueError(f"package {name!r} is not pinned (data/debian.py PINNED: {', '.join(known)}); "
                             "a package enters the corpus with its version and sha256")  # fmt: skip
        if name in seen:
            raise ValueError(f"package {name!r} is named twice")
        seen.add(name)
    if not names:
        raise ValueError("no package named")
    return [p for p in PINNED if p.name in seen]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _apt_download(pkg: DebPackage, dest: Path) -> Path | None:
    """`apt-get download name=version` into a temporary directory (no install, no root), or None where apt is
    missing or cannot fetch it (the caller then goes to the pool over HTTP)."""
    apt = shutil.which("apt-get")
    if apt is None:
        return None
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        try:
            done = subprocess.run([apt, "download", f"{pkg.name}={pkg.version}"], cwd=tmp, capture_output=True,
                                  timeout=300, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        got = sorted(Path(tmp).glob("*.deb"))
        if done.returncode != 0 or len(got) != 1:
            return None
        target = dest / (pkg.file_name + ".part")
        shutil.move(str(got[0]), target)
        return target


def _http_download(pkg: DebPackage, dest: Path, mirror: str) -> Path:
    url = f"{mirror.rstrip('/')}/{pkg.pool_path}"
    target = dest / (pkg.file_name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=120) as response, open(target, "wb") as out:  # noqa: S310
            shutil.copyfileobj(response, out)
    except OSError as e:
        target.unlink(missing_ok=True)
        raise OSError(f"package {pkg.name}: download of {url} failed: {e}") from e
    return target


def _matches_pin(path: Path, pkg: DebPackage) -> tuple[bool, str]:
    """(whether the file is the pinned one, what it is instead): its size, then its sha256."""
    size = path.stat().st_size
    if size != pkg.size:
        return False, f"{size} bytes, the pin {pkg.size}"
    got = _sha256(path)
    return got == pkg.sha256, f"sha256 {got}, the pin {pkg.sha256}"


def fetch_deb(pkg: DebPackage, cache_dir: str | Path, *, mirror: str = DEBIAN_MIRROR, use_apt: bool = True) -> Path:
    """The package's verified `.deb` in cache_dir: the cached copy when its size and sha256 match the pin, else
    downloaded and checked: apt-get download where apt is present and use_apt (a file that is not the pinned one,
    such as another architecture's build, is discarded), else `mirror`/pool_path. A download from the pool that is
    not the pinned file is deleted and raises, naming the package."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / pkg.file_name
    if final.exists():
        if _matches_pin(final, pkg)[0]:
            return final
        final.unlink()  # a stale or corrupt copy: fetched again below
    part = _apt_download(pkg, cache_dir) if use_apt else None
    if part is not None and not _matches_pin(part, pkg)[0]:
        part.unlink(missing_ok=True)  # apt's file is not the pinned one: the pool's is
        part = None
    if part is None:
        part = _http_download(pkg, cache_dir, mirror)
        ok, what = _matches_pin(part, pkg)
        if not ok:
            part.unlink(missing_ok=True)
            raise ValueError(f"package {pkg.name} {pkg.version}: the download is {what} (a corrupt or substituted "
                             "file; deleted)")  # fmt: skip
    os.replace(part, final)
    return final


def _ar_members(blob: bytes, where: str) -> Iterator[tuple[str, bytes]]:
    if blob[:8] != b"!<arch>\n":
        raise ValueError(f"{where}: not an ar archive (a .deb starts with '!<arch>')")
    i = 8
    while i < len(blob):
        header = blob[i : i + 60]
        if len(header) < 60 or header[58:60] != b"`\n":
            raise ValueError(f"{where}: a truncated or malformed ar member header at byte {i}")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58])
        except ValueError:
            raise ValueError(f"{where}: ar member {name!r} at byte {i} has a malformed size field") from None
        i += 60
        if i + size > len(blob):
            raise ValueError(f"{where}: ar member {name!r} runs past the end of the file (byte {i + size})")
        yield name, blob[i : i + size]
        i += size + (size & 1)


def deb_data_members(path: str | Path, package: str) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """(member, bytes) for every member of the .deb's data.tar (bytes None for what is not a regular file)."""
    blob = Path(path).read_bytes()
    where = f"package {package} ({Path(path).name})"
    data = {name: body for name, body in _ar_members(blob, where) if name.startswith("data.tar")}
    if len(data) != 1:
        raise ValueError(f"{where}: expected one data.tar.* member, found {sorted(data) or 'none'}")
    (name, body), = data.items()
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise ValueError(f"{where}: {name} is zstd-compressed; install the 'zstandard' module to read it") from e
        body, mode = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(), "r:"
    else:
        mode = {"data.tar.xz": "r:xz", "data.tar.gz": "r:gz", "data.tar.bz2": "r:bz2", "data.tar": "r:"}.get(name)
        if mode is None:
            raise ValueError(f"{where}: unknown data member compression {name!r}")
    with tarfile.open(fileobj=io.BytesIO(body), mode=mode) as tf:
        for member in tf:
            yield member, (tf.extractfile(member).read() if member.isfile() else None)


def is_cpp_header(install_path: str, data: bytes) -> bool:
    """A C or C++ source under usr/include: a known suffix, or (the standard library's `vector`, Eigen's `Dense`)
    no suffix at all and text (no NUL byte, valid UTF-8)."""
    if "/usr/include/" not in f"/{install_path.lstrip('./')}":
        return False
    base = install_path.rsplit("/", 1)[-1]
    if "." not in base:
        if b"\0" in data:
            return False
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True
    return base.lower().endswith(HEADER_SUFFIXES)


def cpp_members(path: str | Path, pkg: DebPackage) -> Iterator[tuple[str, bytes]]:
    """(install path without the leading './', bytes) of each C/C++ file the package installs under usr/include;
    links are skipped (their targets are files of their own)."""
    for member, data in deb_data_members(path, pkg.name):
        if data is None:
            continue
        name = member.name.lstrip("./")
        if is_cpp_header(name, data):
            yield name, data
