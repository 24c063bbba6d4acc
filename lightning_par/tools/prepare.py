"""``lightning-par-prepare INPUT... --tokenizer DIR --out FILE``: text corpora to a token file for ``data=tokens``.

Inputs (files, globs or directories, read in sorted order): ``.txt`` (a file is one document),
``.jsonl`` (one JSON object per line, the document in its ``--field``, default ``text``), ``.parquet``
(the ``--field`` column; needs pyarrow: ``pip install 'lightning_par[data]'``) and directories written by
``datasets``' ``save_to_disk`` (``--split`` picks a split of a DatasetDict). A plain directory stands for
the ``.txt``/``.jsonl``/``.parquet`` files under it.

The tokenizer is a local directory (``AutoTokenizer.from_pretrained(DIR)``, no download). Documents are
encoded without special tokens and each is followed by the tokenizer's EOS id. The input is cut into
tasks of about ``--chunk-mb`` of text (byte ranges of a jsonl file cut at newlines, parquet row groups,
row ranges of a dataset), which ``--workers`` processes read and encode in batches (the fast
tokenizer's ``encode_batch_fast``, one thread per process); results are written in input order, so
the output does not depend on the number of workers. ids are stored as uint16 while they fit
(vocabularies of up to 65536 entries), else uint32; the format is ``lightning_par/core/token_format.py``'s.

Everything goes into a hidden temporary file beside ``FILE`` whose header (its magic) is written last;
it is renamed to ``FILE`` only when complete, after the sidecar ``FILE.json`` (vocab_size, eos_id,
tokenizer, n_tokens, sources). An interrupted or failed run removes both; a killed one can leave only
the hidden file, without a valid header. Bad input is one ``error:`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_par import ConfigError
# the format alone (numpy): lightning_par.data would import Lightning and torch, over a second here
from lightning_par.core.token_format import HEADER_BYTES, dtype_for, pack_header

KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class Task:
    """One unit of work: ``kind`` input ``path``, items ``[start, stop)`` (bytes, row groups or rows)."""

    kind: str
    path: str
    start: int
    stop: int
    size: int  # bytes of input, for the progress bar


# ---------------------------------------------------------------------------------- planning
def input_paths(inputs: list[str]) -> list[tuple[str, str]]:
    """(kind, path) of every input, sorted within each argument; ConfigError for one that matches nothing."""
    out = []
    for pattern in inputs:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise ConfigError(f"input {pattern} does not exist (no file matches)")
        for path in matches:
            if os.path.isdir(path):
                if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
                    out.append(("dataset", path))
                    continue
                inner = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                               if os.path.splitext(p)[1] in KINDS and os.path.isfile(p))
                if not inner:
                    raise ConfigError(f"input directory {path} holds no .txt, .jsonl or .parquet file")
                out += [(KINDS[os.path.splitext(p)[1]], p) for p in inner]
            elif os.path.splitext(path)[1] in KINDS:
                out.append((KINDS[os.path.splitext(path)[1]], path))
            else:
                raise ConfigError(f"input {path}: unknown kind (expected .txt, .jsonl, .parquet or a datasets "
                                  "directory)")
    return out


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install 'lightning_par[data]'") from None
    return pq


def load_dataset_dir(path: str, split: str | None, field: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError("reading a datasets directory needs datasets: pip install 'lightning_par[data]'") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 -- any unreadable directory is one line
        raise ConfigError(f"input {path}: not a readable datasets directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise ConfigError(f"input {path}: pick a split with --split (it has {', '.join(ds)})")
        ds = ds[name]
    if field not in ds.column_names:
        raise ConfigError(f"input {path}: no column {field!r} (columns: {', '.join(ds.column_names)}; see --field)")
    return ds


def plan(inputs: list[tuple[str, str]], chunk: int, field: str, split: str | None) -> list[Task]:
    """The tasks, in input order; reads only sizes, parquet footers and newlines near the cuts."""
    tasks = []
    for kind, path in inputs:
        if kind == "txt":
            tasks.append(Task(kind, path, 0, os.path.getsize(path), os.path.getsize(path)))
        elif kind == "jsonl":
            size, cuts = os.path.getsize(path), [0]
            with open(path, "rb") as f:
                while cuts[-1] + chunk < size:
                    f.seek(cuts[-1] + chunk)
                    f.readline()  # to the end of the line the cut falls in
                    cuts.append(min(f.tell(), size))
            cuts.append(size)
            tasks += [Task(kind, path, a, b, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
        elif kind == "parquet":
            meta = _pyarrow_parquet().ParquetFile(path).metadata
            if field not in meta.schema.names:
                raise ConfigError(f"input {path}: no column {field!r} (see --field)")
            tasks += [Task(kind, path, g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
        else:
            ds = load_dataset_dir(path, split, field)
            per_row = max(1, ds.data.nbytes // max(1, ds.num_rows))
            rows = max(1, chunk // per_row)
            tasks += [Task(kind, path, a, min(a + rows, ds.num_rows), per_row * (min(a + rows, ds.num_rows) - a))
                      for a in range(0, ds.num_rows, rows)]
    return tasks


# ---------------------------------------------------------------------------------- the workers
_WORKER: dict[str, Any] = {}  # per process: the tokenizer and the options (set by _init_worker)


def _init_worker(tokenizer: str, fast: bool, eos: int, dtype: str, field: str, split: str | None) -> None:
    # one thread per process: the processes are the parallelism (the library's own threads would oversubscribe)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if fast:  # the serialized backend: workers need only `tokenizers`, not transformers
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer)
        encode = lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        encode = lambda texts: slow(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    _WORKER.update(encode=encode, eos=eos, dtype=np.dtype(dtype), field=field, split=split, datasets={})


def _init_pool_worker(*args: Any) -> None:
    """A pool worker: Ctrl-C is the main process's to handle (it stops the pool; no traceback per worker),
    and the worker ends itself when the main process dies: a SIGKILLed run leaves no worker behind. (It
    would wait forever: each worker holds its task queue's write end too, so the queue never reads EOF,
    and the fork server outlives the main process while any worker holds its liveness pipe.)"""
    import multiprocessing
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()  # its sentinel: a pipe that reads EOF once the main process is gone
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    _init_worker(*args)


def read_texts(task: Task) -> list[str]:
    """The documents of one task."""
    field = _WORKER["field"]
    if task.kind == "txt":
        with open(task.path, "rb") as f:
            data = f.read()
        try:
            return [data.decode("utf-8")]
        except UnicodeDecodeError as e:
            raise ConfigError(f"input {task.path}: not UTF-8 text ({e})") from None
    if task.kind == "jsonl":
        with open(task.path, "rb") as f:
            f.seek(task.start)
            lines = f.read(task.stop - task.start).splitlines()
        texts = []
        for line in lines:
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError, IndexError):
                text = None
            if not isinstance(text, str):
                raise ConfigError(f"input {task.path} (near byte {task.start}): a line without a string "
                                  f"field {field!r}: {line[:60]!r}")
            texts.append(text)
        return texts
    if task.kind == "parquet":
        table = _pyarrow_parquet().ParquetFile(task.path).read_row_group(task.start, columns=[field])
        return [t or "" for t in table.column(field).to_pylist()]
    if task.path not in _WORKER["datasets"]:  # memory-mapped arrow: cheap to keep open
        _WORKER["datasets"][task.path] = load_dataset_dir(task.path, _WORKER["split"], field)
    return [t or "" for t in _WORKER["datasets"][task.path][task.start : task.stop][field]]


def _encode_task(task: Task) -> tuple[np.ndarray, int, int]:
    """(the task's ids with EOS after each document, documents, bytes of text)."""
    texts = read_texts(task)
    flat: list[int] = []
    eos = _WORKER["eos"]
    for ids in _WORKER["encode"](texts):
        flat += ids
        flat.append(eos)
    return np.array(flat, dtype=_WORKER["dtype"]), len(texts), sum(len(t.encode()) for t in texts)


# ---------------------------------------------------------------------------------- the run
def load_tokenizer(path: str) -> Any:
    if not os.path.isdir(path):
        raise ConfigError(f"tokenizer {path} is not a directory (a local tokenizer directory is needed)")
    from lightning_par.core.jobs import quiet_third_party_logs

    quiet_third_party_logs()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("lightning-par-prepare needs transformers: pip install 'lightning_par[hf]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- any unreadable directory is one line
        first = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {first}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {path} has no EOS token (set eos_token in its tokenizer_config.json)")
    return tokenizer


def prepare(inputs: list[str], tokenizer_dir: str, out: str, workers: int = 1, field: str = "text",
            split: str | None = None, chunk_mb: float = 1.0, overwrite: bool = False,
            progress: bool = False) -> dict[str, Any]:
    """Write ``out`` (and ``out.json``); returns the sidecar's contents plus ``seconds``."""
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and not overwrite:
        raise ConfigError(f"output {out} exists (--overwrite replaces it)")
    context = worker_context() if workers > 1 else None  # starts now, while transformers loads here
    tok = load_tokenizer(tokenizer_dir)
    t0 = time.perf_counter()  # throughput from here: loading transformers is a one-time cost, not a rate
    vocab, eos = len(tok), int(tok.eos_token_id)
    dtype = dtype_for(vocab)
    tasks = plan(input_paths(inputs), max(1, int(chunk_mb * 2**20)), field, split)
    if sum(t.size for t in tasks) == 0:
        raise ConfigError(f"empty corpus: {', '.join(inputs)} holds no text")
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.", suffix=".tmp")
    except OSError as e:
        raise ConfigError(f"cannot write to {os.path.dirname(out)}: {e.strerror or e}") from None
    meta_tmp, written = tmp + ".json", []
    init = (tok.backend_tokenizer.to_str(), True) if tok.is_fast else (tokenizer_dir, False)
    initargs = (*init, eos, dtype.str, field, split)
    n_tokens = n_docs = n_bytes = done = 0
    shown = 0.0
    total = sum(t.size for t in tasks)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(HEADER_BYTES))  # zeros: no magic until the end
            for arr, docs, nbytes, task in _results(tasks, workers, initargs, context):
                f.write(memoryview(arr))
                n_tokens, n_docs, n_bytes, done = n_tokens + len(arr), n_docs + docs, n_bytes + nbytes, done + task.size
                if progress and (time.perf_counter() - shown > 0.2 or done == total):
                    shown = time.perf_counter()
                    rate = n_bytes / (time.perf_counter() - t0)
                    print(f"\rprepare: {100 * done / max(total, 1):3.0f}%  {amount(n_bytes)} of text  "
                          f"{amount(rate)}/s", end="", file=sys.stderr, flush=True)
            if progress:
                print(file=sys.stderr)
            if n_bytes == 0:
                raise ConfigError(f"empty corpus: {', '.join(inputs)} holds no text")
            f.seek(0)
            f.write(pack_header(n_tokens, dtype, vocab))
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have given
        meta = dict(format="lightning_par tokens v1", vocab_size=vocab, eos_id=eos, dtype=dtype.name,
                    tokenizer=os.path.abspath(tokenizer_dir), n_tokens=n_tokens, n_documents=n_docs,
                    text_bytes=n_bytes, sources=sorted({os.path.abspath(t.path) for t in tasks}))
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, indent=1)
        # the sidecar first: a FILE that exists is complete and has its sidecar
        os.replace(meta_tmp, out + ".json")
        written.append(out + ".json")
        os.replace(tmp, out)
    except BaseException:  # KeyboardInterrupt too: leave nothing that looks written
        for path in (tmp, meta_tmp, *written):
            if os.path.exists(path):
                os.remove(path)
        raise
    return {**meta, "seconds": time.perf_counter() - t0}


def worker_context() -> Any:
    """Where the workers come from: a fork server started now, in the background, importing only numpy
    and tokenizers -- so workers start in milliseconds once the tokenizer is loaded, and none
    is forked from this process, which has imported transformers and torch (threads). Spawn where there
    is no fork server (Windows)."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # explicit: the default would import __main__ (a test runner, a user's script) into the server; not
    # this module either: a worker of `python -m lightning_par.tools.prepare` runs it as its __main__ (runpy warns
    # when it is already imported), which costs little once numpy and tokenizers are in
    ctx.set_forkserver_preload(["numpy", "tokenizers"])
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return ctx


#: process pools whose workers ``_results`` killed
_ABANDONED: list[Any] = []


def _exit_now_if_abandoned(code: int) -> int:
    """``code``; or, when a pool's workers were killed, end the process with it now. A worker killed while
    writing a result leaves half a message in the pool's pipe; the executor's manager thread then waits
    in ``recv`` for the rest, forever, and the interpreter joins that thread at exit (seen under load
    after Ctrl-C: the command never returned). multiprocessing's exit finalizers run first (they remove
    the pool's semaphores, which the resource tracker would otherwise report as leaked)."""
    if not _ABANDONED:
        return code
    import multiprocessing.util

    sys.stdout.flush()
    sys.stderr.flush()
    multiprocessing.util._run_finalizers(0)  # the positive-priority ones multiprocessing's own exit runs
    os._exit(code)


def _result_of(future: Any, pool: Any, poll_s: float = 0.5) -> Any:
    """``future.result()``, or ``BrokenProcessPool`` as soon as a worker of ``pool`` has died. The executor
    notices a dead worker by itself only between messages: one killed while writing a result leaves half a
    message in the pool's pipe, and the executor's manager thread waits in ``recv`` for the rest, forever,
    with this future never done (seen in the test suite under load: a SIGKILLed worker hung the command).
    The workers live until the pool shuts down, so any exit code means one died."""
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures.process import BrokenProcessPool

    while True:
        try:
            return future.result(timeout=poll_s)
        except FutureTimeout:
            dead = [p.exitcode for p in list((getattr(pool, "_processes", None) or {}).values())
                    if p.exitcode is not None]
            if dead:
                raise BrokenProcessPool(f"a worker died (exit code {dead[0]})") from None


def _results(tasks: list[Task], workers: int, initargs: tuple, context: Any = None):
    """(ids, documents, text bytes, task) per task, in task order."""
    if workers <= 1:  # in this process (no start-up cost), one tokenizer thread as in a worker
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        try:
            _init_worker(*initargs)
            for task in tasks:
                yield (*_encode_task(task), task)
        finally:
            os.environ.pop("TOKENIZERS_PARALLELISM") if saved is None else os.environ.update(
                TOKENIZERS_PARALLELISM=saved)
        return
    # a worker that dies breaks the pool (BrokenProcessPool) instead of hanging it as multiprocessing.Pool would
    pool = ProcessPoolExecutor(workers, mp_context=context or worker_context(), initializer=_init_pool_worker,
                               initargs=initargs)
    try:
        window: deque = deque()  # a bounded number in flight: memory stays flat on any corpus
        it = iter(tasks)
        for task in it:
            window.append((pool.submit(_encode_task, task), task))
            if len(window) >= 4 * workers:
                break
        while window:
            future, task = window.popleft()
            yield (*_result_of(future, pool), task)
            nxt = next(it, None)
            if nxt is not None:
                window.append((pool.submit(_encode_task, nxt), nxt))
    except BaseException:
        # a dead worker, Ctrl-C, a full disk: kill the workers now instead of waiting on them. A worker that
        # died holding one of the pool's queue locks can leave the others (and shutdown(wait=True)) blocked
        # for good; the executor has no public way to kill its processes, hence its private ``_processes``.
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        _ABANDONED.append(pool)  # its manager thread may never end: ``main`` does not wait for it
        raise
    pool.shutdown(wait=True)


def amount(n_bytes: float) -> str:
    """Bytes in the unit that shows them: ``512 B``, ``18.4 KB``, ``3.2 MB``, ``1.1 GB`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:,.1f} {unit}"
    return f"{n_bytes:.0f} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lightning-par-prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help=".txt / .jsonl / .parquet files, globs, directories, datasets dirs")
    ap.add_argument("--tokenizer", required=True, help="a local tokenizer directory")
    ap.add_argument("--out", required=True, help="the token file to write (its sidecar: OUT.json)")
    ap.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="processes")
    ap.add_argument("--field", default="text", help="the jsonl field / parquet or dataset column (default text)")
    ap.add_argument("--split", default=None, help="a DatasetDict's split (default train)")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="MB of input per task (default 1)")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    a = ap.parse_args(argv)
    progress = sys.stderr.isatty() if a.progress is None else a.progress
    try:
        if a.workers < 1 or a.chunk_mb <= 0:
            raise ConfigError(f"--workers={a.workers} must be >= 1 and --chunk-mb={a.chunk_mb} > 0")
        meta = prepare(a.inputs, a.tokenizer, a.out, workers=a.workers, field=a.field, split=a.split,
                       chunk_mb=a.chunk_mb, overwrite=a.overwrite, progress=progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return _exit_now_if_abandoned(2)
    except KeyboardInterrupt:  # Ctrl-C: the workers ignore it, this process stops them and cleans up
        print(f"\nerror: interrupted, nothing written to {a.out}", file=sys.stderr)
        return _exit_now_if_abandoned(130)
    except Exception as e:  # noqa: BLE001 -- a dead worker, a full disk: nothing was left behind
        print(f"error: prepare failed, nothing written to {a.out}: {type(e).__name__}: {e}", file=sys.stderr)
        return _exit_now_if_abandoned(1)
    print(f"wrote {a.out}: {meta['n_tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']}, eos "
          f"{meta['eos_id']}) from {meta['n_documents']:,} documents; {amount(meta['text_bytes'])} of text in "
          f"{meta['seconds']:.2f} s = {amount(meta['text_bytes'] / meta['seconds'])}/s with {a.workers} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
