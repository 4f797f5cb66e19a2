"""Download, into ``.whl/``, the wheels that finetune needs on the lent GPU machine and that its image lacks.

That machine (Python 3.12, manylinux x86-64, a CUDA torch) cannot download anything: what finetune needs beyond its
image travels as wheels next to the working tree, and both together must stay small (40 MiB here; the tree and the
carried folders may be 64 MiB in all). What to bundle is computed, never listed by hand:

- the closure of finetune's runtime requirements (pyproject.toml's dependencies, as installed in this venv: the
  metadata of the installed versions says what each needs; markers evaluated for the image's Python 3.12 on Linux),
- less what the image has (scripts/device_image.txt), unless a requirement's range excludes the image's version
  (then the bundle carries the pinned one); what the image has is not walked further: its own needs are met there,
- less torch (the image's CUDA build is the one to use) and the packages that are optional there and too large or
  not buildable offline (wandb, deepspeed, flash-attn, bitsandbytes), with everything only they need: finetune
  imports them only when a recipe asks for them.

Each bundled package is pinned to its constraints.txt version (what the suite ran with), one wheel each: a wheel
already in ``.whl/`` at that version is kept, another version of it is removed (two versions stop the whole
install there). It prints the list, the wheels' size and the working tree's, and exits 1 with one line when the two
together exceed the limit. ``make device-bundle`` runs it; ``--list`` computes and prints the list without
downloading.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "scripts" / "device_image.txt"
CONSTRAINTS = ROOT / "constraints.txt"
WHEELS = ROOT / ".whl"
LIMIT_MIB = 40
KEPT_FROM_IMAGE = frozenset({"torch"})  # the image's CUDA build: a bundled CPU or other build would replace it
# too large to carry or not buildable there; finetune imports each only when a recipe asks for it
OPTIONAL_THERE = frozenset({"wandb", "deepspeed", "flash-attn", "bitsandbytes"})
PYTHON = (3, 12)
# the image's interpreter, for requirement markers (python_version, sys_platform, ...)
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
# pip matches a manylinux_2_N tag exactly, so every N the image's glibc (2.39) runs is named
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64")


class BundleError(Exception):
    """A bundle that cannot be made as asked: printed as one line, exit 1."""


@dataclass
class Plan:
    """What travels: ``bundle`` maps each package to its pinned version, ``why`` says what needs it; ``left_out`` are
    the optional and kept packages that finetune's requirements reached; ``unchecked`` are requirements on image
    packages whose version there is not known (taken as met)."""

    bundle: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    left_out: set[str] = field(default_factory=set)
    unchecked: list[str] = field(default_factory=list)


def read_image(path: Path = IMAGE_LIST) -> dict[str, Version | None]:
    """The image's packages: ``{canonical name: version, or None where the list gives none}``."""
    image: dict[str, Version | None] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        key = canonicalize_name(name.strip())
        if not name.strip() or key in image:
            raise BundleError(f"{path.name}:{number}: {raw!r}: expected one new package as NAME or NAME==VERSION")
        image[key] = Version(version.strip()) if version else None
    return image


def read_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """constraints.txt as ``{canonical name: version}``."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether ``requirement`` holds on the image's Python for a package installed with ``extras``."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({**TARGET_ENV, "extra": extra}) for extra in {"", *extras})


def plan(image: dict[str, Version | None], pins: dict[str, str], root: str = "finetune") -> Plan:
    """The bundle for an image with ``image``'s packages, pinned by ``pins``, from ``root``'s installed metadata."""
    result = Plan()
    todo: list[tuple[Requirement, str, set[str]]] = [
        (Requirement(line), root, set()) for line in metadata.requires(root) or []]
    while todo:
        requirement, parent, parent_extras = todo.pop(0)
        if not _applies(requirement, parent_extras):
            continue
        name = canonicalize_name(requirement.name)
        if name in KEPT_FROM_IMAGE or name in OPTIONAL_THERE:
            result.left_out.add(name)
            continue
        if name in image and name not in result.bundle:
            there = image[name]
            if there is None:
                if requirement.specifier:
                    result.unchecked.append(f"{parent} needs {requirement.name}{requirement.specifier}")
                continue
            if requirement.specifier.contains(there, prereleases=True):
                continue
            reason = f"{parent} needs {requirement.name}{requirement.specifier}, the image has {there}"
        else:
            reason = f"{parent} needs {requirement.name}{requirement.specifier}" + (
                "" if name in image else "; not in the image")
        pinned = pins.get(name)
        if pinned is None:
            raise BundleError(f"{name} (which {parent} needs) is not pinned in constraints.txt: run make constraints")
        if not requirement.specifier.contains(pinned, prereleases=True):
            raise BundleError(f"{parent} needs {requirement.name}{requirement.specifier} but constraints.txt pins "
                              f"{name}=={pinned}")
        if name in result.bundle:
            continue
        try:
            installed = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise BundleError(f"{name} is not installed in this venv, so its own requirements are unknown: "
                              "make setup") from None
        if installed.version != pinned:
            raise BundleError(f"{name} {installed.version} is installed but constraints.txt pins {pinned}: make setup")
        result.bundle[name], result.why[name] = pinned, reason
        extras = set(requirement.extras)
        todo += [(Requirement(line), name, extras) for line in installed.requires or []]
    return result


def target_tags() -> set[Tag]:
    """The wheel tags of the image's CPython 3.12 on manylinux x86-64. Not an older Python's ``py311``: pip would
    install such a wheel there, but a package that builds one per Python (multiprocess) needs its ``py312`` one."""
    general = {tag for tag in compatible_tags(PYTHON, "cp312", platforms=PLATFORMS)
               if tag.interpreter in ("py312", "py3", "cp312")}
    return {*cpython_tags(PYTHON, platforms=PLATFORMS), *general}


@dataclass
class Folder:
    """The wheels folder against a bundle: ``have`` (matching wheels, by name), ``stale`` (other versions or builds
    of bundled packages, to delete), ``others`` (wheels of packages outside the bundle: left there, and they travel
    too)."""

    have: dict[str, Path] = field(default_factory=dict)
    stale: list[Path] = field(default_factory=list)
    others: list[Path] = field(default_factory=list)


def survey(folder: Path, bundle: dict[str, str]) -> Folder:
    """Which of ``bundle``'s wheels ``folder`` already holds: what a re-run need not download again."""
    found = Folder()
    tags = target_tags()
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        try:
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            found.others.append(path)
            continue
        if name not in bundle:
            found.others.append(path)
        elif version == Version(bundle[name]) and wheel_tags & tags and name not in found.have:
            found.have[name] = path
        else:
            found.stale.append(path)
    return found


def download(name: str, version: str, dest: Path) -> None:
    """``pip download`` of one wheel, no dependencies (the plan named each), for the image's Python and platform."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", ".".join(map(str, PYTHON)), "--implementation", "cp",
               *(arg for platform in PLATFORMS for arg in ("--platform", platform)), "-d", str(dest),
               f"{name}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise BundleError(f"pip download {name}=={version} found no wheel for CPython 3.12 on manylinux x86-64")


def tree_bytes(root: Path = ROOT) -> tuple[int, int]:
    """(bytes, files) of the working tree that travels: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    files = [root / name for name in set(listed.split("\0")) if name]
    sizes = [path.stat().st_size for path in files if path.is_file() and not path.is_symlink()]
    return sum(sizes), len(sizes)


def over_limit(tree: int, wheels: int, limit_mib: float = LIMIT_MIB) -> str | None:
    """The one line to fail with when the working tree and the wheels together exceed ``limit_mib``, else None."""
    if tree + wheels <= limit_mib * 2**20:
        return None
    return (f"the working tree ({mib(tree)}) and the wheels ({mib(wheels)}) together are {mib(tree + wheels)}, over "
            f"the {limit_mib:g} MiB the device bundle may take")


def mib(size: int) -> str:
    """A byte count in MiB, one decimal."""
    return f"{size / 2**20:.1f} MiB"


def human(size: int) -> str:
    """A wheel's size: in KiB below one MiB (most wheels are), else in MiB."""
    return f"{size / 2**10:.0f} KiB" if size < 2**20 else mib(size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=WHEELS, help="the wheels folder (ignored by git)")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="the working tree and wheels together")
    parser.add_argument("--list", action="store_true", help="print the list only: no download, no size check")
    args = parser.parse_args(argv)
    try:
        bundle = plan(read_image(), read_pins())
        print(f"bundle for the GPU image (CPython {'.'.join(map(str, PYTHON))}, manylinux x86-64), "
              f"{len(bundle.bundle)} wheels into {args.dest}:")
        if args.list:
            for name, version in sorted(bundle.bundle.items()):
                print(f"  {f'{name}=={version}':<32} {bundle.why[name]}")
        else:
            args.dest.mkdir(parents=True, exist_ok=True)
            folder = survey(args.dest, bundle.bundle)
            for path in folder.stale:
                print(f"  removing {path.name} (another version or build)")
                path.unlink()
            for name, version in sorted(bundle.bundle.items()):
                if name not in folder.have:
                    download(name, version, args.dest)
            folder = survey(args.dest, bundle.bundle)
            missing = sorted(set(bundle.bundle) - set(folder.have))
            if missing:
                raise BundleError(f"pip saved no usable wheel for {', '.join(missing)} in {args.dest}")
            for name, path in sorted(folder.have.items()):
                print(f"  {f'{name}=={bundle.bundle[name]}':<32} {human(path.stat().st_size):>9}  {bundle.why[name]}")
            for path in folder.others:
                print(f"  {path.name}: not in the bundle, left there (it travels too)")
        print(f"left out: {', '.join(sorted(bundle.left_out))} (torch is the image's; the others are optional there)")
        if bundle.unchecked:
            print("taken as met by the image (device_image.txt gives no version):")
            for line in bundle.unchecked:
                print(f"  {line}")
        if args.list:
            return 0
        wheels = sum(path.stat().st_size for path in args.dest.glob("*.whl"))
        tree, files = tree_bytes()
        print(f"wheels {mib(wheels)} + working tree {mib(tree)} ({files} files) = {mib(wheels + tree)} "
              f"of {args.limit_mib:g} MiB")
        problem = over_limit(tree, wheels, args.limit_mib)
        if problem:
            raise BundleError(problem)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
