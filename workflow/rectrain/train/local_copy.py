"""Copy a .rec/.idx pair to node-local storage once per node before training reads it.

On a cluster the packed pair usually sits on a shared network filesystem; every epoch re-reading it
from there starves the GPUs the way a .rec on a spinning disk does, only worse, so with
`pack.stage_to_local: true` each node copies the pair to its local SSD first.

Every rank may call `stage_pair`: an exclusive file lock in the local directory makes the first
caller on a node copy while the others wait, then find an identical pair and skip.  A copy is
written to a temporary name, its sha256 compared with the source's (hashed while copying), and only
then renamed into place, so a crash never leaves a half-copied pair that looks finished.  A stamp
next to the copy records the source's size, mtime and hash; a later call skips only when the source
is unchanged and the local files still hash to the stamped value (catches a corrupted local copy).

Each source folder stages into a sub-directory of its own, named for the resolved folder and a hash of
its real path (stage_key), never for a folder name alone: two pairs in folders both called `rec`, or
two working directories' `imagenet`, once shared one staged copy, and a running training read the
other run's records. The launcher that staged a pair holds a shared lock on it (READERS_LOCK) while its
training runs; a later staging that would replace that copy is refused, naming it, instead of
swapping the records under the running training.

The node-local directory is private: created owner-only (0700) and refused when it is a symbolic link,
belongs to another user, or sits in a folder another user owns or may write to without the sticky bit
(/tmp itself is fine).  A shared /tmp lets anyone create /tmp/rectrain-<you> first; every file in it
(copies, stamps, the lock) is then created under a unique name without following links and renamed
into place, so nothing planted there is written through.

    python -m rectrain.train.local_copy --rec F/train.rec --idx F/train.idx --local-dir /local/rectrain/demo
"""

from __future__ import annotations

import argparse
import fcntl
import getpass
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rectrain import cli, safefs
from rectrain import log as rlog
from rectrain.atomic import fsync_path, publish

log = logging.getLogger(__name__)

CHUNK = 16 * 1024 * 1024
STAMP_SUFFIX = ".stage.json"
LOCK_NAME = ".stage.lock"
READERS_LOCK = ".stage.readers"  # shared by every process training from the copies; exclusive to replace them
# Reader locks this process holds (local dir -> descriptor), until it exits: the launcher outlives its ranks.
_READERS: dict[str, int] = {}


class StageError(RuntimeError):
    """Staging could not produce a verified local copy; the message says why and what to do."""


def stage_key(rec) -> str:
    """The staging sub-directory of the pair at `rec`: its real folder's name (for people) and a hash
    of that folder's real path (so two folders of one name never share a copy)."""
    real = Path(os.path.realpath(rec)).parent
    return f"{real.name}-{hashlib.sha256(os.fsencode(real)).hexdigest()[:12]}"


def default_local_dir(local_storage: str | None, dataset: str, env=None) -> Path:
    """pack.local_storage, else $TMPDIR (what SLURM sites point at node-local disk), else
    /tmp/rectrain-<user>; one sub-directory per source folder (`dataset`: stage_key) so two never
    collide.  Resolved on the node that trains, since $TMPDIR differs between the submit host and the nodes."""
    env = os.environ if env is None else env
    base = local_storage or env.get("TMPDIR") or f"/tmp/rectrain-{getpass.getuser()}"
    return Path(base) / dataset


def _refuse(path: Path, why: str) -> StageError:
    return StageError(
        f"node-local staging directory {path} {why}; staging refuses it because another user could read or "
        "replace the copy there. Remove it (or ask its owner to), or set pack.local_storage (or $TMPDIR) to a "
        "directory you own"
    )


def private_dir(path) -> Path:
    """Create `path` (and missing parents) owner-only, or check that the existing one is a real directory
    of this user; tighten its mode to 0700.  Raises StageError naming the path, its owner and the fix."""
    return safefs.owned_dir(path, _refuse, 0o700)


def _regular_file(path: Path) -> bool:
    """A regular file, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def sha256_file(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy src to dst (a file just created under a unique name) and return the sha256 of the bytes read
    from src (one pass over the source, which may be on a slow network filesystem)."""
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(os.open(dst, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW), "wb") as fout:
        while chunk := fin.read(CHUNK):
            digest.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return digest.hexdigest()


def _stamp_path(local: Path) -> Path:
    return local.with_name(local.name + STAMP_SUFFIX)


def _source_id(src: Path) -> dict:
    st = src.stat()
    return {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_current(src: Path, local: Path) -> bool:
    """True when `local` is a verified copy of the unchanged `src`."""
    stamp_file = _stamp_path(local)
    if not _regular_file(local) or not _regular_file(stamp_file):
        return False
    try:
        with open(os.open(stamp_file, os.O_RDONLY | os.O_NOFOLLOW)) as fh:
            stamp = json.load(fh)
    except (OSError, ValueError):
        return False
    want = _source_id(src)
    if any(stamp.get(k) != v for k, v in want.items()):
        return False
    if local.stat().st_size != want["size"]:
        return False
    return sha256_file(local) == stamp.get("sha256")


def _stage_file(src: Path, local: Path) -> None:
    """Copy, verify against the source hash, then publish atomically (copy first, stamp last)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{local.name}.", suffix=".part", dir=local.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        source = _source_id(src)
        src_hash = _copy_hashing(src, tmp)
        if _source_id(src) != source:
            raise StageError(
                f"{src} changed while it was being copied to {local}; "
                "wait for the pack step writing it to finish, then start training again"
            )
        local_hash = sha256_file(tmp)
        if local_hash != src_hash:
            raise StageError(
                f"copy of {src} to {tmp} does not match the source (sha256 {local_hash} != "
                f"{src_hash}): the local disk returned different bytes; check it, or set "
                "pack.local_storage to another node-local directory"
            )
        _stamp_path(local).unlink(missing_ok=True)
        publish(tmp, local)  # a rename replaces a planted link; it never writes through it
        _write_stamp(_stamp_path(local), {**source, "sha256": src_hash, "staged": time.time()})
    finally:
        tmp.unlink(missing_ok=True)


def _write_stamp(path: Path, stamp: dict) -> None:
    """Write the stamp under a fresh unique name (mkstemp: O_EXCL, no link followed), then rename it."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with open(fd, "w") as fh:
            json.dump(stamp, fh, indent=1)
        fsync_path(tmp_name)
        publish(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def _check_room(sources: list[Path], local_dir: Path) -> None:
    need = sum(s.stat().st_size for s in sources)
    free = shutil.disk_usage(local_dir).free
    if need > free:
        raise StageError(
            f"node-local staging directory {local_dir} has {free} bytes free but the pair needs "
            f"{need}; free space there, point pack.local_storage at a larger local disk, or set "
            "pack.stage_to_local: false to read the pair from shared storage"
        )


@contextmanager
def _node_lock(local_dir: Path):
    """One stager per node directory; other ranks (and other jobs) block here until it is done."""
    path = local_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise StageError(
            f"cannot open the staging lock {path} ({err.strerror}): a symbolic link there is refused; remove it"
        ) from err
    with open(fd, "r+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _open_readers(local_dir: Path) -> int:
    path = local_dir / READERS_LOCK
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise StageError(
            f"cannot open the staging lock {path} ({err.strerror}): a link there is refused; remove it"
        ) from err


def _no_readers(local_dir: Path, replaced: list[Path]) -> None:
    """StageError when a training (another process) reads the copies in local_dir: replacing them would
    hand it other records mid-run. Called under the stage lock, which every reader takes to join."""
    if str(local_dir) in _READERS:
        return  # this process's own training: it restages before it reads again
    fd = _open_readers(local_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StageError(
            f"{', '.join(map(str, replaced))} would be replaced (its source changed), but a running training on this "
            f"node reads it (lock {local_dir / READERS_LOCK}); wait for it to end, or set pack.local_storage to "
            "another node-local directory"
        ) from None
    finally:
        os.close(fd)


def _hold_readers(local_dir: Path) -> None:
    """Hold a shared lock on local_dir's copies until this process exits (see READERS_LOCK)."""
    if str(local_dir) not in _READERS:
        fd = _open_readers(local_dir)
        fcntl.flock(
            fd, fcntl.LOCK_SH | fcntl.LOCK_NB
        )  # only a stager, under the stage lock we hold, takes it exclusively
        _READERS[str(local_dir)] = fd


def stage_pair(rec, idx, local_dir) -> tuple[Path, Path, bool]:
    """Make a verified copy of the `rec`/`idx` pair in `local_dir`.

    Returns (rec_local, idx_local, copied); copied is False when an identical verified pair was
    already there.  Safe to call from every rank at once.
    """
    sources = [Path(rec), Path(idx)]
    for src in sources:
        if not src.is_file():
            raise StageError(
                f"cannot stage {src}: no such file (run the pack step first, or fix "
                "pack.fast_storage so it points where the pair was written)"
            )
    local_dir = private_dir(local_dir)
    targets = [local_dir / s.name for s in sources]
    copied = False
    with _node_lock(local_dir):
        stale = [(s, t) for s, t in zip(sources, targets, strict=True) if not _is_current(s, t)]
        if stale:
            _no_readers(local_dir, [t for _, t in stale])
            _check_room([s for s, _ in stale], local_dir)
        for src, target in stale:
            started = time.time()
            log.info("copying %s -> %s", src, target)
            _stage_file(src, target)
            took = max(time.time() - started, 1e-9)
            mb = target.stat().st_size / 1e6
            log.info("%s: %.1f MB verified in %.1f s (%.0f MB/s)", target, mb, took, mb / took)
            copied = True
        _hold_readers(local_dir)
    return targets[0], targets[1], copied


# Training's pair options (rectrain.train's CLI); each pair is staged together.
PAIR_OPTIONS = (("--rec", "--idx"), ("--val-rec", "--val-idx"))


def _option_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _replace_option(argv: list[str], name: str, value: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            out.append(value)
            skip = False
        elif arg == name:
            out.append(arg)
            skip = True
        elif arg.startswith(name + "="):
            out.append(f"{name}={value}")
        else:
            out.append(arg)
    return out


def pairs_in(argv: list[str]) -> Iterator[tuple[str, str, str, str]]:
    """(rec option, idx option, rec, idx) of each pair a training command line names."""
    for rec_opt, idx_opt in PAIR_OPTIONS:
        rec, idx = _option_value(argv, rec_opt), _option_value(argv, idx_opt)
        if rec is not None and idx is not None:
            yield rec_opt, idx_opt, rec, idx


def stage_argv(argv: list[str], local_storage: str | None = None, env=None) -> list[str]:
    """Stage every .rec/.idx pair named in a training command line and return the command line
    pointing at the node-local copies.  The dataset name is the pair's directory
    (<fast_storage>/<dataset>/train.rec)."""
    if not logging.getLogger("rectrain").handlers:  # the launcher has not set logging up: tag our lines
        rlog.setup("stage")
    for rec_opt, idx_opt, rec, idx in pairs_in(argv):
        local_dir = default_local_dir(local_storage, stage_key(rec), env)
        rec_l, idx_l, _ = stage_pair(rec, idx, local_dir)
        argv = _replace_option(_replace_option(argv, rec_opt, str(rec_l)), idx_opt, str(idx_l))
    return argv


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--local-dir", required=True)


def _run(args: argparse.Namespace, cfg: None) -> None:
    rec, idx, copied = stage_pair(args.rec, args.idx, args.local_dir)
    print(json.dumps({"rec": str(rec), "idx": str(idx), "copied": copied}))


def main(argv=None) -> int:
    return cli.main("stage", None, _arguments, _run, argv, errors={StageError: 1})


if __name__ == "__main__":
    cli.end(main())
