"""Command-line flags generated from a config dataclass's fields: a flag's name, help, parser default
and parsing live on the field it sets, so the flag cannot drift from the field (issue #28).

A field declares its flag with :func:`flag` (several flags setting one field: :func:`flag_group`), or
that it has none and where its value comes from instead with :func:`no_flag`. :func:`add_flags` adds
the declared flags to an ``argparse`` parser, in field order; a field that declares neither is a
``TypeError`` there, so a new field cannot be left without a flag by accident. :func:`from_args`
builds the dataclass back from the parsed namespace:

* the namespace keeps argparse's own names (``--drain-timeout`` → ``args.drain_timeout``), so code
  that reads a flag before the config exists reads it as before;
* ``parse`` turns a given value into the field's (``"0,1"`` → ``(0, 1)``); it may raise
  ``ValueError`` naming the flag, which a daemon reports as a usage error (exit status 2);
* a value that is ``None`` after parsing means "not given": the field takes ``fallbacks[name]`` when
  the caller has one (omni-worker: the stage YAML's value), else the dataclass default;
* ``overrides`` set fields outright (values that come from elsewhere, such as a pipeline file).

The parser's default is the field's default unless the flag says otherwise (``cli_default``; None for
a flag whose absence defers to a fallback). Plain Python, no imports of ours: any daemon's config can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Iterator, Mapping

_KEY = "omnirelay.config_flags"


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field is given on the command line. ``help`` is the field's documentation too."""

    name: str                                   # the option string, e.g. "--drain-timeout"
    help: str
    parse: Callable[[Any], Any] | None = None   # given value → field value (None: not given)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # add_argument's keywords
    # A field set by several flags (LoRA): ``add`` adds them all, ``read`` builds the field's value
    # from the namespace (None: not given); ``also`` names the other option strings.
    add: Callable[[argparse.ArgumentParser], None] | None = None
    read: Callable[[argparse.Namespace], Any] | None = None
    also: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.also)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class NoFlag:
    """A field with no flag of its own: ``doc`` documents it, ``source`` says where its value comes from."""

    doc: str
    source: str


def flag(name: str, help: str, *, default: Any = dataclasses.MISSING,
         default_factory: Any = dataclasses.MISSING, parse: Callable[[Any], Any] | None = None,
         cli_default: Any = dataclasses.MISSING, **options: Any) -> Any:
    """A dataclass field set by the flag ``name``. ``default``/``default_factory``: the field's;
    ``cli_default``: the parser's when it differs from the field's (None: a flag that may be left
    out for a fallback); ``options`` go to ``add_argument`` (``type``, ``choices``, ``action``,
    ``required``, ``metavar``)."""
    if cli_default is not dataclasses.MISSING:
        options["default"] = cli_default
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_KEY: Flag(name, help, parse, options)})


def flag_group(names: tuple[str, ...], help: str, *, add: Callable[[argparse.ArgumentParser], None],
               read: Callable[[argparse.Namespace], Any], default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field set by the flags ``names`` together, which ``add`` declares and ``read`` reads."""
    return dataclasses.field(default=default, metadata={_KEY: Flag(names[0], help, add=add, read=read,
                                                                   also=tuple(names[1:]))})


def no_flag(doc: str, source: str, *, default: Any = dataclasses.MISSING,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field without a flag, deliberately: ``source`` says what sets it."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: NoFlag(doc, source)})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field, Flag | NoFlag]]:
    """Each field of the dataclass ``cls`` with its declaration; ``TypeError`` for a field without one."""
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(_KEY)
        if not isinstance(spec, (Flag, NoFlag)):
            raise TypeError(f"{cls.__name__}.{field.name} declares neither a flag (config_flags.flag) nor "
                            "why it has none (config_flags.no_flag)")
        yield field, spec


def flags(cls: type) -> dict[str, Flag]:
    """Field name → its flag, for the fields of ``cls`` that have one."""
    return {field.name: spec for field, spec in declared(cls) if isinstance(spec, Flag)}


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              only: tuple[str, ...] | None = None) -> None:
    """Add the flags of the dataclass ``cls``'s fields to ``parser`` (or an argument group), in field
    order; ``only``: those of these fields alone (a launcher passing them on as they are)."""
    unknown = set(only or ()) - {field.name for field in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    for field, spec in declared(cls):
        if isinstance(spec, NoFlag) or (only is not None and field.name not in only):
            continue
        if spec.add is not None:
            spec.add(parser)
            continue
        options = dict(spec.options)
        if "default" not in options and not options.get("required"):
            if field.default is not dataclasses.MISSING:
                options["default"] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                options["default"] = field.default_factory()
        # argparse formats help with %: a literal one in the text must not be read as a placeholder.
        parser.add_argument(spec.name, help=spec.help.replace("%", "%%"), **options)


def from_args(cls: type, args: argparse.Namespace, *, fallbacks: Mapping[str, Any] | None = None,
              **overrides: Any) -> Any:
    """The dataclass ``cls`` from ``args`` (parsed by a parser :func:`add_flags` filled): see the
    module docstring for how a field's value is chosen. Raises what ``parse``, ``read`` and the
    dataclass's own validation raise."""
    fallbacks = fallbacks or {}
    values: dict[str, Any] = {}
    for field, spec in declared(cls):
        if field.name in overrides or isinstance(spec, NoFlag):
            continue
        value = spec.read(args) if spec.read is not None else getattr(args, spec.dest)
        if value is not None and spec.parse is not None:
            value = spec.parse(value)
        if value is not None:
            values[field.name] = value
        elif field.name in fallbacks:
            values[field.name] = fallbacks[field.name]
    return cls(**values, **overrides)
