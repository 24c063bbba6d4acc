"""``lightning-par-export CHECKPOINT OUT``: any strategy's sharded checkpoint, at any world size, as a
transformers directory.

The checkpoint (a ``torch.distributed.checkpoint`` directory, ``strategies/checkpoint/dcp.py``) holds the
model as per-parameter tensors in whatever shards the run wrote. The export reads one tensor at a
time as a full tensor (DCP reassembles it from the shards, in this one process, without a process
group) and appends it to the output safetensors file, so memory holds one tensor, never the model:

- a Hugging Face model (``model=hf_causal_lm``, with or without ``model.pretrained``) gets its own
  config and names back: ``AutoModelForCausalLM.from_pretrained(OUT)`` is the trained model;
- our GPT presets get the GPT-2 layout (``GPT2LMHeadModel``: q/k/v fused into ``c_attn``,
  ``Conv1D`` weights transposed, exact GELU, untied head);
- anything else gets its state dict as safetensors under its own names, and a one-line note.

A fine-tune's export also gets the source checkpoint's ``generation_config.json`` (its generation
defaults: the run recorded the directory), when that file is still there.

A LoRA run's checkpoint (``model.lora.rank=R``) is exported merged: each adapted weight is written as
``W + (alpha / r) B A``, read with its two adapters and nothing else, and the adapter keys are left out, so
the directory is the plain model (``lora_export.py``). ``--adapter`` writes PEFT's adapter directory
instead (``adapter_model.safetensors`` + ``adapter_config.json``), which ``PeftModel.from_pretrained``
loads onto the original base.

Files are sharded as ``save_pretrained`` shards them (``model-0000i-of-0000n.safetensors`` + the
index; one ``model.safetensors`` when it fits ``--max-shard-size``). Tokenizer files are copied when
the run recorded a tokenizer or ``--tokenizer DIR`` names one. Everything is written into a
temporary directory beside ``OUT`` that is renamed to ``OUT`` only at the end: an interrupted export
never leaves a directory that looks complete (a killed one's temporary directory is removed by the next
export to ``OUT``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_par import ConfigError
from lightning_par.core.jobs import quiet_third_party_logs
from lightning_par.strategies.checkpoint import lora_export
from lightning_par.strategies.checkpoint.dcp import MODEL_KEY, check_checkpoint

#: safetensors' dtype names
_CAST = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the export: its name and shape there, the checkpoint tensors it is made of, and how."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] = lambda ts: ts[0]


# ---------------------------------------------------------------------------------- reading
class CheckpointTensors:
    """The model tensors of a checkpoint directory, each read whole on demand (one at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        keys = [k for k in metadata if k.startswith(MODEL_KEY + ".")]
        self.key = MODEL_KEY if keys else "state_dict"  # the legacy model key
        self.meta = {k.split(".", 1)[1]: metadata[k] for k in metadata if k.startswith(self.key + ".")
                     and hasattr(metadata[k], "size")}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        dcp.load({self.key: {name: out}}, checkpoint_id=self.path, no_dist=True)
        return out

    def adapted(self) -> dict[str, tuple[str, str]]:
        """The LoRA layers' base weights -> their adapters' keys (``lora_export.adapted_weights``)."""
        try:
            return lora_export.adapted_weights(self.meta)
        except ValueError as e:
            raise ConfigError(f"export: {self.path}: {e}") from None


class MergedTensors(CheckpointTensors):
    """A LoRA run's checkpoint as the merged plain model: the adapter keys hidden, each adapted weight read
    as ``W + scaling * B @ A`` (its three tensors read, then merged: one layer's tensors in memory)."""

    def __init__(self, path: Path, scaling: float) -> None:
        super().__init__(path)
        self.scaling, self.adapters = scaling, self.adapted()
        self.meta_all, self.meta = self.meta, {k: v for k, v in self.meta.items() if not lora_export.is_adapter_key(k)}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta_all[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.meta_all[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        if name not in self.adapters:
            return super().read(name)
        a, b = self.adapters[name]
        return lora_export.merge(super().read(name), super().read(a), super().read(b), self.scaling)


# ---------------------------------------------------------------------------------- layouts
def hf_layout(tensors: CheckpointTensors, config: dict[str, Any], prefix: str) -> tuple[list[OutTensor], Any]:
    """A Hugging Face model's tensors under its own names; a tied copy is written once (as
    ``save_pretrained`` does). Returns the tensors and the config object to save."""
    from lightning_par.parallel.init.ties import tied_parameters

    net, cfg = _meta_model(config)
    tied = {other for _, other in tied_parameters(net)}
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    out = []
    for name in tensors.meta:
        hf = name.removeprefix(prefix)
        if hf in tied:
            continue
        if expected.get(hf) != tensors.shape(name):
            raise ConfigError(f"export: {tensors.path}: {name} of shape {tensors.shape(name)} has no place in the "
                              f"{cfg.model_type} model its config describes")
        out.append(OutTensor(hf, tensors.shape(name), tensors.dtype(name), (name,)))
    return out, cfg


def _meta_model(config: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The Hugging Face model a checkpoint's recorded config describes, on the meta device, and its config."""
    import transformers

    fields = dict(config)
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg.use_cache = True  # inference default; training ran without the cache
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg), cfg


def adapter_layout(tensors: CheckpointTensors, config: dict[str, Any], prefix: str,
                   facts: lora_export.LoRAFacts) -> tuple[list[OutTensor], list[str] | str]:
    """A LoRA run's adapters (and ``lora.train``'s whole modules) under PEFT's names, each checked against the
    Hugging Face model its config describes. Returns the tensors and PEFT's ``target_modules``."""
    net, cfg = _meta_model(config)
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    adapted = tensors.adapted()
    out, layers = [], []
    for peft, name in lora_export.peft_names(tensors.meta, prefix, facts.train).items():
        hf = peft.removeprefix(lora_export.PEFT_PREFIX)
        if lora_export.is_adapter_key(hf):
            base = name.rsplit(".", 2)[0] + ".weight"
            layer = base.removeprefix(prefix).removesuffix(".weight")
            if expected.get(layer + ".weight") != tensors.shape(base) or base not in adapted:
                raise ConfigError(f"export --adapter: {tensors.path}: {name} adapts a layer the {cfg.model_type} model "
                                  "its config describes does not have")
            layers.append(layer)
        elif expected.get(hf) != tensors.shape(name):
            raise ConfigError(f"export --adapter: {tensors.path}: {name} of shape {tensors.shape(name)} has no place "
                              f"in the {cfg.model_type} model its config describes")
        out.append(OutTensor(peft, tensors.shape(name), tensors.dtype(name), (name,)))
    if len(layers) != 2 * len(adapted):
        outside = sorted(set(adapted) - {prefix + p + ".weight" for p in layers})
        raise ConfigError(f"export --adapter: {tensors.path}: {outside[0]} is adapted outside the Hugging Face model "
                          f"(under {prefix or 'the root'})")
    return out, lora_export.target_modules(layers, (p for p, _ in net.named_modules()))


def gpt2_layout(tensors: CheckpointTensors, gpt: dict[str, Any], prefix: str = "net.") -> tuple[list[OutTensor], Any]:
    """Our GPT as ``GPT2LMHeadModel``: ``Conv1D`` weights are ``nn.Linear``'s transposed, and the
    attention's q/k/v projections are one fused ``c_attn``."""
    from transformers import GPT2Config

    d = gpt["n_embd"]
    cfg = GPT2Config(vocab_size=gpt["vocab_size"], n_positions=gpt["block_size"], n_embd=d, n_layer=gpt["n_layer"],
                     n_head=gpt["n_head"], n_inner=gpt["mlp_ratio"] * d, activation_function="gelu",
                     resid_pdrop=gpt["dropout"], embd_pdrop=gpt["dropout"], attn_pdrop=gpt["dropout"],
                     layer_norm_epsilon=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)

    def same(ours: str, theirs: str) -> OutTensor:
        return OutTensor(theirs, tensors.shape(prefix + ours), tensors.dtype(prefix + ours), (prefix + ours,))

    def transposed(ours: str, theirs: str) -> OutTensor:
        rows, cols = tensors.shape(prefix + ours)
        return OutTensor(theirs, (cols, rows), tensors.dtype(prefix + ours), (prefix + ours,),
                         lambda ts: ts[0].t().contiguous())

    out = [same("embed.tok.weight", "transformer.wte.weight"), same("embed.pos.weight", "transformer.wpe.weight")]
    for i in range(gpt["n_layer"]):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = tuple(f"{prefix}{ours}attn.w{x}" for x in "qkv")
        out += [same(ours + "ln_1.weight", theirs + "ln_1.weight"), same(ours + "ln_1.bias", theirs + "ln_1.bias"),
                OutTensor(theirs + "attn.c_attn.weight", (d, 3 * d), tensors.dtype(qkv[0] + ".weight"),
                          tuple(s + ".weight" for s in qkv), lambda ts: torch.cat([t.t() for t in ts], dim=1)),
                OutTensor(theirs + "attn.c_attn.bias", (3 * d,), tensors.dtype(qkv[0] + ".bias"),
                          tuple(s + ".bias" for s in qkv), torch.cat),
                transposed(ours + "attn.wo.weight", theirs + "attn.c_proj.weight"),
                same(ours + "attn.wo.bias", theirs + "attn.c_proj.bias"),
                same(ours + "ln_2.weight", theirs + "ln_2.weight"), same(ours + "ln_2.bias", theirs + "ln_2.bias"),
                transposed(ours + "mlp.fc.weight", theirs + "mlp.c_fc.weight"),
                same(ours + "mlp.fc.bias", theirs + "mlp.c_fc.bias"),
                transposed(ours + "mlp.proj.weight", theirs + "mlp.c_proj.weight"),
                same(ours + "mlp.proj.bias", theirs + "mlp.c_proj.bias")]
    out += [same("head.ln_f.weight", "transformer.ln_f.weight"), same("head.ln_f.bias", "transformer.ln_f.bias"),
            same("head.lm_head.weight", "lm_head.weight")]
    return out, cfg


def plain_layout(tensors: CheckpointTensors) -> list[OutTensor]:
    return [OutTensor(n, tensors.shape(n), tensors.dtype(n), (n,)) for n in tensors.meta]


# ---------------------------------------------------------------------------------- writing
def write_safetensors(file: Path, items: Sequence[OutTensor], produce: Callable[[OutTensor], torch.Tensor]) -> None:
    """Write ``items`` to one safetensors file, each tensor read (``produce``) as it is written: the
    streaming writer ``save_pretrained`` of a sharded model uses too (``parallel/hf/save.py``)."""
    from lightning_par.parallel.hf.save import write_safetensors as stream

    stream(file, items, (produce(item) for item in items))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shard(items: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor alone), as ``save_pretrained`` does."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for item in items:
        n = _numel(item.shape) * torch.empty((), dtype=item.dtype).element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


# ---------------------------------------------------------------------------------- the command
def export(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 5 * 2**30, dtype: str = "keep",
           tokenizer: str | Path | None = None, overwrite: bool = False, adapter: bool = False) -> str:
    """Export ``checkpoint`` to ``out`` (a LoRA run's merged; with ``adapter``, its PEFT adapter directory
    instead); returns what was written (one line)."""
    checkpoint, out = _checked_paths(checkpoint, out, overwrite)
    meta = torch.load(checkpoint / "meta.pt", map_location="cpu", weights_only=True)
    if adapter:
        return _export_adapter(checkpoint, out, meta, dtype=dtype, tokenizer=tokenizer)
    tensors = CheckpointTensors(checkpoint)
    merged = ""
    if adapted := tensors.adapted():
        tensors = MergedTensors(checkpoint, _lora_facts(meta, checkpoint).scaling)
        merged = f", {len(adapted)} LoRA layers merged"
    tokenizer = tokenizer or meta.get("tokenizer_dir")
    if meta.get("hf_config"):
        items, cfg = hf_layout(tensors, meta["hf_config"], meta.get("hf_module_prefix", ""))
        kind = f"transformers {type(cfg).__name__.removesuffix('Config')} layout"
    elif meta.get("gpt_config") and meta["gpt_config"].get("bias", True):
        items, cfg = gpt2_layout(tensors, meta["gpt_config"])
        kind = "transformers GPT-2 layout (GPT2LMHeadModel)"
    else:
        items, cfg = plain_layout(tensors), None
        kind = "plain safetensors state dict (no transformers architecture matches this model; its own names)"
    tok = _load_tokenizer(Path(tokenizer)) if tokenizer else None  # before anything is written
    items = _cast(items, dtype)
    with _staged(out) as tmp:
        groups = shard(items, max_shard_bytes)
        names = ["model.safetensors"] if len(groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for name, group in zip(names, groups):
            write_safetensors(tmp / name, group, _producer(tensors))
        if len(groups) > 1:
            total = sum(_numel(i.shape) * torch.empty((), dtype=i.dtype).element_size() for i in items)
            index = {"metadata": {"total_size": total},
                     "weight_map": {i.name: name for name, group in zip(names, groups) for i in group}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        if cfg is not None:
            floats = {i.dtype for i in items if i.dtype.is_floating_point}
            if len(floats) == 1:  # the dtype transformers' dtype="auto" loads: the one written
                cfg.dtype = floats.pop()
            cfg.save_pretrained(tmp)
            source = Path(str(meta.get("pretrained_dir") or "")) / "generation_config.json"
            if meta.get("pretrained_dir") and source.is_file():  # the fine-tuned checkpoint's generation defaults
                shutil.copyfile(source, tmp / "generation_config.json")
        if tok is not None:
            tok.save_pretrained(str(tmp))
    return f"exported {len(items)} tensors in {len(groups)} file(s) to {out}: {kind}{merged}"


def _export_adapter(checkpoint: Path, out: Path, meta: dict[str, Any], *, dtype: str,
                    tokenizer: str | Path | None) -> str:
    """``--adapter``: a LoRA run's PEFT adapter directory (``lora_export.py``)."""
    tensors = CheckpointTensors(checkpoint)
    if not tensors.adapted():
        raise ConfigError(f"export --adapter: {checkpoint} holds no LoRA adapters (the run had no model.lora.rank); "
                          "export the model without --adapter")
    if not meta.get("hf_config"):
        raise ConfigError(f"export --adapter: {checkpoint} is not a Hugging Face model's (model=hf_causal_lm), so "
                          "no base model exists for PEFT to load the adapter onto; export the merged model without "
                          "--adapter")
    facts = _lora_facts(meta, checkpoint)
    items, targets = adapter_layout(tensors, meta["hf_config"], meta.get("hf_module_prefix", ""), facts)
    items = _cast(items, dtype)
    tokenizer = tokenizer or meta.get("tokenizer_dir")
    tok = _load_tokenizer(Path(tokenizer)) if tokenizer else None
    base = meta.get("pretrained_dir") or None
    with _staged(out) as tmp:
        write_safetensors(tmp / lora_export.ADAPTER_WEIGHTS, items, _producer(tensors))
        config = lora_export.adapter_config(facts, targets, base)
        (tmp / lora_export.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tok is not None:
            tok.save_pretrained(str(tmp))
    onto = f"onto {base}" if base else ("onto the run's own base (built from a config, not model.pretrained: "
                                         "export the merged model to keep it)")
    return (f"exported {len(items)} tensors to {out}: PEFT LoRA adapter (r={facts.rank}, alpha={facts.alpha:g}, "
            f"targets {targets if isinstance(targets, str) else ','.join(targets)}), {onto}")


def _lora_facts(meta: dict[str, Any], checkpoint: Path) -> lora_export.LoRAFacts:
    facts = lora_export.facts_of_checkpoint(meta)
    if facts is None:
        raise ConfigError(f"export: {checkpoint} holds LoRA adapters but records no lora rank and alpha (meta.pt's "
                          "lora or hyper_parameters.lora), so they cannot be merged")
    return facts


def _checked_paths(checkpoint: str | Path, out: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """The checkpoint (a complete lightning_par checkpoint directory) and the output directory (new, empty,
    or ``overwrite``), or one line."""
    checkpoint, out = Path(checkpoint), Path(out).resolve()
    if checkpoint.is_file():
        raise ConfigError(f"export: {checkpoint} is a single-file checkpoint; export reads lightning_par's checkpoint "
                          "directories (resume the file under an lp_ strategy with callbacks.export.at_end=true)")
    if not checkpoint.exists():
        raise ConfigError(missing_checkpoint(checkpoint))
    check_checkpoint(checkpoint)
    if out == Path.cwd().resolve() or out in checkpoint.resolve().parents or out == checkpoint.resolve() \
            or out == Path(out.anchor):
        raise ConfigError(f"export: {out} is the current directory, a root, or holds the checkpoint; name a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"export: {out} exists and is not empty (pass --overwrite to replace it)")
    return checkpoint, out


def _cast(items: list[OutTensor], dtype: str) -> list[OutTensor]:
    """``--dtype``: floating tensors written in ``dtype`` (``keep``: as they are)."""
    cast = _CAST[dtype]
    if cast is None:
        return items
    return [OutTensor(i.name, i.shape, cast if i.dtype.is_floating_point else i.dtype, i.sources, i.combine)
            for i in items]


def _producer(tensors: CheckpointTensors) -> Callable[[OutTensor], torch.Tensor]:
    def produce(item: OutTensor) -> torch.Tensor:
        t = item.combine([tensors.read(s) for s in item.sources])
        return t.to(item.dtype)

    return produce


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write into, renamed to ``out`` (replacing it) when the block
    ends, removed if it raises: an interrupted export never leaves a directory that looks complete."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    _remove_dead_partials(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        why = "a path above it is a file" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e
        raise ConfigError(f"export: cannot write {out} ({why})") from None
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def missing_checkpoint(checkpoint: Path) -> str:
    """The line for a checkpoint path that does not exist: the checkpoints its directory does hold, or,
    when the run wrote none, how to get one."""
    folder = checkpoint.parent
    found = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    if found:
        return f"export: checkpoint {checkpoint} does not exist; {folder} holds {', '.join(found[-5:])}"
    return (f"export: checkpoint {checkpoint} does not exist, and {folder} holds no checkpoint. A run writes "
            "<run dir>/checkpoints/stepNNNNNN.ckpt every callbacks.checkpoint.every_n_train_steps steps and at its "
            "last step when checkpointing is on: a fine-tune (model.pretrained=DIR) by default, any other run "
            "with callbacks=checkpoint; or export as training ends with callbacks.export.at_end=true")


def _remove_dead_partials(out: Path) -> None:
    """Remove what a killed export (SIGKILL runs no cleanup) left beside ``out``: ``.OUT.partial-PID``
    directories whose process is gone. A live export's directory (another process writing ``out``) stays."""
    if not out.parent.is_dir():
        return
    for path in out.parent.glob(f".{out.name}.partial-*"):
        pid = path.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def save_pretrained(trainer: Any, out: str | Path, *, dtype: str = "keep", max_shard_bytes: int = 5 * 2**30) -> str:
    """Write the trainer's model as a transformers directory (``export``'s layouts), from every rank
    (collective): the model is saved as a sharded checkpoint (weights only) beside ``out``, global
    rank 0 exports it tensor by tensor and removes it. transformers' own ``model.save_pretrained(DIR)``
    also works on a model that FSDP, ZeRO-3 or tensor parallelism has sharded, called on every rank
    (``parallel/hf/save.py``: it streams the tensors without a checkpoint on disk); this one also takes a
    model cut into pipeline stages, replaces ``out`` as a whole (an interrupted save leaves nothing that
    looks complete), copies the run's tokenizer and casts (``dtype``). Returns the export's line on
    every rank; raises its error on every rank."""
    from lightning_par.strategies.checkpoint.dcp import DistributedCheckpointMixin

    strategy = trainer.strategy
    if not isinstance(strategy, DistributedCheckpointMixin):
        raise ConfigError(f"save_pretrained needs a lightning_par strategy (lp_*); {type(strategy).__name__} "
                          "saves Lightning's own checkpoint files")
    out = Path(strategy.broadcast(str(out)))
    staging = out.parent / f".{out.name}.checkpoint"
    trainer.save_checkpoint(staging, weights_only=True)
    result = ""
    if trainer.is_global_zero:
        try:
            result = export(staging, out, max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=True)
        except Exception as e:  # noqa: BLE001 - every rank raises it below, none waits forever
            result = f"error: {type(e).__name__}: {e}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    result = strategy.broadcast(result)
    if result.startswith("error: "):
        raise RuntimeError(f"save_pretrained to {out} failed: {result.removeprefix('error: ')}")
    return result


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for a bad directory
        raise ConfigError(f"export: tokenizer {directory} cannot be loaded ({' '.join(str(e).split())[:200]})") from None


def size_bytes(text: str | int) -> int:
    """``5GB``, ``500MB``, ``64KiB`` or a number of bytes; one line otherwise."""
    try:
        return text if isinstance(text, int) and not isinstance(text, bool) else _size(str(text))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"export: max_shard_size={e}") from None


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1000000")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-par-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (<run dir>/checkpoints/stepNNNNNN.ckpt)")
    parser.add_argument("out", help="the transformers directory to write (must not exist, or be empty)")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(_CAST), default="keep", help="cast floating tensors (default keep)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory to copy (default: the run's, if any)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its PEFT adapter directory (adapter_model.safetensors, "
                             "adapter_config.json) instead of the merged model")
    args = parser.parse_args(argv)
    # DCP says once that it loads in one process without a process group: that is the point here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    quiet_third_party_logs()
    try:
        print(export(args.checkpoint, args.out, max_shard_bytes=args.max_shard_size, dtype=args.dtype,
                     tokenizer=args.tokenizer, overwrite=args.overwrite, adapter=args.adapter))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a file vanishing underneath
        print(f"error: export failed, nothing written to {args.out}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
