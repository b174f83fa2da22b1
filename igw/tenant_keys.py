"""`igw tenants add-key` / `remove-key`: mint an API key and keep only its salted hash.

The key is printed once and never stored; the keys file (or the Kubernetes
Secret made from it) holds `<tenant> <id> sha256:<salt>:<digest>` lines
(picker.tenants.keys). The file is rewritten atomically with mode 0600, so a
running gateway reads the old or the new file, never half of one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.config import is_tenant_name
from igw_envoy.atomic import write_atomic
from picker.tenants.keys import KeyFileError, mint, parse_keys


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


def add_key(args: argparse.Namespace) -> int:
    if not is_tenant_name(args.tenant):
        print(f"{args.tenant!r}: not a tenant name (letters, digits, '.', '_', '-')",
              file=sys.stderr)
        return 2
    key, stored = mint(args.tenant)
    if args.keys_file is None:
        print(stored.line())  # the line for the keys file; the key goes to stderr
        print(f"API key for {args.tenant} (shown once): {key}", file=sys.stderr)
        return 0
    path: Path = args.keys_file
    try:
        text = _read(path)
        parse_keys(text, str(path))
    except (OSError, KeyFileError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if text and not text.endswith("\n"):
        text += "\n"
    comment = f"  # {args.comment}" if args.comment else ""
    write_atomic(path, (text + stored.line() + comment + "\n").encode(), mode=0o600)
    print(key)
    print(f"added key {stored.key_id} for {args.tenant} to {path}", file=sys.stderr)
    return 0


def remove_key(args: argparse.Namespace) -> int:
    path: Path = args.keys_file
    try:
        text = _read(path)
        keys = parse_keys(text, str(path))
    except (OSError, KeyFileError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if args.key_id not in keys:
        print(f"{path}: no key {args.key_id}", file=sys.stderr)
        return 1
    kept = [line for line in text.splitlines()
            if line.split("#", 1)[0].split()[1:2] != [args.key_id]]
    write_atomic(path, ("\n".join(kept) + "\n" if kept else "").encode(), mode=0o600)
    print(f"removed key {args.key_id} from {path}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    tenants = sub.add_parser("tenants", help="tenant API keys (salted hashes in a keys file)")
    commands = tenants.add_subparsers(dest="tenants_command", required=True)
    p = commands.add_parser("add-key", help="mint a key: print it once, store its hash")
    p.add_argument("tenant")
    p.add_argument("--keys-file", type=Path,
                   help="append the hash line here (else print it on stdout, the key on stderr)")
    p.add_argument("--comment", default="", help="a note kept after the line (who, why)")
    p.set_defaults(func=add_key)
    p = commands.add_parser("remove-key", help="revoke a key by its id (the 12 hex digits)")
    p.add_argument("key_id")
    p.add_argument("--keys-file", type=Path, required=True)
    p.set_defaults(func=remove_key)
