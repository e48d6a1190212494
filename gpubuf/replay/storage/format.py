"""The files of a ``storage_dir`` as found on disk, checked before anything is mapped or written: its
description (``gpubuf.json``), its leaf files, leftovers of a buffer without a description, the counters of the
format written before the row journal, and the flushed state (``state.pt``). Damage raises ``ValueError`` naming
the file (:mod:`gpubuf.replay.storage.directory` lists what counts as damage)."""

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from gpubuf.replay.storage.journal import JOURNAL, LEGACY_WORDS, WORDS

META, COUNTERS, STATE = "gpubuf.json", "counters.bin", "state.pt"
LAYOUT = "env-major"  # of the leaf files: recorded in the configuration, checked on re-opening
RESERVED = (META, COUNTERS, STATE, "lock")
LEAF_FILE = re.compile(r"leaf[0-9]+\.bin")  # the only names a leaf file may have
# a buffer's files besides its leaves: any of them without gpubuf.json is a damaged directory
LEFTOVERS = (COUNTERS, STATE, "counters.tmp", "state.pt.tmp", "gpubuf.tmp")


def check_meta(path: Path, meta: dict) -> dict:
    """Compare the configuration and leaves (shapes, dtypes) stored in ``path``'s ``gpubuf.json`` with ``meta``;
    returns the stored description, its leaves each in a file of its own (a plain name inside the directory,
    distinct from the bookkeeping files)."""
    meta_file = path / META
    try:
        stored = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"storage_dir: cannot read {meta_file} ({err})") from None
    if not (isinstance(stored, dict) and all(isinstance(stored.get(k), dict) for k in ("config", "leaves"))
            and all(isinstance(v, dict) and isinstance(v.get("file"), str)
                    and Path(v["file"]).name == v["file"]  # leaf files are plain names inside the directory
                    for v in stored["leaves"].values())):
        raise ValueError(f"storage_dir: {meta_file} is not a gpubuf buffer description")
    for key in ("config", "leaves"):
        ours = meta[key] if key == "config" else {n: {**v, "file": None} for n, v in meta[key].items()}
        theirs = stored[key] if key == "config" else {n: {**v, "file": None} for n, v in stored[key].items()}
        for field in [*ours, *sorted(set(theirs) - set(ours))]:  # the buffer type first
            if theirs.get(field) != ours.get(field):
                raise ValueError(f"storage_dir: {str(path)!r} holds a buffer whose {key} '{field}' is "
                                 f"{theirs.get(field)!r}, not {ours.get(field)!r}")
    owners: dict[str, str] = {}
    for name, leaf in stored["leaves"].items():
        file = leaf["file"]
        if file in RESERVED or file in owners:
            other = f"leaf {owners[file]!r}" if file in owners else "the directory's bookkeeping"
            raise ValueError(f"storage_dir: {meta_file} names the file {file!r} for leaf {name!r} and for "
                             f"{other}; every leaf needs a file of its own")
        if not LEAF_FILE.fullmatch(file):
            raise ValueError(f"storage_dir: {meta_file} names the file {file!r} for leaf {name!r}; expected a name "
                             "like 'leaf0.bin'")
        owners[file] = name
    if "journal" in stored and stored["journal"] != JOURNAL:
        raise ValueError(f"storage_dir: {meta_file} describes the row journal as {stored['journal']!r}, not "
                         f"{JOURNAL!r}")
    check_distinct([path / f for f in owners] + [path / COUNTERS])
    return stored


def check_distinct(files: list[Path]) -> None:
    """Raise if a file is a symbolic link or two are one file (hard links): each leaf owns its bytes."""
    seen: dict[tuple, Path] = {}
    for file in files:
        if file.is_symlink():
            raise ValueError(f"storage_dir: {file} is a symbolic link; a leaf file must be a file of the "
                             "directory's own")
        if file.is_file():
            st = file.stat()
            key = (st.st_dev, st.st_ino)
            if key in seen:
                raise ValueError(f"storage_dir: {file} and {seen[key]} are one file (hard links); every leaf "
                                 "needs a file of its own")
            seen[key] = file


def check_no_buffer_files(path: Path) -> None:
    """Raise if ``path``, which holds no ``gpubuf.json``, holds a buffer's files: it is never created over."""
    found = sorted(p.name for p in path.iterdir() if LEAF_FILE.fullmatch(p.name) or p.name in LEFTOVERS)
    if found:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise ValueError(f"storage_dir: {str(path)!r} holds a buffer's files ({shown}) but no {META}, which "
                         "describes them (lost, or a creation cut short): it cannot be re-opened, and a new buffer "
                         f"is not created over it (nothing in it was changed); restore its {META}, or remove the "
                         "directory to create a new buffer there")


def is_legacy_counters(path: Path) -> bool:
    """Whether ``counters.bin`` has the size of the counters written before the journal."""
    file = path / COUNTERS
    return file.is_file() and file.stat().st_size == LEGACY_WORDS * 8


def legacy_counters(path: Path, stored: dict, M: int) -> tuple[int, int, int]:
    """The three counters ``(position, rows held, rows ever written)`` of a ``counters.bin`` of 24 bytes, taken
    as the format written before the journal only where they are one (:mod:`gpubuf.replay.storage.directory`); else
    ``ValueError`` naming it."""
    file = path / COUNTERS
    pos, count, total = (int(v) for v in np.fromfile(file, dtype=np.int64))
    why = None
    if "journal" in stored:
        why = f"{META} was written with the {WORDS}-word journal, so this is not the earlier format"
    elif not (0 <= pos < M and 0 <= count <= M and total >= count and (count == M or pos == count == total)):
        why = (f"as that format (position {pos}, rows held {count}, rows ever written {total}) they are not a "
               f"ring of {M} rows per env: one not yet full holds rows 0 .. position - 1, every row written")
    else:
        state = read_state(path)
        if isinstance(state, dict) and "flush" in state:
            why = f"{STATE} was saved by flush {state['flush']!r} of the journal, so this is not the earlier format"
    if why is not None:
        raise ValueError(f"storage_dir: {file} holds {LEGACY_WORDS * 8} bytes, the three counters of a directory "
                         f"written before the row journal, but {why}: it is a damaged (cut short?) row journal "
                         f"({WORDS} int64 words); the rows cannot be placed without it")
    return pos, count, total


def read_state(path: Path) -> dict | None:
    """What the last flush wrote to ``path``'s ``state.pt``, or None (no file); a file that cannot be read
    (truncated, not one torch saved with plain values) or holds no dict raises ``ValueError`` naming it."""
    file = path / STATE
    if not os.path.lexists(file):
        return None
    try:
        state = torch.load(file, weights_only=True)
    except MemoryError:
        raise
    except Exception as err:  # whatever torch raises on a damaged file
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no message"
        raise ValueError(f"storage_dir: {file} cannot be restored: it cannot be read as a flush's state "
                         f"({type(err).__name__}: {first})") from None
    if not isinstance(state, dict):
        raise ValueError(f"storage_dir: {file} cannot be restored (ValueError: expected the dict a flush saves, "
                         f"got {type(state).__name__})")
    return state
