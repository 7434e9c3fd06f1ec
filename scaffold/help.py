"""The `--help` pages of `python -m scaffold.train` and `python -m scaffold.data`, generated from the
schema: each key's type and default come from scaffold/config.py's dataclasses, its description from the
docstring written under the field.

Python keeps no docstrings of fields at run time (they are bare string expressions), so they are read
from the source with `ast`. Hydra prints `hydra.help.template`: `cli.register()` stores each page as
an option of Hydra's `hydra/help` group, which conf/config.yaml (train) and scaffold/data/__main__.py
(data) select.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Iterable

from scaffold.config import RETIRED, Config

WIDTH = 100  # fixed rather than the terminal's: the page is built before Hydra knows where it prints
INDENT = "      "


@dataclass(frozen=True)
class Key:
    name: str  # dotted, as typed on the command line: data.cache_dir
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    prefix: str  # "" for the top level, else e.g. "data."
    doc: str
    keys: tuple[Key, ...]


def field_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(class docstring, {field: docstring}) of a dataclass, from its source; empty where the source
    cannot be read (a build without .py files): the page then lists keys without descriptions."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return "", {}
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    docs = {}
    for field, after in zip(node.body, node.body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(node) or "", docs


def _type_name(t: Any) -> str:
    args = typing.get_args(t)
    if typing.get_origin(t) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " | ".join(_type_name(a) for a in rest) + " | null"
    if t is Any:
        return "any"
    return getattr(t, "__name__", str(t))


def _value(v: Any) -> str:
    """A default as it is typed on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str) and (v == "" or v != v.strip()):
        return repr(v)
    return str(v)


def sections(cls: type = Config, prefix: str = "", doc: str = "") -> list[Section]:
    """The schema's keys, one section per dataclass (the top level first, then each nested one, in
    field order); retired keys (config.RETIRED) are left out."""
    hints = typing.get_type_hints(cls)
    class_doc, docs = field_docs(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        name, t = prefix + f.name, hints[f.name]
        if name in RETIRED:
            continue
        if dataclasses.is_dataclass(t):
            nested += sections(t, f"{name}.", docs.get(f.name, ""))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        keys.append(Key(name, _type_name(t), _value(default), docs.get(f.name, "")))
    return [Section(prefix, doc or class_doc, tuple(keys)), *nested]


def _paragraphs(text: str, indent: str) -> list[str]:
    """Text re-wrapped to the page width; the source's line breaks are its own width's, blank lines
    separate paragraphs."""
    out = []
    for para in text.split("\n\n"):
        out += textwrap.wrap(" ".join(para.split()), WIDTH, initial_indent=indent, subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False)
    return out


def render_keys(keys: Iterable[Key]) -> list[str]:
    lines = []
    for k in keys:
        lines.append(f"  {k.name}: {k.type} = {k.default}")
        lines += _paragraphs(k.doc, INDENT)
    return lines


def render_sections(secs: Iterable[Section]) -> list[str]:
    lines = []
    for s in secs:
        if not s.keys:
            continue
        lines += ["", f"== {s.prefix}* ==" if s.prefix else "== Top-level keys =="]
        if s.doc:
            lines += _paragraphs(s.doc, "  ")
        lines += render_keys(s.keys)
    return lines


def pick(names: Iterable[str]) -> list[Key]:
    """The schema's keys of these dotted names, in the order given."""
    every = {k.name: k for s in sections() for k in s.keys}
    return [every[n] for n in names]


HYDRA_FLAGS = [
    ("--cfg job", "print the config these overrides compose, and exit (--cfg hydra: Hydra's own)"),
    ("--resolve", "with --cfg: resolve interpolations"),
    ("--info", "print Hydra's config search path, defaults list and plugins"),
    ("--hydra-help", "Hydra's own help: all its flags and config groups"),
]


def _flags(flags: list[tuple[str, str]]) -> list[str]:
    return ["== Hydra's flags =="] + [f"  {flag:<16}{what}" for flag, what in flags]


def train_page(presets: dict[str, list[str]] | None = None) -> tuple[str, str]:
    """(header, body) of `python -m scaffold.train --help`; presets are conf/'s groups and options."""
    header = [
        "python -m scaffold.train: train scaffold's 3D U-Net on generated fractal volumes and write per-epoch",
        "statistics (train_stats.csv) to a run directory.",
        "",
        "Usage:",
        "  python -m scaffold.train [key=value ...]               one run, in outputs/<date>/<time>/",
        "  python -m scaffold.train -m key=a,b [key=value ...]    a sweep over every combination, in",
        "                                                         multirun/<date>/<time>/<job number>/",
        "  python -m scaffold.train resume=<run dir> [key=value]  continue a run bit for bit from its last",
        "                                                         checkpoint (e.g. with a larger epochs=N)",
    ]
    body = render_sections(sections())
    if presets:
        body += ["", "== Presets (choose one per group; a search preset runs with -m) =="]
        body += [f"  {group}={option}" for group, options in sorted(presets.items()) for option in options]
    body += ["", *_flags([("-m", "run a sweep (--multirun)"), *HYDRA_FLAGS])]
    return "\n".join(header), "\n".join(body)


def data_page(defining: Iterable[str], other: Iterable[str]) -> tuple[str, str]:
    """(header, body) of `python -m scaffold.data --help`: the keys that define a dataset, then those
    the command also reads that do not change its bytes."""
    header = [
        "python -m scaffold.data: generate (or reuse) the dataset of a training config and say what it holds.",
        "Takes the same config and overrides as python -m scaffold.train; these keys are the ones that matter.",
        "",
        "Usage:",
        "  python -m scaffold.data [key=value ...]     e.g. python -m scaffold.data scale=5 seed=1",
    ]
    body = ["", "== Keys that define the dataset ==",
            *_paragraphs("A dataset is one file in data.cache_dir, named by a hash of these keys: a "
                         "training run with the same values reuses it.", "  "),
            *render_keys(pick(defining)),
            "", "== Where and how fast (the same bytes whatever their values) ==",
            *render_keys(pick(other)),
            "", *_flags(HYDRA_FLAGS)]
    return "\n".join(header), "\n".join(body)


def escape(text: str) -> str:
    """Text that survives Hydra's two passes over the help template unchanged: OmegaConf resolves
    `${...}` interpolations, then string.Template substitutes `$NAME` (and fails on a stray `$`)."""
    return text.replace("$", "$$").replace("${", "\\${")


def hydra_help_node(app_name: str, header: str, body: str) -> dict[str, str]:
    """A `hydra/help` option printing header and body; the template keeps Hydra's layout of
    header/footer references, so `hydra.help.header=...` still replaces the header."""
    return {"app_name": escape(app_name), "header": escape(header), "footer": "",
            "template": "${hydra.help.header}\n" + escape(body) + "\n${hydra.help.footer}"}
