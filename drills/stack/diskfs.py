"""Small filesystems that a run mounts for itself (the LMCache L2 directory), and the disk faults on them.

A disk fault must never reach a filesystem kvdrill did not make: ``/`` here is a shared 252 GB disk.
So the run mounts its own: a ``tmpfs`` with ``size=``/``nr_inodes=`` (fast, live-shrinkable), or an ext4
image on a loop device (ext4 semantics: journal, extents, block groups), with the image inside the run
directory. On that filesystem, and only there, this module

* fills it to a percentage, or completely, with filler files it names (``.kvdrill-fill/fill-NNN``) and
  tracks (``posix_fallocate``, then 4 KiB writes for the last blocks);
* exhausts its inodes (empty files in ``.kvdrill-fill/inodes/``);
* shrinks a tmpfs under a running writer (``mount -o remount,size=``; refused below current use);
* makes a directory read-only with a bind mount over itself (``mount --bind D D`` then
  ``mount -o remount,bind,ro D``): every *new* open for writing gets EROFS, also for root.
  **File descriptors opened before keep writing** (the kernel checks the mount at open time), so a
  writer that holds its file open across the fault does not see it until it opens the next one;
  LMCache's fs L2 opens a new ``<name>.tmp`` for every chunk it stores, so it does.

(shared/facts/network-disk-process-faults.md §5 has the measurements behind each of these.)

Ownership is checked before every change, from another process too: a tmpfs is mounted with the source
name ``kvdrill-<id>``, and an ext4 lives on the loop device whose backing file is the run's image, so
``/proc/mounts`` (and ``/sys/block/loop*/loop/backing_file``) say whether what is mounted at the
mountpoint is this filesystem. Nothing is filled, remounted or unmounted otherwise.

:meth:`RunFilesystem.plan` decides names without touching anything, so the caller can journal
:meth:`RunFilesystem.as_dict` first; :func:`undo` takes that dict back and tears everything down
(for ``kvdrill rollback``). :meth:`RunFilesystem.destroy` is idempotent and says what it undid.
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

SOURCE_PREFIX = "kvdrill-"
FILL_DIR = ".kvdrill-fill"
KINDS = ("tmpfs", "ext4")
MIN_EXT4_BYTES = 4 << 20
# an ext4 image is sparse, but filling the loop filesystem writes into it: the directory holding the image
# must keep this much free beyond the image's full size, or filling the run's disk would fill the host's
HOST_HEADROOM_BYTES = 1 << 30
_BLOCK = 4096


class DiskFsError(RuntimeError):
    """A run filesystem could not be created, changed or removed; the message says what to change."""


# --- what is mounted ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MountEntry:
    source: str
    target: str
    fstype: str
    options: tuple[str, ...]

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def _unescape(field_text: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(field_text):
        if field_text[i] == "\\" and field_text[i + 1:i + 4].isdigit() and len(field_text[i + 1:i + 4]) == 3:
            out.append(chr(int(field_text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


def mounts(text: str | None = None) -> list[MountEntry]:
    """Every entry of ``/proc/self/mounts``, in mount order (a later entry on the same target is on top)."""
    if text is None:
        text = Path("/proc/self/mounts").read_text()
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        entries.append(MountEntry(_unescape(parts[0]), _unescape(parts[1]), parts[2], tuple(parts[3].split(","))))
    return entries


def entries_at(target: Path | str) -> list[MountEntry]:
    target = str(target)
    return [m for m in mounts() if m.target == target]


def loop_backing_file(device: str) -> str | None:
    """The file behind ``/dev/loopN`` (None when the device is not attached)."""
    try:
        text = Path("/sys/block", Path(device).name, "loop", "backing_file").read_text().strip()
    except OSError:
        return None
    return text.removesuffix(" (deleted)") or None


def loops_backed_by(image: Path | str) -> list[str]:
    image = str(image)
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip().removesuffix(" (deleted)")
        except OSError:
            continue
        if name == image:
            found.append(f"/dev/{backing.parent.parent.name}")
    return sorted(found)


def detach_loop(device: str, image: str, timeout: float = 5.0) -> bool:
    """``losetup -d`` and wait until the device no longer shows ``image``: a device someone still has open
    (udev probing it right after the unmount) is only marked for auto-clear and detaches a moment later."""
    deadline = time.monotonic() + timeout
    while loop_backing_file(device) == image:
        _run("losetup", "-d", device, check=False)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise DiskFsError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_owned_path(path: Path | str, owned_root: Path | str, what: str = "a filesystem") -> tuple[Path, Path]:
    """Both paths resolved; raises unless ``path`` lies strictly inside ``owned_root``, the directory the
    caller says the run owns."""
    root = Path(owned_root).resolve()
    target = Path(path).resolve()
    if root == Path("/") or len(root.parts) < 3:
        raise DiskFsError(f"refusing to use {root} as the run's own directory: it is a system directory; pass the "
                          f"run directory (e.g. runs/<id>) as owned_root")
    if target == root or root not in target.parents:
        raise DiskFsError(f"refusing to put {what} at {target}: it is not inside {root}, the directory this run "
                          f"owns; choose a path under it (e.g. {root}/stack/l2fs)")
    return target, root


# --- usage ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Usage:
    total_bytes: int
    used_bytes: int
    free_bytes: int  # what an unprivileged writer can still allocate (f_bavail)
    inodes_total: int
    inodes_free: int
    block_size: int

    @property
    def used_percent(self) -> float:
        return 100.0 * self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "used_percent": round(self.used_percent, 2)}


def usage_of(path: Path | str) -> Usage:
    st = os.statvfs(path)
    return Usage(total_bytes=st.f_blocks * st.f_frsize, used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
                 free_bytes=st.f_bavail * st.f_frsize, inodes_total=st.f_files, inodes_free=st.f_ffree,
                 block_size=st.f_frsize)


# --- the filesystem -------------------------------------------------------------------------------------

@dataclass
class RunFilesystem:
    """A tmpfs or loop-ext4 the run mounted at ``mountpoint`` (inside ``owned_root``)."""

    kind: Literal["tmpfs", "ext4"]
    mountpoint: Path
    owned_root: Path
    size_bytes: int
    fs_id: str
    inodes: int | None = None
    image: Path | None = None
    loop_device: str | None = None
    dev: int | None = None  # st_dev of the mounted filesystem
    created_dir: bool = False
    current_size: int | None = None  # after shrink_to
    fillers: list[str] = field(default_factory=list)
    readonly_binds: list[str] = field(default_factory=list)
    # "bind": read-only is a bind over the target on the host. "remount": the whole filesystem is remounted
    # read-only, for a filesystem a container holds its own bind of (a host bind never reaches that mount
    # namespace; the superblock's flag does, as when a real disk goes read-only)
    readonly_by: Literal["bind", "remount"] = "bind"

    # --- lifecycle ---------------------------------------------------------------------------------------

    @classmethod
    def plan(cls, kind: str, size_bytes: int, path: Path | str, owned_root: Path | str, inodes: int | None = None,
             image: Path | str | None = None) -> RunFilesystem:
        """Names and checks only; nothing is created (journal :meth:`as_dict`, then :meth:`mount`)."""
        if kind not in KINDS:
            raise DiskFsError(f"unknown filesystem kind {kind!r}; use one of {', '.join(KINDS)}")
        mountpoint, root = check_owned_path(path, owned_root)
        size_bytes = int(size_bytes)
        if size_bytes < _BLOCK:
            raise DiskFsError(f"a {kind} of {size_bytes} bytes is too small; give at least {_BLOCK} bytes")
        if inodes is not None and inodes < 4:
            raise DiskFsError(f"inodes={inodes} is too few for a usable filesystem; give at least 4")
        fs_id = f"{SOURCE_PREFIX}{secrets.token_hex(4)}"
        img = None
        if kind == "ext4":
            if size_bytes < MIN_EXT4_BYTES:
                raise DiskFsError(f"an ext4 image of {size_bytes} bytes is too small; give at least {MIN_EXT4_BYTES}")
            img, _ = check_owned_path(image or mountpoint.parent / f".{mountpoint.name}.{fs_id}.img", root,
                                      "the ext4 image")
            if inside(img, mountpoint):
                raise DiskFsError(f"the ext4 image {img} cannot live inside its own mountpoint {mountpoint}")
            if img.exists():
                raise DiskFsError(f"{img} already exists; refusing to overwrite it (destroy deletes the image)")
        return cls(kind=kind, mountpoint=mountpoint, owned_root=root, size_bytes=size_bytes, fs_id=fs_id,
                   inodes=inodes, image=img)

    @classmethod
    def create(cls, kind: str, size_bytes: int, path: Path | str, owned_root: Path | str, inodes: int | None = None,
               image: Path | str | None = None) -> RunFilesystem:
        fs = cls.plan(kind, size_bytes, path, owned_root, inodes=inodes, image=image)
        fs.mount()
        return fs

    def mount(self) -> None:
        """Create the mountpoint directory (if missing) and mount; on failure everything is undone."""
        if os.geteuid() != 0:
            raise DiskFsError("mounting a run filesystem needs root (CAP_SYS_ADMIN); run kvdrill as root")
        mp = self.mountpoint
        if entries_at(mp):
            raise DiskFsError(f"{mp} is already a mountpoint; refusing to mount over it")
        if mp.exists() and (not mp.is_dir() or any(mp.iterdir())):
            raise DiskFsError(f"{mp} exists and is not an empty directory; refusing to hide its contents")
        if self.kind == "ext4":
            self._check_ext4_image()
        try:
            if not mp.exists():
                mp.mkdir(parents=True)
                self.created_dir = True
            if self.kind == "tmpfs":
                opts = f"size={self.size_bytes},mode=0755" + (f",nr_inodes={self.inodes}" if self.inodes else "")
                _run("mount", "-t", "tmpfs", "-o", opts, self.fs_id, str(mp))
            else:
                self._mount_ext4()
            self.dev = os.stat(mp).st_dev
            self.current_size = self.size_bytes
            self.check_owned()
        except BaseException:
            self.destroy()
            raise

    def _check_ext4_image(self) -> None:
        assert self.image is not None
        if shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
            raise DiskFsError("mkfs.ext4 or losetup is missing: install e2fsprogs and mount (kvdrill setup does)")
        if self.image.exists():
            raise DiskFsError(f"{self.image} already exists; refusing to overwrite it")
        host = os.statvfs(self.image.parent if self.image.parent.exists() else self.owned_root)
        if host.f_bavail * host.f_frsize < self.size_bytes + HOST_HEADROOM_BYTES:
            raise DiskFsError(f"{self.image.parent} has {host.f_bavail * host.f_frsize} bytes free, less than the "
                              f"image ({self.size_bytes}) plus {HOST_HEADROOM_BYTES} headroom: filling the run's "
                              "ext4 could fill the host's disk; use kind tmpfs or a smaller size")

    def _mount_ext4(self) -> None:
        assert self.image is not None
        self.image.parent.mkdir(parents=True, exist_ok=True)
        with open(self.image, "xb") as f:
            f.truncate(self.size_bytes)  # sparse
        mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", self.fs_id[:16]]
        if self.inodes:
            mkfs += ["-N", str(self.inodes)]
        _run(*mkfs, str(self.image))
        self.loop_device = _run("losetup", "--find", "--show", str(self.image)).stdout.strip()
        _run("mount", "-t", "ext4", self.loop_device, str(self.mountpoint))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("mountpoint", "owned_root", "image"):
            d[key] = None if d[key] is None else str(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunFilesystem:
        d = dict(d)
        for key in ("mountpoint", "owned_root", "image"):
            d[key] = None if d.get(key) is None else Path(d[key])
        return cls(**d)

    # --- ownership ---------------------------------------------------------------------------------------

    def _ours(self, entry: MountEntry) -> bool:
        if self.kind == "tmpfs":
            return entry.source == self.fs_id and entry.fstype == "tmpfs"
        return entry.fstype == "ext4" and entry.source.startswith("/dev/loop") and self.image is not None and \
            loop_backing_file(entry.source) == str(self.image)

    def our_entries(self) -> list[MountEntry]:
        """Mounts of this filesystem at or under the mountpoint (the fs itself, read-only binds)."""
        mp = self.mountpoint
        return [m for m in mounts() if self._ours(m) and inside(Path(m.target), mp)]

    def is_mounted(self) -> bool:
        return any(m.target == str(self.mountpoint) for m in self.our_entries())

    def check_owned(self) -> None:
        """Raise unless what is mounted at the mountpoint is this filesystem (by /proc/mounts and st_dev)."""
        at = entries_at(self.mountpoint)
        if not at:
            raise DiskFsError(f"nothing is mounted at {self.mountpoint}: the run filesystem {self.fs_id} is gone")
        if not self._ours(at[-1]):
            raise DiskFsError(f"{self.mountpoint} holds {at[-1].source} ({at[-1].fstype}), not the run filesystem "
                              f"{self.fs_id}; refusing to touch it")
        if self.dev is not None and os.stat(self.mountpoint).st_dev != self.dev:
            raise DiskFsError(f"{self.mountpoint} has device {os.stat(self.mountpoint).st_dev}, not {self.dev} as "
                              f"when {self.fs_id} was mounted; refusing to touch it")

    # --- measurements ------------------------------------------------------------------------------------

    def usage(self) -> Usage:
        self.check_owned()
        return usage_of(self.mountpoint)

    # --- faults ------------------------------------------------------------------------------------------

    def _fill_dir(self) -> Path:
        d = self.mountpoint / FILL_DIR
        d.mkdir(exist_ok=True)
        return d

    def _new_filler(self, directory: Path, stem: str) -> Path:
        n = len([f for f in self.fillers if Path(f).name.startswith(stem)])
        while (directory / f"{stem}-{n:03d}").exists():
            n += 1
        path = directory / f"{stem}-{n:03d}"
        self.fillers.append(str(path))
        return path

    def fill(self, percent: float | None = None, *, full: bool = False) -> dict[str, Any]:
        """Add a filler file until ``percent`` of the filesystem is used, or until no block is left
        (``full``). Returns the usage before and after and the bytes added."""
        if (percent is None) == (not full):
            raise DiskFsError("fill needs either percent or full=True")
        if percent is not None and not 0 < percent <= 100:
            raise DiskFsError(f"fill percent must be in (0, 100], got {percent}")
        self.check_owned()
        before = usage_of(self.mountpoint)
        if full:
            want = before.free_bytes // _BLOCK * _BLOCK
        else:
            missing = math.ceil(before.total_bytes * percent / 100) - before.used_bytes
            want = math.ceil(missing / _BLOCK) * _BLOCK
        if want <= 0 and not full:
            return {"filler": None, "bytes_added": 0, "before": before.as_dict(), "after": before.as_dict()}
        path = self._new_filler(self._fill_dir(), "fill")
        added = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            chunk = max(int(want), _BLOCK)
            while added < want and chunk >= _BLOCK:
                n = min(chunk, int(want) - added)
                try:
                    os.posix_fallocate(fd, added, n)
                    added += n
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    chunk = n // 2 // _BLOCK * _BLOCK  # ext4 needs blocks for the extent tree too: back off
            if full:
                os.lseek(fd, added, os.SEEK_SET)
                zeros = bytes(before.block_size)  # ext4 this small has 1 KiB blocks
                for _ in range(4096):  # the last blocks fallocate could not take; bounded
                    try:
                        added += os.write(fd, zeros)
                    except OSError as exc:
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            break
                        raise
        finally:
            os.close(fd)
        return {"filler": str(path), "bytes_added": added, "before": before.as_dict(),
                "after": usage_of(self.mountpoint).as_dict()}

    def fill_inodes(self, limit: int = 200_000) -> dict[str, Any]:
        """Create empty files until the filesystem has no inode left (ENOSPC on create with blocks free)."""
        self.check_owned()
        before = usage_of(self.mountpoint)
        if before.inodes_free > limit:
            raise DiskFsError(f"{self.fs_id} has {before.inodes_free} free inodes, more than {limit} empty files "
                              "kvdrill will create; give the filesystem an inode limit (inodes=)")
        d = self._fill_dir() / "inodes"
        d.mkdir(exist_ok=True)
        self.fillers.append(str(d))
        created = 0
        for i in range(before.inodes_free + 16):
            try:
                os.close(os.open(d / f"i{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                created += 1
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    break
                raise
        return {"filler": str(d), "files_created": created, "before": before.as_dict(),
                "after": usage_of(self.mountpoint).as_dict()}

    def remove_fillers(self) -> list[str]:
        """Delete every filler (tracked or left in ``.kvdrill-fill`` by another process); returns them."""
        removed = []
        if not self.is_mounted():
            self.fillers.clear()
            return removed
        self.check_owned()
        d = self.mountpoint / FILL_DIR
        for name in list(self.fillers):
            p = Path(name)
            if not inside(p, d):
                continue  # only ever inside the fill directory
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=False)
                removed.append(str(p))
            elif p.exists():
                p.unlink()
                removed.append(str(p))
        if d.is_dir():
            for p in sorted(d.iterdir()):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(str(p))
            d.rmdir()
        self.fillers.clear()
        return removed

    def shrink_to(self, size_bytes: int) -> dict[str, Any]:
        """Shrink a live tmpfs (``remount,size=``): writers get ENOSPC once the new size is used."""
        if self.kind != "tmpfs":
            raise DiskFsError(f"only a tmpfs can shrink while mounted; {self.fs_id} is {self.kind} (ext4 cannot shrink "
                              "online): use fill instead, or make the stack's L2 filesystem a tmpfs")
        self.check_owned()
        before = usage_of(self.mountpoint)
        if size_bytes < before.used_bytes:
            raise DiskFsError(f"cannot shrink {self.fs_id} to {size_bytes} bytes: {before.used_bytes} are in use "
                              "(the kernel refuses to shrink a tmpfs below its use); give a larger size")
        self._remount_size(size_bytes)
        self.current_size = size_bytes
        return {"size_before": before.total_bytes, "size_after": usage_of(self.mountpoint).total_bytes,
                "before": before.as_dict(), "after": usage_of(self.mountpoint).as_dict()}

    def restore_size(self) -> dict[str, Any] | None:
        """Back to the size it was created with; None when it already is."""
        if self.kind != "tmpfs" or not self.is_mounted():
            return None
        self.check_owned()
        size_now = usage_of(self.mountpoint).total_bytes
        if size_now >= self.size_bytes:
            self.current_size = self.size_bytes
            return None
        self._remount_size(self.size_bytes)
        self.current_size = self.size_bytes
        return {"size_before": size_now, "size_after": usage_of(self.mountpoint).total_bytes}

    def _remount_size(self, size_bytes: int) -> None:
        base = [m for m in entries_at(self.mountpoint) if self._ours(m)]
        if len(base) != 1:
            raise DiskFsError(f"{self.mountpoint} has {len(base)} mounts of {self.fs_id} (a read-only bind on top?); "
                              "make it writable before resizing")
        _run("mount", "-o", f"remount,size={size_bytes}", str(self.mountpoint))

    def make_readonly(self, path: Path | str | None = None) -> dict[str, Any]:
        """Bind ``path`` (default: the mountpoint) over itself read-only: new opens for writing get EROFS, and
        file descriptors opened before keep writing. With ``readonly_by: remount`` the whole filesystem is
        remounted read-only instead, which the kernel refuses (DiskFsError, "busy") while any file on it is
        open for writing: the fault then says it could not land rather than landing halfway."""
        self.check_owned()
        target = Path(path).resolve() if path is not None else self.mountpoint
        if not inside(target, self.mountpoint):
            raise DiskFsError(f"{target} is not on the run filesystem {self.fs_id} at {self.mountpoint}")
        if self._bind_on(target) is not None:
            return {"target": str(target), "already": True}
        if self.readonly_by == "remount" and target != self.mountpoint:
            raise DiskFsError(f"{self.fs_id} is shared with a container: only its whole filesystem ({self.mountpoint}) "
                              f"can turn read-only, not {target}")
        if str(target) not in self.readonly_binds:
            self.readonly_binds.append(str(target))
        if self.readonly_by == "remount":
            _run("mount", "-o", "remount,ro", str(target))
            return {"target": str(target), "already": False, "by": "remount"}
        _run("mount", "--bind", str(target), str(target))
        try:
            _run("mount", "-o", "remount,bind,ro", str(target))
        except DiskFsError:
            _run("umount", str(target), check=False)
            raise
        return {"target": str(target), "already": False}

    def _bind_on(self, target: Path) -> MountEntry | None:
        """The read-only bind of this filesystem on top of ``target``, if there is one."""
        ours = [m for m in entries_at(target) if self._ours(m)]
        if not ours:
            return None
        if self.readonly_by == "remount":
            return ours[-1] if target == self.mountpoint and ours[-1].readonly else None
        base_count = 1 if target == self.mountpoint else 0
        return ours[-1] if len(ours) > base_count and ours[-1].readonly else None

    def make_writable(self, path: Path | str | None = None) -> list[str]:
        """Remove the read-only binds (all of them, or the one at ``path``), or remount the filesystem
        read-write (``readonly_by: remount``); returns the targets made writable."""
        targets = [str(Path(path).resolve())] if path is not None else list(self.readonly_binds)
        done = []
        for t in targets:
            while self._bind_on(Path(t)) is not None:
                _run(*(("mount", "-o", "remount,rw") if self.readonly_by == "remount" else ("umount",)), t)
                done.append(t)
            if t in self.readonly_binds:
                self.readonly_binds.remove(t)
        return done

    def destroy(self) -> dict[str, list[str]]:
        """Remove fillers, read-only binds, the filesystem, its loop device, its image and the mountpoint
        directory it created. Idempotent; returns ``{"undone": [...], "already_gone": [...]}``."""
        undone: list[str] = []
        gone: list[str] = []
        ours = self.our_entries()
        if not ours:
            gone.append(f"{self.fs_id} not mounted at {self.mountpoint}")
        # deepest first; on one target the last mounted (a bind on top) first
        order = sorted(enumerate(ours), key=lambda im: (len(Path(im[1].target).parts), im[0]), reverse=True)
        for _, entry in order:
            top = entries_at(entry.target)
            if not top or not self._ours(top[-1]):
                gone.append(f"left {entry.target}: {top[-1].source if top else 'nothing'} is mounted on top, not "
                            f"{self.fs_id}")
                continue
            proc = _run("umount", entry.target, check=False)
            if proc.returncode != 0:
                busy = proc.stderr.strip()
                _run("umount", "-l", entry.target)
                undone.append(f"lazily unmounted {entry.target} ({busy}: a process still has files open there)")
            else:
                undone.append(f"unmounted {entry.target} ({entry.source}{', ro bind' if entry.readonly else ''})")
        self.readonly_binds.clear()
        self.fillers.clear()
        if self.kind == "ext4" and self.image is not None:
            for dev in loops_backed_by(self.image):
                if detach_loop(dev, str(self.image)):
                    undone.append(f"detached {dev}")
                else:
                    gone.append(f"{dev} still attached to {self.image} (in use); the kernel detaches it when freed")
            # a loop still busy (lazy unmount) is detached by the kernel once the last user closes it
            if self.image.exists():
                self.image.unlink()
                undone.append(f"deleted image {self.image}")
            else:
                gone.append(f"image {self.image} already deleted")
        if self.created_dir and self.mountpoint.is_dir() and not entries_at(self.mountpoint):
            try:
                self.mountpoint.rmdir()
                undone.append(f"removed directory {self.mountpoint}")
            except OSError as exc:
                gone.append(f"left directory {self.mountpoint} ({exc.strerror})")
        return {"undone": undone, "already_gone": gone}


def undo(record: dict[str, Any]) -> dict[str, list[str]]:
    """Tear down a run filesystem from the dict :meth:`RunFilesystem.as_dict` gave (journaled before it was
    mounted), from any process. Only mounts that are provably this filesystem are touched."""
    return RunFilesystem.from_dict(record).destroy()


def wait_unmounted(path: Path | str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while entries_at(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not entries_at(path)
