"""Trained weights out (issue 20, part 2): ``lightning-par-export CHECKPOINT OUT``.

Checkpoints written at 2 ranks by a LightningModule of this test (holding a Hugging Face model
loaded with ``lightning_par.models.from_pretrained``) under fsdp, zero3, ddp, pipeline and tensor
parallel (Llama; GPT-2 with its tied vocabulary-parallel head), and by the
app's own GPT preset under fsdp, are exported and opened with transformers' ``from_pretrained``:

- after training with lr=0 the exported weights equal the pretrained ones exactly;
- after training with lr>0 the exported model's logits equal those of the checkpoint's own model
  (the run's tensors read back with torch.distributed.checkpoint into the same architecture), and
  differ from the untrained ones;
- our GPT preset exports to ``GPT2LMHeadModel`` with the same logits as our GPT;
- transformers' own ``save_pretrained`` called on every rank of the same runs (issue 20, part 5): under
  fsdp and zero3 (Llama untied, GPT-2 tied) the directory holds the run's final weights bit for bit,
  in the files transformers writes, beside a tokenizer saved there first; rank 0 calling it alone gets
  one line within the arrival timeout, and training goes on; ddp keeps transformers' method; a
  pipeline refuses in one line.

Faults: an interrupted export leaves neither OUT nor a partial directory; every bad input is one
line and exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import launch
from tests.test_pretrained import MAKE, ROOT, _env, _run

SCRIPT = textwrap.dedent('''
    import json, os, sys, time, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.models
    import lightning_par.parallel.hf.save
    import lightning_par.strategies

    class FineTune(L.LightningModule):
        def __init__(self, directory, lr):
            super().__init__()
            self.directory, self.lr, self.net = directory, lr, None

        def configure_model(self):
            if self.net is None:
                self.net = lightning_par.models.from_pretrained(self.directory)

        def loss_fn(self, logits, target):
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.net(input_ids=x).logits, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    def tokenizer(directory):  # a tokenizer saved into the directory first: the model's save must keep it
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)

    def save_pretrained(trainer, fam, strategy, lr):
        """transformers' own call on the trained model, from every rank (issue 20, part 5)."""
        net, out = trainer.lightning_module.net, f"{root}/saved/{fam}-{strategy}-{lr}"
        seen = {"installed": "save_pretrained" in vars(net)}
        if trainer.is_global_zero:
            tokenizer(out)
        trainer.strategy.barrier()
        try:
            net.save_pretrained(out, max_shard_size="100KB")
        except RuntimeError as e:
            seen["error"] = str(e)
        if strategy == "lp_zero3":  # rank 0 alone (rank 1 waits in the training group): one line, no hang
            if trainer.is_global_zero:
                start = time.monotonic()
                try:
                    net.save_pretrained(f"{root}/saved/alone")
                except RuntimeError as e:
                    seen["alone"] = {"error": str(e), "type": type(e).__name__, "seconds": time.monotonic() - start}
            trainer.strategy.barrier()
        return seen

    root, cells = sys.argv[1], json.loads(sys.argv[2])
    lightning_par.parallel.hf.save.ARRIVAL_TIMEOUT_S = 5  # read at setup; the default is 120 s
    report = {}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 300, (8, 17), generator=g)
    for fam, strategy, lr in cells:
        L.seed_everything(0, verbose=False)
        ckpt = ModelCheckpoint(dirpath=f"{root}/ckpt", filename=f"{fam}-{strategy}-{lr}", every_n_train_steps=3,
                               save_top_k=-1)
        trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=3, callbacks=[ckpt],
                            logger=False, enable_progress_bar=False, enable_model_summary=False)
        dp = 1 if strategy in ("lp_pipeline", "lp_tensor_parallel") else 2
        data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        trainer.fit(FineTune(f"{root}/{fam}", lr), DataLoader(data, batch_size=8 // dp))
        report[f"{fam}-{strategy}-{lr}"] = save_pretrained(trainer, fam, strategy, lr)
    if trainer.is_global_zero:
        with open(f"{root}/saved/report.json", "w") as f:
            json.dump(report, f)
''')
CELLS = [("llama", "lp_fsdp", 0.0), ("llama", "lp_zero3", 0.5), ("gpt2", "lp_fsdp", 0.5), ("gpt2", "lp_ddp", 0.5),
         ("qwen2", "lp_pipeline", 0.5), ("llama", "lp_tensor_parallel", 0.5),
         ("gpt2", "lp_tensor_parallel", 0.5)]  # GPT-2: tied, its fused c_attn split by a derived plan


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    _run(MAKE, str(root), cwd=root)
    _run(SCRIPT, str(root), json.dumps(CELLS), cwd=root)
    return root


def _export(*args: str) -> subprocess.CompletedProcess:
    return launch.run([sys.executable, "-m", "lightning_par.strategies.checkpoint.export", *args], env=_env(), capture_output=True,
                          text=True, timeout=300)


def _checkpoint_model(source: Path, checkpoint: Path, prefix: str = "net."):
    """The architecture of ``source`` holding the checkpoint's tensors (the run's model, read back)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {prefix + k: v for k, v in net.state_dict().items() if f"model.{prefix}{k}" in saved}
    dcp.load({"model": state}, checkpoint_id=checkpoint, no_dist=True)
    return net


def _logits(net, ids):
    import torch

    with torch.no_grad():
        return net(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_round_trips_through_transformers(trained: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_par.strategies.checkpoint import export

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(9))
    for i, (fam, strategy, lr) in enumerate(CELLS):
        checkpoint = trained / "ckpt" / f"{fam}-{strategy}-{lr}.ckpt"
        out = tmp_path / f"{fam}-{strategy}"
        if i == 0:  # the command, once; the other cells through the same function in this process
            proc = _export(str(checkpoint), str(out), "--max-shard-size", "60KB")
            assert proc.returncode == 0, proc.stderr
            message = proc.stdout
        else:
            message = export.export(checkpoint, out, max_shard_bytes=60_000)
        assert f"to {out}: transformers" in message, message
        assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        source = AutoModelForCausalLM.from_pretrained(trained / fam, dtype=torch.float32)
        if lr == 0:  # nothing trained: the very weights that went in
            for (name, a), b in zip(exported.state_dict().items(), source.state_dict().values(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
            continue
        run = _checkpoint_model(trained / fam, checkpoint)
        got, want = _logits(exported, ids), _logits(run, ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{fam} {strategy}")
        assert (got - _logits(source, ids)).abs().max() > 1e-3, f"{fam} {strategy}: training changed nothing"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_our_gpt_exports_as_gpt2(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import GPT2LMHeadModel

    from lightning_par.models.gpt import GPT, GPTConfig

    proc = launch.run([sys.executable, str(ROOT / "run.py"), "model=gpt_tiny", "strategy=fsdp", "trainer.devices=2",
                           "trainer.max_steps=3", "data=synthetic", "data.seq_len=32", "callbacks=checkpoint",
                           "callbacks.checkpoint.every_n_train_steps=3", f"hydra.run.dir={tmp_path}/run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step000003.ckpt"
    proc = _export(str(checkpoint), str(tmp_path / "hf"))
    assert proc.returncode == 0 and "GPT2LMHeadModel" in proc.stdout, proc.stderr
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    ours = GPT(GPTConfig(**meta["gpt_config"]))
    dcp.load({"model": {"net." + k: v for k, v in ours.state_dict().items()}}, checkpoint_id=checkpoint, no_dist=True)
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_interrupted_export_leaves_nothing_that_looks_complete(trained: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_par.strategies.checkpoint import export

    checkpoint = trained / "ckpt" / "llama-lp_fsdp-0.0.ckpt"
    calls = []
    real = export.write_safetensors

    def dies_on_second_file(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a Ctrl-C in the middle looks like
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "write_safetensors", dies_on_second_file)
    with pytest.raises(KeyboardInterrupt):
        export.export(checkpoint, tmp_path / "out", max_shard_bytes=60_000)
    assert len(calls) == 2 and calls[0].exists() is False  # the first file was written, then removed
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_killed_exports_hidden_directory_is_removed_by_the_next(trained: Path, tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: its ``.OUT.partial-PID`` stays until the next export to OUT, which removes it
    once that process is gone (a live export's directory is left alone)."""
    from lightning_par.strategies.checkpoint import export

    checkpoint = trained / "ckpt" / "llama-lp_fsdp-0.0.ckpt"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no longer running
    dead = tmp_path / f".out.partial-{gone.pid}"
    live = tmp_path / f".out.partial-{os.getppid()}"
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    export.export(checkpoint, tmp_path / "out")
    assert not dead.exists() and live.exists()
    assert (tmp_path / "out" / "config.json").exists()


def test_bad_export_input_is_one_line(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bad input: exit 2 and one ``error:`` line (plus argparse's usage for its own errors), nothing
    written. The cases run through ``main`` in this process; the first also as the command, whose stderr
    is that one line too (no traceback, no warnings)."""
    from lightning_par.strategies.checkpoint import export

    checkpoint = trained / "ckpt" / "llama-lp_fsdp-0.0.ckpt"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    cases = {
        (str(tmp_path / "nowhere"), str(tmp_path / "a")): "does not exist",
        (str(checkpoint), str(tmp_path / "full")): "exists and is not empty",
        (str(checkpoint), str(tmp_path / "file" / "out")): "cannot write",
        (str(checkpoint), str(tmp_path / "b"), "--max-shard-size", "lots"): "is not a size",
        (str(checkpoint), str(tmp_path / "c"), "--tokenizer", str(tmp_path / "full")): "tokenizer",
        (str(checkpoint), "."): "is the current directory",  # --overwrite would have removed it
        (str(checkpoint), str(checkpoint.parent), "--overwrite"): "holds the checkpoint",
        (str(tmp_path / "file"), str(tmp_path / "d")): "is a single-file checkpoint",
    }
    proc = _export(*next(iter(cases)))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and "does not exist" in lines[0], \
        proc.stderr
    monkeypatch.chdir(trained.parent)  # "." is a directory the run does not own, as the command's cwd was
    for args, expected in cases.items():
        try:
            code = export.main(list(args))
        except SystemExit as e:  # argparse's own refusal
            code = e.code
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and expected in err, (args, err)
        errors = [line for line in lines if "error:" in line]
        usage = [line for line in lines if line.startswith(("usage:", " "))]  # argparse's usage, for its own errors
        assert len(errors) == 1 and len(errors) + len(usage) == len(lines), lines
    assert not [p for p in tmp_path.iterdir() if p.name not in ("full", "file")]  # nothing half-written
    assert os.listdir(tmp_path / "full") == ["x"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_app_fine_tunes_a_checkpoint_and_exports_it_at_the_end(trained: Path, tmp_path: Path) -> None:
    """``model=hf_causal_lm model.pretrained=DIR ... callbacks.export.at_end=true`` under zero3 at 2
    ranks: the exported directory is the final checkpoint's model, and ``load_from_checkpoint`` opens
    that sharded checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_par.models.hf.causal_lm import HFCausalLM

    run = tmp_path / "run"
    proc = launch.run([sys.executable, str(ROOT / "run.py"), "model=hf_causal_lm", f"model.pretrained={trained}/llama",
                           "strategy=zero3", "trainer.devices=2", "trainer.max_steps=3", "data=synthetic",
                           "data.seq_len=16", "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=3",
                           "callbacks.export.at_end=true", f"hydra.run.dir={run}"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"to {run / 'hf'}: transformers Llama layout" in proc.stdout, proc.stdout[-2000:]
    checkpoint = run / "checkpoints" / "step000003.ckpt"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    want = _logits(_checkpoint_model(trained / "llama", checkpoint), ids)
    exported = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    torch.testing.assert_close(_logits(exported, ids), want, rtol=1e-5, atol=1e-6)
    assert not list(run.glob(".hf*")), "the export's staging checkpoint was left behind"
    loaded = HFCausalLM.load_from_checkpoint(checkpoint)
    torch.testing.assert_close(_logits(loaded.net, ids), want, rtol=1e-5, atol=1e-6)


def _files(directory: Path) -> dict[str, object]:
    """What a transformers directory holds: each json file's content, each safetensors file's tensors."""
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for path in sorted(directory.iterdir()):
        out[path.name] = json.loads(path.read_text()) if path.suffix == ".json" else load_file(path)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformers_save_pretrained_on_every_rank_of_a_sharded_model(trained: Path, tmp_path: Path) -> None:
    """``self.net.save_pretrained(DIR)`` from every rank after ``fit`` (the script above): under fsdp and
    zero3 the directory is what transformers' own ``save_pretrained`` writes for the run's final model
    unsharded -- the same files, index and config, every tensor bit for bit (fp32, rtol=atol=0) -- and
    ``from_pretrained`` gives the run's logits; the tokenizer saved there first is kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_par.models.hf.pretrained import pretrained_config

    report = json.loads((trained / "saved" / "report.json").read_text())
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    for fam, strategy, lr in [c for c in CELLS if c[1] in ("lp_fsdp", "lp_zero3")]:
        cell = f"{fam}-{strategy}-{lr}"
        assert report[cell] == {"installed": True} or "alone" in report[cell], report[cell]
        saved = trained / "saved" / cell
        run = _checkpoint_model(trained / fam, trained / "ckpt" / f"{cell}.ckpt")  # the run's final weights
        # transformers' own save of them, unsharded, from a model made as the run made it: from the config
        # models.from_pretrained built (no dropout: the config is written as the model has it), not loaded by
        # transformers (which orders the files of a model it loaded otherwise)
        reference = AutoModelForCausalLM.from_config(pretrained_config(trained / fam), dtype=torch.float32)
        reference.load_state_dict(run.state_dict())
        reference.save_pretrained(tmp_path / cell, max_shard_size="100KB")
        ours, theirs = _files(saved), _files(tmp_path / cell)
        assert ours.pop("tokenizer.json") and ours.pop("tokenizer_config.json")
        assert sorted(ours) == sorted(theirs) and len([n for n in ours if n.startswith("model-")]) > 1, sorted(ours)
        for name, content in theirs.items():
            if name.endswith(".safetensors"):
                assert sorted(ours[name]) == sorted(content), name  # the same tensors in each file, a tie once
                for key, t in content.items():
                    torch.testing.assert_close(ours[name][key], t, rtol=0, atol=0, msg=f"{cell} {key}")
            else:
                assert ours[name] == content, f"{cell} {name}"
        # the checkpoint's use_cache, not the run's (training asks for no cache): generation loads as it did
        assert ours["config.json"]["use_cache"] is json.loads((trained / fam / "config.json").read_text()).get(
            "use_cache", True) is True, cell
        loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        torch.testing.assert_close(_logits(loaded, ids), _logits(run, ids), rtol=0, atol=0)
        assert AutoTokenizer.from_pretrained(saved)("a b c")["input_ids"] == [1, 2, 0]
    assert "lm_head.weight" not in ours["model.safetensors.index.json"]["weight_map"]  # gpt2: tied, written once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_pretrained_on_rank_0_alone_and_elsewhere(trained: Path) -> None:
    """Rank 0 alone (rank 1 waiting in a training collective): one line naming the fix, within the
    5 s arrival timeout the script sets, nothing written, and the run goes on (the later cells trained).
    ddp keeps transformers' own method (its save loads as the run's model); a pipeline refuses in one line."""
    import torch
    from transformers import AutoModelForCausalLM

    report = json.loads((trained / "saved" / "report.json").read_text())
    alone = report["llama-lp_zero3-0.5"]["alone"]
    assert alone["type"] == "SaveError" and "\n" not in alone["error"], alone
    assert "call save_pretrained on every rank" in alone["error"] and 4 < alone["seconds"] < 60, alone
    assert not (trained / "saved" / "alone").exists()
    ddp = report["gpt2-lp_ddp-0.5"]
    assert ddp == {"installed": False}, ddp
    run = _checkpoint_model(trained / "gpt2", trained / "ckpt" / "gpt2-lp_ddp-0.5.ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(trained / "saved" / "gpt2-lp_ddp-0.5", dtype=torch.float32)
    for (name, a), b in zip(loaded.state_dict().items(), run.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    pipeline = report["qwen2-lp_pipeline-0.5"]
    assert pipeline["installed"] and "pipeline stages" in pipeline["error"] and "\n" not in pipeline["error"], pipeline
    assert "lightning_par.strategies.checkpoint.export.save_pretrained(trainer, DIR)" in pipeline["error"]
