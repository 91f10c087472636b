"""constraints.txt pins every distribution of the running environment, at the version installed.

Why: `make` installs with ``-c constraints.txt``, so two installs a month apart get the same libraries only if
the file names every one of them (indirect dependencies too). A dependency added to pyproject.toml, or a new
indirect one, fails here until ``make constraints`` re-pins.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "tpgrpo"
NOT_PINNED = {"pip"}  # the installer comes with the venv; nothing requires it
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def read_pins(text: str) -> tuple[dict[str, str], list[str]]:
    """``({canonical name: version}, [lines that are not a plain ``name==version`` pin])``, comments and blank
    lines skipped."""
    pins, bad = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found = PIN.match(line)
        if found is None:
            bad.append(line)
        else:
            pins[canonicalize_name(found[1])] = found[2]
    return pins, bad


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution importlib.metadata sees in this environment."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}


def torch_closure() -> set[str]:
    """torch and every distribution it requires, transitively (markers evaluated here)."""
    seen, todo = set(), ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def uncovered(pins: dict[str, str], have: dict[str, str], torch_build: str | None) -> list[str]:
    """What the pins miss in ``have``: a distribution not pinned, or installed at another version (a local
    label, torch's ``+cpu``, is the same release). With a torch build other than the CPU one (CUDA: its
    libraries are requirements of PyPI's wheel only), torch's own requirements that the file does not pin are
    let pass."""
    exempt = NOT_PINNED | {PROJECT}
    if torch_build not in (None, "cpu"):
        exempt |= torch_closure() - set(pins)
    problems = []
    for name, version in sorted(have.items()):
        if name in exempt:
            continue
        if name not in pins:
            problems.append(f"{name}=={version} is not pinned")
        elif Version(version).public != Version(pins[name]).public:
            problems.append(f"{name} is {version}, pinned {pins[name]}")
    return problems


def test_constraints_pin_every_installed_distribution():
    pins, bad = read_pins((ROOT / "constraints.txt").read_text())
    assert not bad, f"lines of constraints.txt that are not name==version: {bad}"
    have = installed()
    torch_build = Version(have["torch"]).local if "torch" in have else None
    problems = uncovered(pins, have, torch_build)
    assert not problems, ("constraints.txt does not match this environment (re-pin with `make constraints`, or "
                          f"reinstall with `make install`): {problems}")
    assert PROJECT not in pins and "torch" in pins


def test_uncovered_names_a_missing_or_different_pin():
    pins = {"numpy": "2.3.0", "torch": "2.13.0"}
    assert uncovered(pins, {"numpy": "2.3.0", "torch": "2.13.0+cpu", PROJECT: "0.1.0", "pip": "24"}, "cpu") == []
    assert uncovered(pins, {"numpy": "2.3.1", "torch": "2.13.0", "tqdm": "4.67"}, "cpu") == [
        "numpy is 2.3.1, pinned 2.3.0", "tqdm==4.67 is not pinned"]


def test_read_pins_refuses_ranges_and_urls():
    pins, bad = read_pins("# header\nnumpy==2.3.0\nrich>=13\ntorch @ file:///x.whl\n\n")
    assert pins == {"numpy": "2.3.0"} and bad == ["rich>=13", "torch @ file:///x.whl"]


def test_makefile_installs_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt -e '.[test]'" in makefile
    assert re.search(r"^\$\(STAMP\): .*constraints\.txt", makefile, re.M)  # a re-pin reinstalls
