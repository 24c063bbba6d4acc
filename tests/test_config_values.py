"""Every config value's type and range is checked before launch (``lightning_par/run/config_values.py``): a
wrong value stops with one line ``<key>=<value as given>: expected ...`` naming its key; no shipped
config trips it; every key of every shipped yaml is declared somewhere (the table, the code that
already checks it, or free text)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_par import ConfigError
from lightning_par.run.config_values import (CHECKED_ELSEWHERE, ECHO_CHARS, TABLE, check_config_values, coverage, echo,
                                         leaf_keys)
from tests.helpers import composed, run_cli

CONF = Path(__file__).resolve().parents[1] / "lightning_par" / "conf"
GROUPS = ("strategy", "model", "data", "trainer", "scheduler", "callbacks", "logger", "experiment", "paths")
LONG = "x" * 5000
UNICODE = "'学习率-ß-é-🚀'"


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def refusal(*overrides: str) -> str:
    """The checker's one line for the quick experiment with ``overrides``."""
    with pytest.raises(ConfigError) as info:
        check_config_values(composed("experiment=quick", *overrides))
    return str(info.value)


# (overrides, the key the line must name): wrong types, out of range, unicode, long, negative/zero/NaN/inf
GARBAGE = [
    (("model.lr=abc",), "model.lr"),
    (("model.lr=0",), "model.lr"),
    (("model.lr=-1e-3",), "model.lr"),
    (("model.lr=nan",), "model.lr"),
    (("model.lr=inf",), "model.lr"),
    ((f"model.lr={UNICODE}",), "model.lr"),
    ((f"model.lr={LONG}",), "model.lr"),
    (("model.lr=[1,2]",), "model.lr"),
    (("model.lr={a:1}",), "model.lr"),
    (("model.lr=true",), "model.lr"),
    (("model.weight_decay=-0.1",), "model.weight_decay"),
    (("model.betas=[0.9,1.5]",), "model.betas"),
    (("model.betas=[0.9]",), "model.betas"),
    (("data.seq_len=0",), "data.seq_len"),  # named before model.seq_len (= ${data.seq_len})
    (("data.seq_len=-5",), "data.seq_len"),
    (("data.seq_len=12.5",), "data.seq_len"),
    (("data.seq_len=true",), "data.seq_len"),
    ((f"data.seq_len='{'é' * 300}'",), "data.seq_len"),
    (("model.seq_len=0",), "model.seq_len"),
    (("data.val_fraction=1.5",), "data.val_fraction"),
    (("data.val_fraction=1.0",), "data.val_fraction"),
    (("data.val_fraction=-0.1",), "data.val_fraction"),
    (("data.val_fraction=nan",), "data.val_fraction"),
    (("data.global_batch_size=0",), "data.global_batch_size"),
    (("data.num_workers=-1",), "data.num_workers"),
    (("data.num_workers=abc",), "data.num_workers"),
    (("data.prefetch_factor=0",), "data.prefetch_factor"),
    (("data.max_bytes=0",), "data.max_bytes"),
    (("data.pin_memory=sometimes",), "data.pin_memory"),
    (("trainer.gradient_clip_val=-1",), "trainer.gradient_clip_val"),
    (("trainer.gradient_clip_val=inf",), "trainer.gradient_clip_val"),
    (("trainer.max_steps=-2",), "trainer.max_steps"),
    (("trainer.max_steps=abc",), "trainer.max_steps"),
    (("trainer.max_steps=1e3",), "trainer.max_steps"),
    (("trainer.max_steps=true",), "trainer.max_steps"),
    (("trainer.accumulate_grad_batches=0",), "trainer.accumulate_grad_batches"),
    (("trainer.log_every_n_steps=0",), "trainer.log_every_n_steps"),
    (("trainer.devices=0",), "trainer.devices"),
    (("trainer.devices=many",), "trainer.devices"),
    (("trainer.num_nodes=0",), "trainer.num_nodes"),
    (("trainer.val_check_interval=1.5",), "trainer.val_check_interval"),
    (("trainer.limit_val_batches=-1",), "trainer.limit_val_batches"),
    (("trainer.num_sanity_val_steps=-2",), "trainer.num_sanity_val_steps"),
    (("trainer.accelerator=quantum",), "trainer.accelerator"),
    (("trainer.enable_progress_bar=maybe",), "trainer.enable_progress_bar"),
    (("+trainer.gradient_clip_algorithm=max",), "trainer.gradient_clip_algorithm"),
    (("callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=0"), "callbacks.checkpoint.every_n_train_steps"),
    (("callbacks=checkpoint", "callbacks.checkpoint.save_top_k=-2"), "callbacks.checkpoint.save_top_k"),
    (("callbacks.throughput.warmup_steps=-1",), "callbacks.throughput.warmup_steps"),
    (("callbacks.throughput.peak_tflops=0",), "callbacks.throughput.peak_tflops"),
    (("callbacks.guard.check_every_n_steps=0",), "callbacks.guard.check_every_n_steps"),
    (("callbacks.guard.check_every_n_steps=2.5",), "callbacks.guard.check_every_n_steps"),
    (("callbacks.moe.flush_every_n_steps=0",), "callbacks.moe.flush_every_n_steps"),
    (("callbacks.comm.measure_steps=0",), "callbacks.comm.measure_steps"),
    (("scheduler=warmup_cosine", "scheduler.warmup_steps=-1"), "scheduler.warmup_steps"),
    (("scheduler=warmup_cosine", "scheduler.min_lr_ratio=1.5"), "scheduler.min_lr_ratio"),
    (("scheduler=warmup_linear", "scheduler.min_lr_ratio=nan"), "scheduler.min_lr_ratio"),
    (("scheduler.total_steps=0",), "scheduler.total_steps"),
    (("scheduler.base_batch_size=-8",), "scheduler.base_batch_size"),
    (("strategy=ddp", "strategy.bucket_cap_mb=-25"), "strategy.bucket_cap_mb"),
    (("strategy=ddp", "strategy.sync_batchnorm=yes"), "strategy.sync_batchnorm"),
    (("strategy=ddp", "strategy.process_group_backend=carrier_pigeon"), "strategy.process_group_backend"),
    (("strategy=pipeline", "strategy.n_microbatches=0"), "strategy.n_microbatches"),
    (("strategy=pipeline", "strategy.virtual_stages=abc"), "strategy.virtual_stages"),
    (("strategy=fsdp", "strategy.replicate=0"), "strategy.replicate"),
    (("strategy=fsdp", "strategy.replicate=true"), "strategy.replicate"),
    (("strategy=fsdp", "strategy.cpu_offload=2"), "strategy.cpu_offload"),
    (("strategy=single", "strategy.device=warp9"), "strategy.device"),
    (("model=moe_tiny", "model.capacity_factor=nan"), "model.capacity_factor"),
    (("model=moe_tiny", "+model.moe_every=abc"), "model.moe_every"),
    (("model=moe_tiny", "+model.aux_loss_coef=-1"), "model.aux_loss_coef"),
    (("+model.dropout=1.0",), "model.dropout"),
    (("+model.n_head=0",), "model.n_head"),
    (("model=hf_llama_tiny", "model.heads=0"), "model.heads"),
    (("model=hf_llama_tiny", "model.vocab=100"), "model.vocab"),
    (("model=hf_llama_tiny", "model.kv_heads=-2"), "model.kv_heads"),
    (("model=mlp", "model.depth=0"), "model.depth"),
    (("model=cnn", "model.channels=[16,0]"), "model.channels"),
    (("model=cnn", "model.channels=[]"), "model.channels"),
    (("seed=-1",), "seed"),
    (("seed=abc",), "seed"),
    (("check_memory=perhaps",), "check_memory"),
    (("find_batch_size.steps=0",), "find_batch_size.steps"),
    (("find_batch_size.max_memory_gb=-1",), "find_batch_size.max_memory_gb"),
    (("find_batch_size.timeout_s=inf",), "find_batch_size.timeout_s"),
    (("+estimate.unit=TiB",), "estimate.unit"),
    (("+estimate.device_memory=0",), "estimate.device_memory"),
]


def _id(case: tuple) -> str:
    text = case[0][-1]
    return text if len(text) < 40 else text[:37] + "..."


@pytest.mark.parametrize("overrides,key", GARBAGE, ids=[_id(c) for c in GARBAGE])
def test_garbage_value_is_one_line_naming_its_key(overrides, key):
    line = refusal(*overrides)
    assert line.startswith(f"{key}=") and ": expected " in line, line
    assert "\n" not in line and "\r" not in line and line.isprintable(), line
    given = line[len(key) + 1: line.index(": expected ")]
    assert len(given) <= ECHO_CHARS, given
    assert len(line) < ECHO_CHARS + 200, line


def test_there_are_enough_garbage_cases():
    assert len(GARBAGE) >= 30 and len({key for _, key in GARBAGE}) >= 30


def test_the_value_is_echoed_as_given():
    assert refusal("trainer.max_steps=1e3").startswith("trainer.max_steps=1e3: expected -1 or an integer >= 0")
    assert refusal("model.lr=-1e-3").startswith("model.lr=-1e-3: ")
    assert refusal(f"model.lr={UNICODE}").startswith(f"model.lr={UNICODE}: ")
    assert refusal(f"model.lr={LONG}").startswith(f"model.lr={'x' * (ECHO_CHARS - 3)}...: ")


def test_echo_is_one_printable_line():
    assert echo("学习率 🚀") == "学习率 🚀"
    assert echo("a\nb\tc\u202ed") == "a\\nb\\tc\\u202ed"
    assert echo("é" * 100) == "é" * (ECHO_CHARS - 3) + "..."


def test_a_value_set_without_the_command_line_is_echoed_from_the_config():
    cfg = composed("experiment=quick")
    with open_dict(cfg):
        cfg.data.val_fraction = 1.5
        cfg.trainer.enable_progress_bar = None  # allowed: Lightning's default
    with pytest.raises(ConfigError, match=r"^data\.val_fraction=1\.5: expected a finite number in \[0, 1\)"):
        check_config_values(cfg)
    cfg.data.val_fraction = 0.1
    cfg.trainer.max_steps = False
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps=false: "):
        check_config_values(cfg)


GOOD = [
    ["model.lr=1", "trainer.gradient_clip_val=0", "data.val_fraction=0"],
    ["trainer.devices=auto", "trainer.max_steps=-1", "trainer.val_check_interval=0.5"],
    ["trainer.max_steps=0", "trainer.devices=[0,1]", "trainer.limit_val_batches=0.25"],  # 0 steps: set up only
    ["+trainer.gradient_clip_algorithm=value", "strategy=ddp", "strategy.bucket_cap_mb=0.5",
     "strategy.process_group_backend='cpu:gloo,cuda:nccl'"],
    ["strategy=single", "strategy.device=cpu", "seed=4294967295"],
    ["scheduler=warmup_cosine", "scheduler.min_lr_ratio=1", "scheduler.warmup_steps=0"],
    ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=null"],
]


def test_good_values_pass():
    for overrides in GOOD:
        check_config_values(composed("experiment=quick", *overrides))


def test_a_users_own_class_keeps_its_keys():
    """The table speaks for lightning_par's and Lightning's classes, not for a model of the user's own."""
    cfg = composed("experiment=quick")
    with open_dict(cfg):
        cfg.model._target_ = "my_package.MyModel"
        cfg.model.lr = "cosine-please"
        cfg.model.hidden = [64, 64]
    check_config_values(cfg)


@pytest.mark.parametrize("group", GROUPS)
def test_every_shipped_config_passes(group):
    """No false alarm: each yaml of each group, composed on its own with the defaults (a value the yaml
    leaves to the user, data=tokens' path, given); left unset, it is one line naming it."""
    for name in names(group):
        cfg = composed(f"{group}={name}")
        node, given = cfg.get(group), []
        missing = [k for k in (node.keys() if isinstance(node, DictConfig) else []) if OmegaConf.is_missing(node, k)]
        for key in missing:  # data=tokens' path, data=hf_dataset's path and tokenizer: one line each, in order
            with pytest.raises(ConfigError, match=rf"^{group}.{key} needs a value: add {group}.{key}=\.\.\. to"):
                check_config_values(composed(f"{group}={name}", *given))
            given.append(f"{group}.{key}=somewhere")
        check_config_values(composed(f"{group}={name}", *given))


def test_every_key_of_every_shipped_config_is_declared():
    """Each leaf of each composed yaml is in the table, checked by the code that reads it, or free text."""
    nowhere = set()
    for group in GROUPS:
        for name in names(group):
            nowhere |= {k for k in leaf_keys(composed(f"{group}={name}")) if coverage(k) is None}
    assert not nowhere, f"keys neither in config_values.TABLE nor CHECKED_ELSEWHERE / NOT_CHECKED: {sorted(nowhere)}"
    assert not set(TABLE) & set(CHECKED_ELSEWHERE)  # one place per key


def test_checked_elsewhere_names_callables_not_places():
    """Each key left to the code that reads it names that code as references (functions, classes, methods),
    resolved by importing them: a checker renamed or moved fails here, not silently in a string."""
    assert len(CHECKED_ELSEWHERE) >= 30
    for key, checkers in CHECKED_ELSEWHERE.items():
        assert isinstance(checkers, tuple) and checkers, key
        for checker in checkers:
            assert callable(checker) and not isinstance(checker, str), (key, checker)
            module = inspect.getmodule(checker)
            assert module is not None and module.__name__.startswith("lightning_par."), (key, checker)
            owner = module  # reachable by its own name from its module: a real, importable place
            for part in checker.__qualname__.split("."):
                owner = getattr(owner, part)
            assert owner is checker, (key, checker)


def _codes(checker) -> set:
    """The code objects that run a checker: a function's own, or every method a class defines."""
    if inspect.isclass(checker):
        return {f.__code__ for f in vars(checker).values() if inspect.isfunction(f)}
    return {checker.__code__}


def _frames(error: BaseException) -> set:
    """Every code object on the tracebacks of ``error`` and the errors it wraps (Hydra's, build's one line)."""
    seen, codes, todo = set(), set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            codes.add(tb.tb_frame.f_code)
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return codes


# keys CHECKED_ELSEWHERE leaves to their checkers, proven by building: the table lets the value through, the
# run's build (train.build, then train.validate as a launch runs it) refuses it in one line, and the refusal
# passes through one of the callables CHECKED_ELSEWHERE names for that key
ELSEWHERE = [
    (("strategy=3d", "strategy.pp=0"), "strategy.pp", "pp"),
    (("strategy=fsdp_tp", "strategy.tp=abc"), "strategy.tp", "tp"),
    (("strategy=pipeline", "strategy.ep=0"), "strategy.ep", "ep"),
    (("strategy=expert_parallel", "strategy.ep=-1"), "strategy.ep", "ep"),
    (("strategy=3d", "strategy.data_parallel=shard"), "strategy.data_parallel", "data_parallel"),
    (("strategy=pipeline", "strategy.schedule=zigzag"), "strategy.schedule", "schedule"),
    (("strategy=pipeline", "strategy.balance=luck"), "strategy.balance", "balance"),
    (("strategy=fsdp", "strategy.param_dtype=bf8"), "strategy.param_dtype", "param_dtype"),
    (("strategy=zero3", "strategy.reduce_dtype=fp4"), "strategy.reduce_dtype", "reduce_dtype"),
    (("strategy=fsdp", "strategy.prefetch=-1"), "strategy.prefetch", "prefetch"),
    (("model.optimizer=lion",), "model.optimizer", "lion"),
    (("model.preset=gpt9",), "model.preset", "gpt9"),
    (("model=moe_tiny", "+model.gating=relu"), "model.gating", "gating"),
    (("scheduler.name=cyclic",), "scheduler.name", "cyclic"),
    (("scheduler.lr_scaling=cubic",), "scheduler.lr_scaling", "lr_scaling"),
    (("compile=fast",), "compile", "compile="),
    (("+strategy.tiling={net.lm_head:1}",), "strategy.tiling", "strategy.tiling"),
    (("callbacks.guard.nonfinite=explode",), "callbacks.guard.nonfinite", "nonfinite"),
    (("trainer.precision=fp8",), "trainer.precision", "fp8"),
    (("data.files=/nonexistent/*.txt",), "data.files", "/nonexistent/"),
    (("model=hf_llama_tiny", "model.arch=bogus"), "model.arch", "bogus"),
    (("model=hf_llama_tiny", "model.attn_implementation=flash"), "model.attn_implementation", "flash"),
    (("callbacks.export.max_shard_size=huge",), "callbacks.export.max_shard_size", "huge"),
]
# the rest need a file, a directory, a tokenizer or a world of ranks to refuse a value: their checkers are
# resolved above (test_checked_elsewhere_names_callables_not_places) and exercised by their own tests
BY_USE = {"ckpt_path", "data.tokenizer", "data.field", "data.split", "data.path", "model.pretrained", "model.config.**",
          "strategy.units", "strategy.split_points", "strategy.offload_dir", "callbacks.checkpoint.dirpath"}


def test_every_key_checked_elsewhere_is_proven_or_left_to_use():
    built = {key for _, key, _ in ELSEWHERE}
    assert not built & BY_USE and built | BY_USE == set(CHECKED_ELSEWHERE), \
        sorted(set(CHECKED_ELSEWHERE) ^ (built | BY_USE))


@pytest.mark.parametrize("overrides,key,named", ELSEWHERE, ids=[c[0][-1] for c in ELSEWHERE])
def test_keys_checked_by_their_constructor(overrides, key, named, tmp_path):
    from lightning_par.run.train import build, validate

    assert key in CHECKED_ELSEWHERE and key not in TABLE
    cfg = composed("experiment=quick", *overrides, tmp=tmp_path)
    check_config_values(cfg)  # not the table's: no second check of the same thing
    with pytest.raises((ConfigError, ValueError)) as info:
        parts = build(cfg)
        validate(cfg, parts["strategy"], parts["model"], parts["datamodule"])
        parts["strategy"].fsdp_options.check(type(parts["strategy"]).__name__)  # as validate_setup does with a world
    line = str(info.value)
    assert "\n" not in line and named in line, line
    ran = _frames(info.value)
    assert any(_codes(c) & ran for c in CHECKED_ELSEWHERE[key]), (key, line, CHECKED_ELSEWHERE[key])


def test_the_launch_checks_the_config_once(tmp_path, monkeypatch):
    """One launch, one table check: the app's _run checks before anything is built; train (its build and
    validate) does not check again, nor does a child rank's train(cfg, child=True)."""
    from lightning_par import cli
    from lightning_par.run import config_values

    calls = []
    real = config_values.check_config_values
    monkeypatch.setattr(config_values, "check_config_values", lambda cfg: (calls.append(1), real(cfg))[1])
    fast = ("experiment=quick", "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false")
    cli._run(composed(*fast, tmp=tmp_path / "launch"))
    assert len(calls) == 1
    from lightning_par.run.train import train

    train(composed(*fast, tmp=tmp_path / "child"), child=True)  # what lightning_par.run.child runs on ranks 1..N-1
    assert len(calls) == 1


def test_mode_is_checked_with_the_table():
    with pytest.raises(ConfigError, match=r"^unknown mode 'serve'; choose from: train, estimate, find_batch_size$"):
        check_config_values(composed("experiment=quick", "mode=serve"))
    assert coverage("mode") == "table"


# end to end: run.py prints exactly one error: line naming the key, no traceback, and fails
E2E = [
    (["data.seq_len=0"], "data.seq_len"),
    (["model.lr=abc"], "model.lr"),
    ([f"data.val_fraction='{'ü' * 200}'"], "data.val_fraction"),
]


@pytest.mark.parametrize("overrides,key", E2E, ids=[k for _, k in E2E])
def test_run_py_stops_in_one_line(overrides, key, tmp_path):
    proc = run_cli(["experiment=quick", "trainer.max_steps=1", *overrides], tmp_path / "run", timeout=120, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode != 0, out[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}="), out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_a_callbacks_constructor_refusal_is_one_line_and_exit_2(tmp_path):
    """A value a callback's own constructor refuses (callbacks.guard.nonfinite is checked there) stops like
    any config error -- one line, exit 2 -- not as a crash of the run (exit 1): the callbacks are built
    inside train.build's error wrapping."""
    proc = run_cli(["experiment=quick", "trainer.max_steps=1", "callbacks.guard.nonfinite=explode"], tmp_path / "run",
                   timeout=120, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "nonfinite='explode'" in errors[0], out[-2000:]
    assert "Traceback" not in out, out[-2000:]
