"""``rlbus config``: look at a run file as rlbus reads it (``show``), check it (``check``), or write the
configuration reference generated from the typed run file (``doc``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    cp = sub.add_parser("config", help="show a run file with every default resolved, check it, or write docs/CONFIG.md",
                        description="show FILE: the run file as every service reads it (TOML, then RLBUS__ "
                        "variables, then --set), every key with its value, defaults included, as TOML-like text "
                        "(--json: JSON, as config.resolved.json). check FILE: load it and apply the rules between "
                        "sections for its [launcher] layout; exit 0 when it would start, 2 naming the key when not. "
                        "doc: write docs/CONFIG.md, the key reference generated from the typed run file "
                        "(--check: exit 1 when it is stale).")
    cps = cp.add_subparsers(dest="what", required=True, metavar="{show,check,doc}")
    for name, text in (("show", "print the resolved run file"), ("check", "check a run file without starting it")):
        p = cps.add_parser(name, help=text)
        p.add_argument("file", metavar="FILE", help="run file (TOML) or example name")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (repeatable)")
        if name == "show":
            p.add_argument("--json", action="store_true", help="JSON instead of TOML-like text")
    doc = cps.add_parser("doc", help="write docs/CONFIG.md from the typed run file")
    doc.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/CONFIG.md is stale")


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        return '""'
    return json.dumps(value)


def _print_toml(tree: dict[str, Any], path: str = "") -> list[str]:
    """Tables as TOML sections (plain keys first, then each non-empty table as its own section)."""
    tables = {k: v for k, v in tree.items() if isinstance(v, dict) and v}
    plain = {k: v for k, v in tree.items() if k not in tables}
    out = [f"[{path}]"] if path and plain else []
    out += [f"# {k}: unset" if v is None else f"{k} = {_toml_value(v)}" for k, v in plain.items()]
    if plain:
        out.append("")
    for k, v in tables.items():
        out += _print_toml(v, f"{path}.{k}" if path else k)
    return out


def main(args: argparse.Namespace) -> int:
    from services.launcher.config_doc import main as doc_main
    from services.launcher.run_cmd import resolve_target
    from services.launcher.runfile import RunFile

    if args.what == "doc":
        return doc_main(args.check)
    runfile = RunFile.load(resolve_target(args.file), None, args.overrides)
    if args.what == "check":
        derived = runfile.check()
        print(f"{args.file}: ok" + (f" (the launcher sets {', '.join(derived)})" if derived else ""))
        return 0
    resolved = runfile.resolved()
    if args.json:
        json.dump(resolved, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(_print_toml(resolved)).rstrip())
    return 0
