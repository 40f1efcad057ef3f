"""Files the user names for a command's output (`--out plan.json`, `--plot sim.png`, `--json r.json`).

`output_file` makes the file's folder, as `make-dataset --out a/b/c` makes its own, so that a run
never fails after its work for want of a folder, and names the path when it cannot be written to:
an existing folder, a file where a folder would have to be, or a folder it may not write in.
Standard library only.
"""

from __future__ import annotations

from pathlib import Path


def output_file(path: str | Path) -> Path:
    """`path`, with its parent folders made; a ValueError naming it when no file can be written there."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; give the name of a file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in reversed(path.parents) if p.is_symlink() or (p.exists() and not p.is_dir())),
                        path.parent)
        raise ValueError(f"{path}: cannot make its folder, {blocking} is a file or a broken link") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot make its folder ({error.strerror or error})") from None
    return path
