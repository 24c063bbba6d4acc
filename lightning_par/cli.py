"""The ``lightning-par`` command (also ``python -m lightning_par`` and ``python run.py``): one Hydra app
over the configs shipped in the package (``lightning_par/conf``, searched as ``pkg://lightning_par.conf``).

    lightning-par                                        # small GPT on stdlib text, one device
    lightning-par strategy=ddp trainer.devices=2         # 2 processes (gloo on CPU, NCCL on GPU)
    lightning-par -m strategy=single,ddp trainer.devices=2   # sweep: one output dir per job
    lightning-par mode=estimate model=gpt2_xl trainer.devices=64   # memory table, no training
    lightning-par mode=find_batch_size strategy=zero3 trainer.devices=2 find_batch_size.max_memory_gb=1
    lightning-par 'hydra.searchpath=[file:///my/conf]' logger=my_logger   # configs of your own
    torchrun --nproc-per-node=2 --max-restarts=3 -m lightning_par strategy=ddp callbacks=checkpoint ckpt_path=auto

Every run writes summary.json (see README) into its Hydra output directory; a failed job writes
error.json there instead (``lightning_par/core/jobs.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import logging
import warnings
from collections.abc import Iterable
from pathlib import Path

import hydra
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_par import ConfigError

CONFIG_PATH = "pkg://lightning_par.conf"
CONFIG_NAME = "config"


class JobFailed(CompactHydraException):
    """Hands a failed sweep job back to Hydra. Hydra's launcher only records ``Exception``s as failed
    jobs (a ``BaseException`` such as torch's ``CheckpointException`` would end the whole sweep), and a
    ``CompactHydraException`` is printed as its one-line message at the end of the sweep, not as a traceback."""


# ---------------------------------------------------------------------------------------------------
# checks before Hydra starts


def _hydra_args(argv: list[str]):
    """The command line as Hydra's own parser reads it; None where it cannot (Hydra then says why)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]  # argparse would print usage and exit
    try:
        return parser.parse_args(argv)
    except ValueError:
        return None


def _config_loader(args):
    """Hydra's config loader over the search path Hydra will use: the package's configs,
    ``--config-dir``/``--config-path``, search-path plugins and ConfigStore entries."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import compute_search_path_dir, create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path(compute_search_path_dir(None, __name__, args.config_path or CONFIG_PATH))
    if args.config_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(args.config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path)


def _searchpath_overrides(args) -> list[str]:
    return [o for o in args.overrides if o.lstrip("+~").startswith("hydra.searchpath=")]


def _option_lister(args):
    """``group -> available config names``, over Hydra's search path (``_config_loader``) and every
    ``hydra.searchpath`` entry (command line or primary config)."""
    loader = _config_loader(args)
    searchpath_overrides = _searchpath_overrides(args)
    config_name = args.config_name or CONFIG_NAME
    cache: dict[str, list[str]] = {}

    def options(group: str) -> list[str]:
        if group not in cache:
            with warnings.catch_warnings():  # a missing search-path entry: Hydra warns about it itself
                warnings.simplefilter("ignore")
                cache[group] = sorted(loader.get_group_options(group, config_name=config_name,
                                                               overrides=searchpath_overrides))
        return cache[group]

    return options


def sweep_safe_overrides(argv: list[str]) -> list[str]:
    """``argv`` with each plain override of a key inside a swept group (``-m strategy=zero3,fsdp
    strategy.param_dtype=bf16``) made ``++``, once every config of the sweep is known to have that key.

    Hydra composes a multirun's base config with the groups' defaults before it expands the sweep, so
    a key that the default config lacks (``single`` has no ``param_dtype``) failed as "Key
    'param_dtype' is not in struct" though every swept config has it. A key that some swept config
    lacks is a ``ConfigError`` naming that config (a ``++`` would hand it an option it does not take).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException
    from hydra.types import RunMode

    if not any(a.startswith("-m") or a == "--multirun" for a in argv):
        return argv
    args = _hydra_args(argv)
    if args is None:
        return argv
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:  # Hydra reports it itself
        return argv
    options = _option_lister(args)
    swept = {o.key_or_group: list(o.sweep_string_iterator()) for o in overrides
             if o.is_choice_sweep() and o.package is None and options(o.key_or_group)}
    plain = [o for o in overrides if o.type == OverrideType.CHANGE and not o.is_sweep_override()
             and o.key_or_group.split(".")[0] in swept and "." in o.key_or_group]
    if not plain:
        return argv
    loader, config_name, searchpath = _config_loader(args), args.config_name or CONFIG_NAME, _searchpath_overrides(args)
    rewrite = {}
    for o in plain:
        group, key = o.key_or_group.split(".", 1)
        for name in swept[group]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = loader.load_configuration(config_name, [f"{group}={name}", *searchpath], run_mode=RunMode.RUN)
            if OmegaConf.select(cfg[group], key, default=_MISSING) is _MISSING:
                raise ConfigError(f"{o.key_or_group}: {group}={name} has no option {key!r} "
                                  f"(swept: {', '.join(swept[group])}); sweep only configs that have it")
        rewrite[o.input_line] = f"++{o.input_line}"
    return [rewrite.get(a, a) for a in argv]


_MISSING = object()


def _choices(override) -> Iterable[str]:
    """The config names an override selects: one, or each of a sweep's (``a,b``, ``choice(a,b)``)."""
    if override.is_delete():
        return []
    if override.is_choice_sweep() or override.is_range_sweep():
        return list(override.sweep_string_iterator())
    if override.is_sweep_override() or override.value() is None:  # glob()/interval(): not names; null
        return []
    if isinstance(override.value(), list):  # several configs of one group: logger=[csv,tensorboard]
        return [str(v) for v in override.value()]
    return [override.get_value_element_as_str()]


def _parsed_overrides(argv: list[str]):
    """(Hydra's args, the parsed overrides, the group-options lister) of a command line to check; None
    for --help/--info and for what Hydra cannot parse (Hydra then says why itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = _hydra_args(argv)
    if args is None or args.help or args.hydra_help or args.info or args.shell_completion:
        return None
    try:
        return args, OverridesParser.create().parse_overrides(args.overrides), _option_lister(args)
    except HydraException:
        return None


def check_group_choices(argv: list[str]) -> None:
    """Reject an unknown config name (``strategy=zer3``) in one line, listing the choices from every
    search path, before Hydra composes anything; a sweep (``strategy=ddp,zero1``) is checked value by value.
    Command lines Hydra cannot parse are left to Hydra, which reports them itself."""
    from hydra.errors import HydraException

    parsed = _parsed_overrides(argv)
    if parsed is None:
        return
    _, overrides, options = parsed
    try:
        for o in overrides:
            names = _choices(o)
            known = options(o.key_or_group) if names else []
            if not known:  # not a config group (a field such as trainer.devices), or nothing to check
                continue
            for name in names:
                if name not in known:
                    raise ConfigError(f"unknown {o.key_or_group} {name!r}; choose from: {', '.join(known)}")
    except HydraException:  # a syntax error, a missing --config-dir, ...: Hydra's own message follows
        return


def check_field_names(argv: list[str]) -> None:
    """Reject a field the composed config does not have (``trainer.max_stpes=2``) in one line with the
    closest name, before Hydra composes the run (Hydra's own message suggests ``+key``, which would add
    the typo as a new key). Overrides that add (``+``), delete (``~``), name a package or touch
    ``hydra.*`` are left to Hydra, as is any command line it cannot parse or compose."""
    from difflib import get_close_matches

    from hydra.types import RunMode
    from omegaconf import DictConfig

    parsed = _parsed_overrides(argv)
    if parsed is None:
        return
    args, overrides, options = parsed
    try:
        groups, fields = [], []
        for o in overrides:
            key = o.key_or_group
            if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or key.startswith("hydra"):
                groups.append(o.input_line)
            elif options(key):  # a config group: compose with its (first) choice
                names = list(_choices(o))
                groups.append(f"{key}={names[0]}" if names else o.input_line)
            else:
                fields.append(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = _config_loader(args).load_configuration(args.config_name or CONFIG_NAME, overrides=groups,
                                                           run_mode=RunMode.RUN)
    except Exception:  # noqa: BLE001 -- whatever Hydra cannot compose, Hydra reports itself
        return
    for key in fields:
        node, done = cfg, []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part in node.keys():  # `in node` is False for a ??? value
                # the node, unresolved: ${hydra:...} cannot resolve before Hydra runs the job
                node = node._get_node(part) if isinstance(node, DictConfig) else None
                done.append(part)
                continue
            close = get_close_matches(part, [str(k) for k in node.keys()], n=1)
            where = ".".join(done)
            hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else \
                f"; {where or 'the config'} has: {', '.join(sorted(str(k) for k in node.keys()))}"
            raise ConfigError(f"unknown key {key}{hint} (+{key}=... would add it as a new key)")


def torchrun_overrides(argv: list[str], env: dict[str, str]) -> list[str]:
    """Under torchrun every rank runs this app: give them one shared run directory (named by torchrun's
    run id, stable across restarts, so a restarted run finds its checkpoints), and let only rank 0 write
    Hydra's files."""
    if "TORCHELASTIC_RUN_ID" not in env or any(a.startswith("-m") or a == "--multirun" for a in argv):
        return []
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append(f"hydra.run.dir=outputs/torchrun/{env['TORCHELASTIC_RUN_ID']}")
    if env.get("RANK", "0") != "0":
        extra.append("hydra.output_subdir=null")
    return extra


# ---------------------------------------------------------------------------------------------------
# errors that a restart cannot fix


def stop_elastic_agent() -> bool:
    """Ask torchrun not to restart a run whose configuration is wrong: every attempt would fail the
    same way. torch.distributed.elastic has no exit code for "do not retry" (pytorch#133877): its agent
    restarts the workers after any failure while ``--max-restarts`` lasts. What it does honour is a
    termination signal: on SIGTERM the agent stops its workers and exits nonzero without a new
    attempt. So the worker sends SIGTERM to its parent, after making sure that parent is torchrun's
    agent (on Linux, from /proc). Returns whether it did."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") in ("", "0"):
        return False
    agent = os.getppid()
    try:
        cmdline = Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not any(part.endswith((b"torchrun", b"torch.distributed.run", b"torch.distributed.launch"))
               for part in cmdline):
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(agent, signal.SIGTERM)
    return True


def _config_failure(e: ConfigError) -> None:
    print(f"error: {e}", file=sys.stderr)
    stop_elastic_agent()
    sys.exit(2)


class ClaimRunDir(Callback):
    """Claims a single run's directory (``jobs.claim_run_dir``) before Hydra writes its ``.hydra/``
    files and ``run.log`` there: a second run into a directory that a live run holds stops with one
    line and leaves that run's files as they were. ``train`` takes the claim over and releases it;
    otherwise it goes when the process ends. Sweeps need none: each job gets a directory of its own."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        from lightning_par.core.jobs import claim_run_dir, global_rank

        if global_rank() != 0:  # under torchrun or srun, rank 0 holds the directory
            return
        run_dir = str(OmegaConf.select(config, "hydra.run.dir"))
        try:  # hydra.run.dir resolves as run_job will resolve it (Hydra caches ${now:})
            claim_run_dir(run_dir)
        except ConfigError as e:  # RunDirInUse, or a file system without locks
            _config_failure(e)
        except OSError as e:  # read-only, not a directory, ...: Hydra would print a traceback opening run.log
            _config_failure(_unwritable("run directory", run_dir, e))

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        """A sweep's directory: created and written here, so a read-only one is one line, not Hydra's traceback."""
        import tempfile

        from lightning_par.core.jobs import global_rank

        if global_rank() != 0:
            return
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        try:
            os.makedirs(sweep_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=sweep_dir, prefix=".write-test-"):
                pass
        except OSError as e:
            _config_failure(_unwritable("sweep directory", sweep_dir, e))


def _unwritable(what: str, path: str, e: OSError) -> ConfigError:
    reason = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename and str(e.filename) != path else ""
    return ConfigError(f"{what} {path} cannot be created or written: {reason}{where}; set hydra.run.dir "
                       "(hydra.sweep.dir for -m) to a writable directory")


# ---------------------------------------------------------------------------------------------------
# the Hydra app

_state = {"job_started": False}


def _run(cfg: DictConfig) -> float | None:
    _prestart_fork_server(cfg)  # before the config's check, which imports Lightning
    from lightning_par.run.config_values import check_config_values

    # once per launch, before any rank starts (train.build and the child ranks do not check again): every
    # value's type and range and the mode (config_values.MODES), one line naming the key
    check_config_values(cfg)
    _one_log_handler()
    if cfg.mode == "estimate":
        from lightning_par.modes.estimate import run_estimate

        run_estimate(cfg)
        return None
    if cfg.mode == "find_batch_size":
        from lightning_par.modes.batch_size import find_batch_size

        find_batch_size(cfg)
        return None
    from lightning_par.run.train import train  # mode=train: check_config_values refused any other mode

    summary = train(cfg)
    return summary["final_loss"] if summary else None


def _prestart_fork_server(cfg: DictConfig) -> None:
    """Start the fork server of a CPU job's ranks (``core/fork_ranks.py``) now, before this process
    imports Lightning (checking the config imports it): the server imports the same modules beside it,
    instead of after it while rank 0 waits (3.8 s of a 2-rank ``experiment=quick`` run's 10.8 s on an idle
    2-core machine). A config refused next ends this process, and the server with it (``fork_server.py``).
    Only an optimisation: the conditions are the launcher's (``run/train.py``) taken conservatively --
    under torchrun or Slurm, or on a GPU, nothing starts here, and where a server was not started here the
    launcher starts it as before."""
    if cfg.get("mode") != "train" or any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
        return
    from lightning_par.run import facts

    try:
        forks = facts.world_size(cfg) > 1 and facts.accelerator(cfg.trainer) == "cpu"
    except Exception:  # noqa: BLE001 -- a bad value: check_config_values, next, says which in one line
        return
    if forks:
        from lightning_par.core.fork_ranks import CHILD_MODULE, ChildEntry, fork_context

        fork_context(ChildEntry(CHILD_MODULE, ()))


def _one_log_handler() -> None:
    """Lightning's loggers print through Hydra's handlers (console and the run's log file) only: Lightning
    attaches a console handler of its own when it is imported before logging is configured, so each of
    its INFO lines came out twice, once bare and once in Hydra's format."""
    import lightning  # noqa: F401 -- its import attaches the handler (lazily imported by train otherwise)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        log = logging.getLogger(name)
        for handler in [h for h in log.handlers if type(h) is logging.StreamHandler]:
            log.removeHandler(handler)
        log.propagate = True
    # Lightning 2.6's own use of torch 2.13's pytree API warns on every run; nothing a user can act on
    from lightning_par.core.jobs import quiet_third_party_logs

    quiet_third_party_logs()
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def _job(cfg: DictConfig) -> float | None:
    """One job. Whatever ends it early leaves error.json in its output dir. In a sweep the failure
    goes back to Hydra as ``JobFailed``: Hydra marks the job failed, runs the others and ends the
    sweep with a nonzero exit. A single run prints one ``error:`` line and exits 2 for a
    configuration mistake, 1 for anything else (``HYDRA_FULL_ERROR=1`` shows the traceback). The
    traceback of anything but a configuration mistake goes to the job's run.log (``jobs.log_traceback``)."""
    from lightning_par.core.jobs import hydra_job, log_traceback, one_line, record_failure, root_error

    _state["job_started"] = True
    job = hydra_job()
    watch = _exit_watch(job)
    try:
        return _run(cfg)
    except (KeyboardInterrupt, SystemExit) as e:  # an interrupt or an explicit exit ends everything
        if _interrupted(e):  # Ctrl-C before training started (in training the run guard stops at a step)
            stop = Interrupted("interrupted by SIGINT (Ctrl-C) before training started; no checkpoint was written")
            record_failure(stop)
            print(f"stopped: {stop}", file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        if not (isinstance(e, SystemExit) and e.code in (0, None)):
            record_failure(e)
        raise
    except BaseException as e:  # noqa: BLE001 -- torch's CheckpointException is a BaseException
        record_failure(e)
        cause = root_error(e)
        if not isinstance(cause, ConfigError):  # unexpected: its traceback in run.log (the console keeps one line)
            log_traceback(e)
        line = str(cause) if isinstance(cause, ConfigError) else f"{type(cause).__name__}: {one_line(cause)}"
        if job.get("multirun"):
            print(f"error: job {job.get('num')}: {line}", file=sys.stderr)
            raise JobFailed(f"job {job.get('num')} failed: {line} (error.json in {job.get('output_dir')})") from e
        if isinstance(cause, ConfigError):
            _config_failure(cause)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:  # the job recorded how it ended (summary or error.json): nothing left for the watcher
        if watch is not None:
            watch.job_ended()


class Interrupted(Exception):
    """What error.json says of a run that Ctrl-C stopped before its training loop started."""


def _interrupted(e: BaseException) -> bool:
    """Whether ``e`` is a Ctrl-C: a ``KeyboardInterrupt``, or the ``SystemExit(1)`` Lightning raises in
    its place after its own shutdown (``_call_and_handle_interrupt``)."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        if not isinstance(e, SystemExit) or getattr(e, "all_ranks", False):  # a guard's stop names its signal
            return False
        e = e.__context__
    return False


def _exit_watch(job: dict):
    """Rank 0's watcher (``core/exit_watch.py``): error.json if the kernel kills this process mid-job."""
    from lightning_par.core.exit_watch import ExitWatch
    from lightning_par.core.jobs import global_rank

    if global_rank() != 0 or not job.get("output_dir"):
        return None
    watch = ExitWatch.get()
    watch.job_started(job["output_dir"], job.get("overrides", []))
    return watch


def main() -> None:
    """Entry point of ``lightning-par``: check config names, add torchrun's settings, run Hydra."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # a shell starts background jobs with SIGINT ignored; `kill -INT` to this launcher still means stop
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    try:
        check_group_choices(argv)
        argv = sweep_safe_overrides(argv)  # a swept option some configs lack: its own message first
        check_field_names(argv)
    except ConfigError as e:
        _config_failure(e)
    sys.argv[1:] = argv
    sys.argv += torchrun_overrides(argv, dict(os.environ))
    try:
        _job()
    except SystemExit as e:
        # Hydra refused the command line (a composition error) before any job ran: not retryable either
        if e.code not in (0, None) and not _state["job_started"]:
            stop_elastic_agent()
        raise
