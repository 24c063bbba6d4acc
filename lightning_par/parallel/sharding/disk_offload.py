"""The disk (NVMe) tier of ZeRO-3 offload (ZeRO-Infinity's tier), on torch and the OS's file mappings.

With ``zero3_offload`` the sharded fp32 parameters, the gradients and the optimizer state live in host
memory (FSDP2's ``CPUOffloadPolicy``). This tier keeps them in files under a directory instead
(``strategy.offload_dir``), so that host memory holds only what the current piece of work touches:

- **Files.** One file per kind and rank -- ``params`` (FSDP's padded sharded parameter data),
  ``grads`` (the sharded gradients), one per optimizer-state key (``exp_avg``, ``exp_avg_sq``, ...) --
  preallocated with ``posix_fallocate`` (a full disk fails there, in one line, before any state is
  written; later writes never need a new block, so a shared mapping never meets ENOSPC as SIGBUS),
  mapped ``MAP_SHARED`` and unlinked at once (the mapping keeps the data; nothing is left behind,
  even by a killed rank). Every tensor is a view of its file's mapping (``Tensor.set_`` onto the
  mapping's storage), so FSDP's all-gather, its gradient accumulation (``grad += new``) and the
  optimizer read and write the file-backed pages in place.
- **Bounded residence.** A touched page of a shared file mapping counts in the process's RSS
  (``RssFile``) until it is unmapped: a plain mapping of everything would be as resident as CPU
  offload after one step. ``madvise(MADV_DONTNEED)`` takes pages out of the process while their data
  stays in the file (the page cache writes dirty pages back; a later touch reads them again). Pages
  are released: after every FSDP unit's pre-forward (its all-gather has copied the shards), after
  each parameter's gradient is accumulated (FSDP2 calls the sharded parameter's
  post-accumulate-grad hooks then: its gradient and its parameter shard are released), and per
  chunk in the optimizer step.
- **Paged optimizer step.** The parameters are cut into chunks of about ``chunk_mb`` of parameter
  bytes; the inner optimizer (torch's AdamW, ...) steps one chunk at a time (only that chunk's
  parameters carry a ``.grad``), while a prefetch thread pages in chunk i+1 (params, grads, state)
  and a release thread writes back and drops chunk i-1. torch's single-tensor optimizers compute
  each parameter apart, so stepping by chunks gives the same bits as one step over all.
- **Optimizer state** created by the optimizer at its first step (AdamW's ``zeros_like``) is moved
  into its file chunk by chunk right after it is made (so at most a chunk of it is ever anonymous
  memory); a state tensor not shaped like its parameter (AdamW's scalar ``step``) stays in memory.
- **Gradients** are the file's views from the start (``.grad`` set once, FSDP2 accumulates into
  it); the step zeroes a chunk's gradients after stepping it, and ``zero_grad`` keeps the views
  (never ``None``). A parameter that got no gradient in a step is not stepped (as torch skips a
  ``None`` gradient). A gradient is a DTensor of its parameter's own spec around the host view, as
  FSDP2 makes one under CPU offload: the shards live on the host whatever device FSDP computes on.
- **On CUDA** (``PinnedStaging``) FSDP2's copies between the files and the device pass through
  page-locked buffers: a shard is copied out of its file into a pinned slot before FSDP2 copies it to
  the device (asynchronously, on FSDP2's stream), and a reduced gradient lands in a pinned buffer
  before FSDP2 adds it into its file view. File pages cannot be page-locked, and a CUDA copy from or
  to pageable memory is synchronous and goes through a driver bounce buffer. On CPU nothing changes.

Why our own and not torch's: torch has no disk tier for FSDP2 or optimizers (DeepSpeed's uses its own
async-I/O library with O_DIRECT). ``torch.UntypedStorage.from_file`` maps a file, but gives no way to
release pages; Python's ``mmap`` does (``madvise``) and ``torch.frombuffer`` turns it into a storage.
FSDP2 has no public way to re-home a sharded parameter: ``FileTier.home_parameters`` points FSDP2's
``_sharded_param_data`` and the DTensor's local tensor at the file (private attributes of torch 2.13;
``tests/test_disk_offload.py`` checks every shard lies in its file after setup and after a resume).

The files are scratch: a run's consistent state on disk is its checkpoint (DCP, ``.metadata``
written last), which this tier's views are saved from and loaded into like any FSDP shard.
"""

from __future__ import annotations

import ctypes
import errno
from collections import OrderedDict
import mmap
import os
import shutil
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_par.core.units import fmt_bytes

#: bytes each tensor's region is aligned to inside a file
_ALIGN = 64
_PAGE = mmap.PAGESIZE


class DiskFullError(OSError):
    """No room at the offload directory for a file of the disk tier (one line)."""


def disk_bytes_needed(params: int, grads: int, optimizer_state: int) -> int:
    """Bytes one rank's files take: its parameter shards, gradients and optimizer state."""
    return params + grads + optimizer_state


def _sizes(needed: int, free: int) -> tuple[str, str]:
    """Both sizes in the unit that fits each (a small model's files and a nearly full disk are KiB or MiB,
    which whole GiB showed as 0.00), exact in bytes too where the rounded ones would read alike."""
    a, b = fmt_bytes(needed), fmt_bytes(free)
    return (a, b) if a != b else (f"{a} ({needed} bytes)", f"{b} ({free} bytes)")


def check_offload_dir(path: str | os.PathLike, needed: int | None = None, key: str = "strategy.offload_dir",
                      what: str = "") -> Path:
    """Make sure ``path`` is a writable directory (created if missing) with ``needed`` bytes free;
    raise ``ValueError`` (one line naming ``key``, the bytes needed and the bytes free) otherwise.
    ``what``: what the bytes are for, said in the line (``2 ranks' files``). Returns the directory."""
    d = Path(os.path.expanduser(str(path)))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key}={path}: cannot create the directory: {e.strerror or e}") from None
    if not d.is_dir():
        raise ValueError(f"{key}={path}: not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"{key}={path}: not writable")
    if needed is not None:
        free = shutil.disk_usage(d).free
        if needed > free:
            need_s, free_s = _sizes(needed, free)
            raise ValueError(f"{key}={path}: the disk tier needs {need_s} there{f' ({what})' if what else ''}, "
                             f"{free_s} are free; free space there or set {key} to a directory with more room")
    return d


class FileArena:
    """One preallocated, unlinked file mapped shared; tensors are views of it (regions packed in order)."""

    def __init__(self, directory: Path, name: str, nbytes: int) -> None:
        self.nbytes = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)  # the mapping keeps the inode: nothing left behind by a killed rank
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    free = shutil.disk_usage(directory).free
                    need_s, free_s = _sizes(self.nbytes, free)
                    full = DiskFullError(f"disk tier: no room for {need_s} of {name} at {directory} "
                                         f"({os.strerror(e.errno)}; {free_s} free)")
                    full.errno = e.errno
                    raise full from None
                raise
            self.map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.storage = torch.frombuffer(self.map, dtype=torch.uint8).untyped_storage()
        self.base = self.storage.data_ptr()
        self.used = 0

    def alloc(self, nbytes: int) -> int:
        """Byte offset of a new region of ``nbytes``."""
        off = -(-self.used // _ALIGN) * _ALIGN
        if off + nbytes > self.nbytes:
            raise RuntimeError(f"disk tier: arena of {self.nbytes} bytes overflows ({off} + {nbytes})")
        self.used = off + nbytes
        return off

    def point(self, t: torch.Tensor, offset: int) -> None:
        """Re-point ``t`` (contiguous) at ``offset`` of the file, keeping its shape (the object stays)."""
        with torch.no_grad():
            t.set_(self.storage, offset // t.element_size(), t.shape, t.stride())

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.base

    def release(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Take the pages of ``[offset, offset + nbytes)`` out of the process (data stays in the file);
        a partly covered page at either end stays mapped."""
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        start = -(-offset // _PAGE) * _PAGE
        end = (offset + nbytes) // _PAGE * _PAGE
        if end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Ask the kernel to read ``[offset, offset + nbytes)`` ahead and map it (touch one byte per page)."""
        start = offset // _PAGE * _PAGE
        end = min(self.nbytes, -(-(offset + nbytes) // _PAGE) * _PAGE)
        if end > start:
            self.map.madvise(mmap.MADV_WILLNEED, start, end - start)
            view = torch.frombuffer(self.map, dtype=torch.uint8, count=end - start, offset=start)
            view[::_PAGE].sum()  # a read per page, in torch (the GIL released)

    def close(self) -> None:
        self.storage = None
        try:
            self.map.close()
        except BufferError:  # views still exported (a tensor outlives the tier): the mapping goes with them
            pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _fsdp_groups(module: nn.Module) -> list[Any]:
    """FSDP2's ``FSDPParamGroup`` of every unit under ``module``, each once (private API of torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    for mod in module.modules():
        if isinstance(mod, FSDPModule):
            group = mod._get_fsdp_state()._fsdp_param_group
            if group is not None and all(group is not g for g in out):
                out.append(group)
    return out


def _fsdp_params(module: nn.Module) -> list[Any]:
    """FSDP2's ``FSDPParam`` objects of every unit under ``module`` (private API of torch 2.13)."""
    return [fp for group in _fsdp_groups(module) for fp in group.fsdp_params]


def _as_grad(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p``'s gradient: for a DTensor parameter, a DTensor of ``p``'s own spec (mesh,
    placements, shape) around ``local`` itself, as FSDP2 makes the sharded gradient
    (``FSDPParam.to_sharded_dtensor``). Not ``DTensor.from_local``: it moves a local tensor to the mesh's
    device type, so on a CUDA mesh the file view became a new CUDA tensor and assigning it as the host
    shard's ``.grad`` raised "attempting to assign a gradient with device type 'cuda' to a tensor with
    device type 'cpu'" (issue 31, item 6)."""
    if not isinstance(p, DTensor):
        return local
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad

    return _from_local_no_grad(local, p._spec)


def _all_reduce_host(t: torch.Tensor, mesh: Any, dim: int, op: Any) -> torch.Tensor:
    """All-reduce the host tensor ``t`` over dimension ``dim`` of ``mesh``; returns the result on the
    host. On a CUDA mesh the collective runs on the device (NCCL takes no CPU tensor); a group of one
    rank needs none."""
    group = mesh.get_group(dim)
    if torch.distributed.get_world_size(group) == 1:
        return t
    if mesh.device_type == "cpu":
        torch.distributed.all_reduce(t, op=op, group=group)
        return t
    device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    on_device = t.to(device)
    torch.distributed.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()


class PinnedStaging:
    """Page-locked buffers that FSDP2's copies between the disk tier's files and a CUDA device pass through.

    - **Host to device.** Before a unit's all-gather FSDP2 copies each shard to the device
      (``FSDPParam.all_gather_inputs``: ``.to(device, non_blocking=True)``). From a file page that copy is
      pageable: synchronous, through a driver bounce buffer. ``to_device`` copies the shard into a
      region of a pinned slot first (this reads its file pages) and makes FSDP2's own call from there,
      so the transfer runs asynchronously on FSDP2's stream. Two slots are filled in turn, each at least
      the largest shard; a slot is refilled only after every copy out of it has finished (an event
      recorded after each).
    - **Device to host.** FSDP2 copies each reduced gradient shard to the host (``foreach_reduce``:
      ``.to("cpu")``, non-blocking only for a first gradient without post-accumulate-grad hooks, so
      always pageable for the disk tier, whose gradients are the file views and carry its hook) and
      adds it into the shard's ``.grad``. ``to_host`` copies it into one pinned region instead and FSDP2
      adds from there. One region suffices: FSDP2 adds each gradient (a host add, done when it returns)
      before it copies the next. ``FileTier.attach`` routes only gradients of units whose gradients are
      all present (FSDP2's accumulating path).

    Why not FSDP2's own pinning: ``CPUOffloadPolicy(pin_memory=True)`` page-locks the shards themselves
    (``FSDPParam.reset_sharded_param``: ``local_tensor.cpu().pin_memory()``), copying every shard out of
    its file into pinned memory held for the whole run -- the host memory the tier exists to save, and
    file pages cannot be page-locked in place. It does not pin a copy of an accumulated gradient either.
    Host memory taken: three buffers of ``slot_bytes`` (``FileTier.attach``: the largest shard).

    ``device_type``/``pin``: the device FSDP computes on, and whether the buffers are page-locked (a
    CPU check of the routing, ``tests/test_disk_offload.py``, uses ``"cpu"`` and False: there the copies
    are synchronous and FSDP2 consumes each before the next, at one rank).
    """

    def __init__(self, slot_bytes: int, device_type: str = "cuda", pin: bool = True, slots: int = 2) -> None:
        self.slot_bytes = max(_ALIGN, -(-int(slot_bytes) // _ALIGN) * _ALIGN)
        self.device_type = device_type
        self.pin = pin
        self._slots: list[torch.Tensor] = []
        self._events: list[list[Any]] = [[] for _ in range(slots)]
        self._slot = 0
        self._used = 0
        self._host: torch.Tensor | None = None
        self.h2d_copies = 0
        self.d2h_copies = 0

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far (at the first copy each way)."""
        return [*self._slots, *([self._host] if self._host is not None else [])]

    @staticmethod
    def _region(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return buf[offset:offset + n].view(like.dtype).view(like.shape)

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() <= self.slot_bytes

    def to_device(self, src: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """``src.to(*args, **kwargs)`` (FSDP2's call) made from a pinned copy of the host tensor ``src``;
        None where ``src`` does not fit a slot (the caller copies it as it is)."""
        if not self._fits(src):
            return None
        if not self._slots:
            self._slots = [self._buffer() for _ in self._events]
        n = src.numel() * src.element_size()
        offset = -(-self._used // _ALIGN) * _ALIGN
        if offset + n > self.slot_bytes:  # the next slot, once the copies out of it are done
            self._slot = (self._slot + 1) % len(self._slots)
            for event in self._events[self._slot]:
                event.synchronize()
            self._events[self._slot].clear()
            offset = 0
        self._used = offset + n
        stage = self._region(self._slots[self._slot], offset, src)
        stage.copy_(src)
        out = stage.to(*args, **kwargs)
        if self.pin:
            event = torch.get_device_module(self.device_type).Event()
            event.record()  # on the stream that copies (FSDP2's current one)
            self._events[self._slot].append(event)
        self.h2d_copies += 1
        return out

    def to_host(self, src: torch.Tensor) -> torch.Tensor | None:
        """``src`` (a device tensor) copied into the pinned host region, the copy finished; None where it
        does not fit. The region is overwritten by the next call."""
        if not self._fits(src):
            return None
        if self._host is None:
            self._host = self._buffer()
        stage = self._region(self._host, 0, src)
        stage.copy_(src)  # a blocking copy: on CUDA it waits for the current stream, which made src
        self.d2h_copies += 1
        return stage

    def close(self) -> None:
        for events in self._events:
            for event in events:
                event.synchronize()
            events.clear()
        self._slots, self._host = [], None


class _StagedCopies(TorchFunctionMode):
    """Active around an FSDP2 unit's ``unshard``/``wait_for_unshard`` (``to_host`` false) or its
    ``post_backward`` (true): routes FSDP2's ``Tensor.to`` of a shard in the ``params`` file to the
    device, or of a gradient from the device to the host, through ``PinnedStaging``; every other call
    runs as it is (a mode is off while its own handler runs, so the handler's copies are not seen)."""

    def __init__(self, staging: PinnedStaging, params: FileArena, to_host: bool) -> None:
        super().__init__()
        self.staging, self.params, self.to_host = staging, params, to_host

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and type(args[0]) is torch.Tensor:
            src = args[0]
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            plain = device is not None and dtype in (None, src.dtype) and memory_format in (None, torch.preserve_format)
            staging = self.staging
            out = None
            if plain and not self.to_host and src.device.type == "cpu" and device.type == staging.device_type \
                    and src.numel() and self.params.holds(src):
                out = staging.to_device(src, args[1:], kwargs)
            elif plain and self.to_host and src.device.type == staging.device_type and device.type == "cpu" \
                    and src.numel():
                out = staging.to_host(src)
            if out is not None:
                return out
        return func(*args, **kwargs)


def fix_mmap_threshold(nbytes: int = 256 * 2**10) -> bool:
    """Serve every allocation of ``nbytes`` or more by its own mapping, returned to the OS when freed
    (glibc's ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold to 32 MB
    after the first large free). Without it the per-unit temporaries of forward and backward (gathered
    parameters, unsharded gradients, a chunk's new optimizer state) come from the heap, whose freed
    pages glibc keeps: measured on gpt2 at one rank, 0.6 GiB more anonymous memory after the first
    backward. Process-wide; the benchmark sets the same threshold (``MALLOC_MMAP_THRESHOLD_``) for every
    row. False where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class FileTier:
    """One rank's disk tier: its files, the parameters', gradients' and optimizer state's views of
    them, and the releases that keep residence bounded. Plain torch; see the module docstring.

    Args:
        directory: where the files go (``check_offload_dir`` first).
        rank: this rank's number (in the file names).
        chunk_mb: parameter bytes per chunk of the paged optimizer step.
    """

    def __init__(self, directory: str | os.PathLike, rank: int = 0, chunk_mb: float = 64.0) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.chunk_bytes = int(chunk_mb * 2**20)
        self.tag = f"lp-disk-{os.getpid()}-rank{rank}"
        fix_mmap_threshold()
        self.arenas: dict[str, FileArena] = {}
        self.param_at: dict[nn.Parameter, int] = {}  # param -> offset in "params" (padded shard) / "grads" (local)
        self.grad_at: dict[nn.Parameter, int] = {}
        self.state_at: dict[tuple[nn.Parameter, str], int] = {}
        self.grad_views: dict[nn.Parameter, torch.Tensor] = {}
        self.params: list[nn.Parameter] = []
        self._hooks: list[Any] = []
        self.dirty: set[nn.Parameter] = set()
        #: FSDP2's copies through page-locked buffers, when FSDP computes on CUDA (``attach``)
        self.staging: PinnedStaging | None = None
        self._wrapped: list[tuple[Any, str]] = []  # (FSDP param group, method) that ``attach`` wrapped

    # --------------------------------------------------------------------------- files
    def _arena(self, kind: str, nbytes: int) -> FileArena:
        if kind not in self.arenas:
            self.arenas[kind] = FileArena(self.directory, f"{self.tag}-{kind}.bin", nbytes)
        return self.arenas[kind]

    @property
    def bytes_on_disk(self) -> int:
        return sum(a.nbytes for a in self.arenas.values())

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for group, name in self._wrapped:
            group.__dict__.pop(name, None)  # FSDP2's own method again
        self._wrapped.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        for a in self.arenas.values():
            a.close()
        self.arenas.clear()

    # ----------------------------------------------------------------------- parameters
    def home_parameters(self, module: nn.Module, copy: bool = False) -> None:
        """Point every FSDP sharded parameter of ``module`` into the ``params`` file (``copy``: keep
        the values it has; else the views start as whatever the file holds -- materialisation fills
        them next). Collective-free; call after ``fully_shard`` and ``to_empty``."""
        fps = [fp for fp in _fsdp_params(module) if not fp._sharded_param_data.is_meta]
        if not fps:
            raise RuntimeError("disk tier: the module has no materialised FSDP parameters")
        sizes = [fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in fps]
        arena = self._arena("params", sum(-(-s // _ALIGN) * _ALIGN for s in sizes))
        for fp, size in zip(fps, sizes):
            data, local = fp._sharded_param_data, fp.sharded_param._local_tensor
            if local.numel() and local.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                raise RuntimeError(f"disk tier: {fp._param_fqn}'s local shard is not a view of its padded data")
            off = arena.alloc(size)
            old = data.clone() if copy else None
            arena.point(data, off)
            if local.numel():
                arena.point(local, off + local.storage_offset() * local.element_size())
            if old is not None:
                data.copy_(old)
            self.param_at[fp.sharded_param] = off
            self.params.append(fp.sharded_param)
        arena.release()

    def check_parameters_homed(self) -> None:
        """Raise unless every parameter's shard is still a view of the file (after a checkpoint load)."""
        arena = self.arenas["params"]
        stray = [tuple(p.shape) for p in self.params if _local(p).numel() and not arena.holds(_local(p))]
        if stray:
            raise RuntimeError(f"disk tier: {len(stray)} parameter shards left their file (shapes {stray[:3]})")

    def attach(self, module: nn.Module, staging: PinnedStaging | None = None) -> None:
        """Release parameter pages after every FSDP unit's pre-forward (its all-gather has copied them);
        before the root's forward, give back the gradient views to parameters whose ``.grad`` someone
        set to None or replaced (Lightning's loop zeroes gradients through ``nn.Module.zero_grad`` too).
        When FSDP computes on CUDA, its copies of the shards and gradients go through page-locked
        buffers (``PinnedStaging``, sized by the largest shard; ``staging``: these buffers instead)."""
        from torch.distributed.fsdp import FSDPModule

        self._hooks.append(module.register_forward_pre_hook(lambda *_: self.restore_gradients()))
        for mod in module.modules():
            if isinstance(mod, FSDPModule):
                self._hooks.append(mod.register_forward_pre_hook(lambda *_: self.release("params")))
        groups = _fsdp_groups(module)
        fps = [fp for g in groups for fp in g.fsdp_params if not fp._sharded_param_data.is_meta]
        if staging is None and any(fp.offload_to_cpu and fp.device.type == "cuda" for fp in fps):
            largest = max(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in fps)
            staging = PinnedStaging(largest, device_type="cuda")
        if staging is not None and "params" in self.arenas:
            self.staging = staging
            for group in groups:
                self._stage(group)

    def _stage(self, group: Any) -> None:
        """Route ``group``'s (an ``FSDPParamGroup``'s) copies through ``self.staging``: its methods that
        make them, wrapped on the instance (FSDP2 calls them as ``group.unshard(...)``, ...)."""
        staging, params = self.staging, self.arenas["params"]

        def wrap(name: str, to_host: bool) -> None:
            original = getattr(group, name)

            def staged(*args: Any, **kwargs: Any) -> Any:
                if to_host and not all(fp.sharded_param.grad is not None for fp in group.fsdp_params
                                        if fp.sharded_param.requires_grad):
                    return original(*args, **kwargs)  # FSDP2 would keep a first gradient: its own copy
                with _StagedCopies(staging, params, to_host):
                    return original(*args, **kwargs)

            setattr(group, name, staged)
            self._wrapped.append((group, name))

        wrap("unshard", False)  # the all-gather's inputs, at more than one rank
        wrap("wait_for_unshard", False)  # at one rank, FSDP2 copies the shards here
        wrap("post_backward", True)  # the reduced gradients to the host

    def release(self, kind: str | None = None) -> None:
        for k, a in self.arenas.items():
            if kind is None or k == kind:
                a.release()

    # ------------------------------------------------------------------------ gradients
    def home_gradients(self) -> None:
        """Give every parameter a zero gradient that is a view of the ``grads`` file, and a hook that
        releases it (and the parameter's shard) once FSDP has accumulated into it."""
        params = [p for p in self.params if p.requires_grad]
        sizes = [_local(p).numel() * _local(p).element_size() for p in params]
        arena = self._arena("grads", sum(-(-s // _ALIGN) * _ALIGN for s in sizes))
        for p, size in zip(params, sizes):
            off = arena.alloc(size)
            local = torch.empty(_local(p).shape, dtype=p.dtype)
            arena.point(local, off)
            local.zero_()
            p.grad = _as_grad(p, local)
            if not arena.holds(_local(p.grad)):
                raise RuntimeError(f"disk tier: the gradient of a parameter of shape {tuple(p.shape)} is not a view "
                                   f"of its file (it is on {_local(p.grad).device})")
            self.grad_at[p] = off
            self.grad_views[p] = p.grad
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        arena.release()

    def restore_gradients(self) -> None:
        """Every parameter's ``.grad`` is its file view again: a ``None`` means zero (the view is
        zeroed if it held a gradient), another tensor is copied into the view."""
        if not self.grad_views:
            return
        with torch.no_grad():
            for p, view in self.grad_views.items():
                g = p.grad
                if g is view:
                    continue
                if g is None:
                    if p in self.dirty:
                        _local(view).zero_()
                        self.dirty.discard(p)
                else:
                    _local(view).copy_(_local(g))
                    self.dirty.add(p)
                p.grad = view
        self.release("grads")

    def _on_grad(self, p: nn.Parameter) -> None:
        self.dirty.add(p)
        for kind, at in (("grads", self.grad_at), ("params", self.param_at)):
            local = _local(p) if kind == "params" else _local(p.grad)
            self.arenas[kind].release(at[p], local.numel() * local.element_size())

    def grads(self) -> dict[nn.Parameter, torch.Tensor]:
        self.restore_gradients()
        return dict(self.grad_views)

    # --------------------------------------------------------------- optimizer state
    def home_state(self, state: dict[nn.Parameter, dict[str, Any]], params: Iterable[nn.Parameter]) -> None:
        """Move the optimizer state of ``params`` that is shaped like its parameter into the files
        (one per state key, preallocated for every parameter when the key first appears)."""
        for p in params:
            for key, v in state.get(p, {}).items():
                if not isinstance(v, torch.Tensor) or (p, key) in self.state_at and self._state_homed(p, key, v):
                    continue
                lv, lp = _local(v), _local(p)
                if lv.shape != lp.shape or lv.dtype != lp.dtype or not lv.is_contiguous():
                    continue  # a scalar step, a quantised state: stays in memory
                kind = f"state_{key}"
                if kind not in self.arenas:
                    self._layout_state(kind)
                arena = self.arenas[kind]
                off = self.state_at[(p, key)]
                values = lv.clone() if lv.numel() else lv
                arena.point(lv, off)
                lv.copy_(values)
                del values

    def _layout_state(self, kind: str) -> None:
        params = [p for p in self.params if p.requires_grad]
        sizes = [_local(p).numel() * _local(p).element_size() for p in params]
        arena = self._arena(kind, sum(-(-s // _ALIGN) * _ALIGN for s in sizes))
        key = kind[len("state_"):]
        for p, size in zip(params, sizes):
            self.state_at[(p, key)] = arena.alloc(size)

    def _state_homed(self, p: nn.Parameter, key: str, v: torch.Tensor) -> bool:
        arena = self.arenas.get(f"state_{key}")
        return arena is not None and (_local(v).numel() == 0 or arena.holds(_local(v)))

    # --------------------------------------------------------------------- chunks
    def chunks(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        out: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            n = _local(p).numel() * _local(p).element_size()
            if out[-1] and size + n > self.chunk_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += n
        return [c for c in out if c]

    def _ranges(self, chunk: Sequence[nn.Parameter], state: dict) -> list[tuple[FileArena, int, int]]:
        out = []
        for p in chunk:
            n = _local(p).numel() * _local(p).element_size()
            if p in self.param_at:
                out.append((self.arenas["params"], self.param_at[p], n))
            if p in self.grad_at:
                out.append((self.arenas["grads"], self.grad_at[p], n))
            for key in state.get(p, {}):
                if (p, key) in self.state_at and f"state_{key}" in self.arenas:
                    out.append((self.arenas[f"state_{key}"], self.state_at[(p, key)], n))
        return out

    def page_in(self, chunk: Sequence[nn.Parameter], state: dict) -> None:
        for arena, off, n in self._ranges(chunk, state):
            arena.prefetch(off, n)

    def page_out(self, chunk: Sequence[nn.Parameter], state: dict) -> None:
        for arena, off, n in self._ranges(chunk, state):
            arena.release(off, n)


class PagedOptimizer(torch.optim.Optimizer):
    """``optimizer`` stepped chunk by chunk over the disk tier's files (see the module docstring).

    It shares the inner optimizer's ``param_groups``, ``state`` and ``defaults`` (the same objects),
    so LR schedulers, ``state_dict`` and torch's distributed state-dict helpers see the inner
    optimizer's; only ``step`` and ``zero_grad`` differ, and it clips gradients chunk by chunk too
    (``clip_grad_norm_``, ``clip_grad_value_``: the strategy routes Lightning's clipping here).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tier: FileTier) -> None:
        self.inner = optimizer
        self.tier = tier
        self._share()
        # hooks registered on this optimizer run once per step (the inner optimizer's run once per chunk)
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lp-disk")
        known = set(tier.params)
        order = [p for g in optimizer.param_groups for p in g["params"]]
        stray = [tuple(p.shape) for p in order if p not in known]
        if stray:
            raise ValueError(f"disk tier: optimizer parameters of shapes {stray[:3]} are not FSDP shards of the module")
        self._chunks = tier.chunks(order)
        tier.home_state(optimizer.state, order)

    def _share(self) -> None:
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    def __repr__(self) -> str:
        return f"PagedOptimizer({self.inner!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self._share()
        order = [p for g in self.param_groups for p in g["params"]]
        self.tier.home_state(self.inner.state, order)
        self.tier.release()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - see the class docstring
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for pre in list(self._optimizer_step_pre_hooks.values()):
            pre(self, (), {})
        tier, state = self.tier, self.inner.state
        grads = tier.grads()
        dirty = set(tier.dirty)
        for p in grads:
            p.grad = None
        try:
            ahead: Future | None = self._pool.submit(tier.page_in, self._chunks[0], state) if self._chunks else None
            behind: Future | None = None
            for i, chunk in enumerate(self._chunks):
                if ahead is not None:
                    ahead.result()
                ahead = self._pool.submit(tier.page_in, self._chunks[i + 1], state) if i + 1 < len(self._chunks) else None
                stepped = [p for p in chunk if p in dirty]
                if stepped:
                    for p in stepped:
                        p.grad = grads[p]
                    self.inner.step()
                    tier.home_state(state, stepped)  # state made by this first step: into its file
                    for p in stepped:
                        grads[p].zero_()
                        p.grad = None
                if behind is not None:
                    behind.result()
                behind = self._pool.submit(tier.page_out, chunk, state)
            for f in (ahead, behind):
                if f is not None:
                    f.result()
        finally:
            for p, g in grads.items():
                p.grad = g
            tier.dirty.clear()
        tier.release()
        for post in list(self._optimizer_step_post_hooks.values()):
            post(self, (), {})
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over the gradient files, a chunk at a time: each chunk's local
        shards reduced (their p-th powers summed, or their maximum), its pages released; one
        all-reduce over the mesh dimensions the gradients are sharded on; then each chunk scaled
        (``clip_grads_with_norm_``) and released. torch's own call reads every gradient page before
        any goes back, so the whole gradient file would become resident. Local tensors, not DTensor
        ops: a rank's chunks hold other parameters than another rank's, so per-chunk collectives
        would pair the wrong partial norms. Gradients without a value this step are zeros and add
        nothing. Returns the total norm (a plain tensor, the same on every rank)."""
        tier = self.tier
        grads = tier.grads()
        dirty = set(tier.dirty)
        inf = norm_type == float("inf")
        acc: dict[tuple, torch.Tensor] = {}  # (mesh, dims it is sharded on) -> sum of |g|^p, or max |g|
        for chunk in self._chunks:
            for p in chunk:
                if p not in dirty:
                    continue
                g = grads[p]
                key = (g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())) \
                    if isinstance(g, DTensor) else (None, ())
                local = _local(g).double()
                part = local.abs().max() if inf and local.numel() else (
                    torch.zeros((), dtype=torch.float64) if inf else local.abs().pow(norm_type).sum())
                acc[key] = torch.maximum(acc[key], part) if inf and key in acc else acc.get(key, 0) + part
            tier.page_out(chunk, {})
        total = torch.zeros((), dtype=torch.float64)
        op = torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM
        for (mesh, dims), part in sorted(acc.items(), key=lambda kv: kv[0][1]):  # the same order on every rank
            for d in dims:
                part = _all_reduce_host(part, mesh, d, op)
            total = torch.maximum(total, part) if inf else total + part
        total = (total if inf else total.pow(1.0 / norm_type)).float()
        for chunk in self._chunks:
            holding = [p for p in chunk if p in dirty]  # torch's function scales their .grad: the file views
            if holding:
                torch.nn.utils.clip_grads_with_norm_(holding, max_norm, total)
            tier.page_out(chunk, {})
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """torch's ``clip_grad_value_`` over the gradient files, a chunk at a time (see ``clip_grad_norm_``)."""
        tier = self.tier
        tier.restore_gradients()
        dirty = set(tier.dirty)
        for chunk in self._chunks:
            holding = [p for p in chunk if p in dirty]  # torch's function reads their .grad: the file views
            if holding:
                torch.nn.utils.clip_grad_value_(holding, clip_value)
            tier.page_out(chunk, {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients that have values (the step zeroes the ones it used); the file views stay."""
        tier = self.tier
        with torch.no_grad():
            for p in list(tier.dirty):
                if p.grad is not None and p.grad is not tier.grad_views.get(p):
                    p.grad = None  # another tensor: gone, as set_to_none asks; the view below is zeroed
                _local(tier.grad_views[p]).zero_()
            tier.dirty.clear()
            for p, view in tier.grad_views.items():
                p.grad = view
        tier.release("grads")

    def initialize_state(self) -> None:
        """Create the optimizer state (a step with zero gradients and lr 0), as a checkpoint template
        needs tensors to load into; nothing when it exists."""
        if self.inner.state:
            return
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        self.tier.dirty.update(p for p in self.tier.params if p.requires_grad)
        try:
            self.step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["DiskFullError", "FileArena", "FileTier", "PagedOptimizer", "PinnedStaging", "check_offload_dir",
           "disk_bytes_needed", "fmt_bytes"]
