"""What kvdrill ships besides its code: the built-in stacks (``compose/``), the scenario catalogue
(``scenarios/``) and the component pins (``pins.toml``), found the same way from a checkout and from an
installed wheel.

In a checkout they are the top-level folders beside ``drills/``, where people edit them. A wheel carries
copies under ``drills/_shipped/`` (``setup.py`` puts them there at build time), because ``compose`` and
``scenarios`` are no importable packages and must not land loose in ``site-packages``. A checkout wins
when both exist: an editable install then reads the files being edited.

A scenario argument that is not a file is looked up in the catalogue, so ``kvdrill run
flagship/hit-rate-is-not-correctness`` works in a directory that holds no scenarios at all.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent
SCENARIO_SUFFIXES = (".yaml", ".yml")


def _root() -> Path:
    if (_CHECKOUT / "pins.toml").is_file() and (_CHECKOUT / "compose").is_dir():
        return _CHECKOUT
    return _PACKAGE / "_shipped"


DATA_ROOT = _root()
COMPOSE = DATA_ROOT / "compose"
CATALOGUE = DATA_ROOT / "scenarios"
PINS = DATA_ROOT / "pins.toml"


def in_catalogue(arg: Path) -> Path | None:
    """The catalogue's scenario (or folder) that ``arg`` names, when ``arg`` is no file or folder here:
    ``flagship/hit-rate-is-not-correctness``, with or without ``.yaml`` and a leading ``scenarios/``."""
    if arg.exists() or arg.is_absolute():
        return None
    parts = arg.parts[1:] if arg.parts[:1] == ("scenarios",) else arg.parts
    if not parts:
        return CATALOGUE if CATALOGUE.is_dir() else None
    base = CATALOGUE.joinpath(*parts)
    for candidate in (base, *(base.with_name(base.name + s) for s in SCENARIO_SUFFIXES)):
        if candidate.exists():
            return candidate
    return None


def resolve(arg: Path) -> Path:
    """``arg`` itself where it exists (or names nothing in the catalogue either, so the caller's error names
    what the user typed); else the catalogue's file or folder of that name."""
    return in_catalogue(arg) or arg


def catalogue_entries() -> list[Path]:
    """Every scenario file of the catalogue, relative to it, sorted."""
    if not CATALOGUE.is_dir():
        return []
    return sorted(p.relative_to(CATALOGUE) for p in CATALOGUE.rglob("*")
                  if p.suffix in SCENARIO_SUFFIXES and p.is_file())
