"""The LoRA flags shared by omni-serve, omni-worker and omni-gateway (vLLM's names), and their
parsing; plain Python (no torch) so the gateway and the launcher import it cheaply.

``--enable-lora`` turns LoRA on; nothing about it exists without it (a flag below without it is an
error). ``--lora-modules`` (repeatable) takes one or more ``name=path`` or vLLM's JSON form
``{"name": ..., "path": ..., "base_model_name": ...}``; ``base_model_name`` picks which served model
an adapter belongs to (default: the first). ``--max-loras``: adapters resident at once per worker;
``--max-lora-rank``: the largest rank accepted; ``--max-cpu-loras``: adapters kept read in host
memory (at least ``--max-loras``). ``--allow-runtime-lora-updating`` (gateway and omni-serve) serves
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, as vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str = ""   # "": the first served model


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0      # 0: as many as max_loras
    allow_runtime_updating: bool = False

    def modules_for(self, model_name: str, first: bool) -> dict[str, str]:
        """name → path of the adapters of ``model_name`` (``first``: it is the first served model)."""
        return {m.name: m.path for m in self.modules
                if m.base_model_name == model_name or (not m.base_model_name and first)}


def parse_module(text: str) -> LoraModule:
    """One ``--lora-modules`` value; ``ValueError`` naming the flag when malformed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: not JSON: {exc}") from None
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules: JSON form needs string name and path (and optionally "
                             f"base_model_name), got {text!r}")
        name, path, base = raw["name"], raw["path"], raw.get("base_model_name") or ""
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: expected name=path or JSON, got {text!r}")
        base = ""
    if not name or not path:
        raise ValueError(f"--lora-modules: empty name or path in {text!r}")
    return LoraModule(name, os.path.abspath(path), base)


def add_arguments(parser: argparse.ArgumentParser, *, gateway: bool = False) -> None:
    group = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (off by default)")
    # nargs="+" as vLLM takes it (--lora-modules a=p b=q), and repeatable (--lora-modules a=p --lora-modules b=q).
    group.add_argument("--lora-modules", action="extend", nargs="+", default=None, metavar="NAME=PATH|JSON",
                       help="adapters: name=path or '{\"name\": .., \"path\": .., \"base_model_name\": ..}', "
                            "one or more per flag; repeatable")
    group.add_argument("--max-loras", type=int, default=None, help="adapters resident per worker at once (default 1)")
    group.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default 16)")
    group.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default --max-loras)")
    if gateway:
        group.add_argument("--allow-runtime-lora-updating", action="store_true",
                           help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")


def options_from_args(args: argparse.Namespace) -> LoraOptions | None:
    """The LoRA options, or None without ``--enable-lora``; ``ValueError`` for a LoRA flag given
    without it or a bad value."""
    given = [flag for flag, value in (("--lora-modules", args.lora_modules), ("--max-loras", args.max_loras),
                                      ("--max-lora-rank", args.max_lora_rank), ("--max-cpu-loras", args.max_cpu_loras),
                                      ("--allow-runtime-lora-updating",
                                       getattr(args, "allow_runtime_lora_updating", False) or None))
             if value is not None]
    if not args.enable_lora:
        if given:
            raise ValueError(f"{given[0]} needs --enable-lora")
        return None
    options = LoraOptions(modules=tuple(parse_module(m) for m in args.lora_modules or ()),
                          max_loras=args.max_loras or 1, max_lora_rank=args.max_lora_rank or 16,
                          max_cpu_loras=args.max_cpu_loras or 0,
                          allow_runtime_updating=bool(getattr(args, "allow_runtime_lora_updating", False)))
    if options.max_loras < 1 or options.max_lora_rank < 1 or options.max_cpu_loras < 0:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1, --max-cpu-loras at least 0")
    names = [m.name for m in options.modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name is given twice: {names}")
    return options


def to_args(options: LoraOptions | None, *, gateway: bool = False) -> list[str]:
    """The flags that give ``options`` to an omni-worker or omni-gateway (what omni-serve passes)."""
    if options is None:
        return []
    out = ["--enable-lora", "--max-loras", str(options.max_loras), "--max-lora-rank", str(options.max_lora_rank)]
    if options.max_cpu_loras:
        out += ["--max-cpu-loras", str(options.max_cpu_loras)]
    for m in options.modules:
        out += ["--lora-modules", json.dumps({"name": m.name, "path": m.path,
                                              **({"base_model_name": m.base_model_name} if m.base_model_name else {})})]
    if gateway and options.allow_runtime_updating:
        out.append("--allow-runtime-lora-updating")
    return out
