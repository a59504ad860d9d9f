"""Named API keys: a file the operator rewrites to add, rotate or revoke clients' keys.

Two formats, told apart by the first character:

    # one client a line: NAME KEY
    billing-app   3f9c0c1e6a0d4b7e9a51...
    kiosk-2       b7d41e0c92aa...

    [{"name": "billing-app", "key": "3f9c..."}, {"name": "kiosk-2", "key": "b7d4..."}]
    (or {"billing-app": "3f9c...", ...})

A name is what the access log and the per-client metrics show (never the key), so it is
kept to label-safe characters. The server re-reads the file when its modification time,
size or inode changes (one stat per authorized request), so a rotation needs no restart;
a file that became unreadable or invalid keeps the keys last read and is logged, because
locking every client out on a half-written file is worse than honouring a revoked key a
little longer (write it with a rename, as Ansible's copy does, and that never happens).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading

log = logging.getLogger("appliance.auth")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
MIN_KEY_LENGTH = 8
SINGLE_KEY_NAME = "api_key"        # the client name of the `api_key` setting's key


class KeyFileError(ValueError):
    """The key file cannot be used; the message is one line naming the file and the entry."""


def _digest(key: str) -> bytes:
    # Keys are looked up by their hash: a dict lookup on digests tells a timing attacker
    # nothing about the keys themselves.
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str = "api_keys_file") -> dict[str, str]:
    """{name: key} from the text of a key file; KeyFileError on anything ambiguous."""
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise KeyFileError(f"{source}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            entries = list(data.items())
        else:
            entries = []
            for i, item in enumerate(data):
                if not isinstance(item, dict) or set(item) - {"name", "key"} or not {"name", "key"} <= set(item):
                    raise KeyFileError(f"{source}: entry {i + 1}: expected {{\"name\": ..., \"key\": ...}}")
                entries.append((item["name"], item["key"]))
        where = [f"entry {i + 1}" for i in range(len(entries))]
    else:
        entries, where = [], []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise KeyFileError(f"{source}: line {number}: expected 'NAME KEY'")
            entries.append((parts[0], parts[1]))
            where.append(f"line {number}")
    keys: dict[str, str] = {}
    seen: dict[str, str] = {}
    for (name, key), at in zip(entries, where):
        if not isinstance(name, str) or not NAME.match(name):
            raise KeyFileError(f"{source}: {at}: name {name!r}: use letters, digits and _.@- (at most 64)")
        if not isinstance(key, str) or len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
            raise KeyFileError(f"{source}: {at}: the key of {name!r} must be at least {MIN_KEY_LENGTH} "
                               f"characters without spaces")
        if name in keys:
            raise KeyFileError(f"{source}: {at}: the name {name!r} is given twice")
        if key in seen:
            raise KeyFileError(f"{source}: {at}: {name!r} has the same key as {seen[key]!r}")
        keys[name], seen[key] = key, name
    return keys


def read_keys(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise KeyFileError(f"api_keys_file: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"api_keys_file: {path!r} is not UTF-8 text") from None
    return parse_keys(text, f"api_keys_file {path}")


class KeyRing:
    """Who a bearer token belongs to: the single `api_key` and every key of the file."""

    def __init__(self, api_key: str | None = None, path: str | None = None):
        self.path = path
        self._single = {_digest(api_key): SINGLE_KEY_NAME} if api_key else {}
        self._by_digest: dict[bytes, str] = {}
        self._signature = None
        self._lock = threading.Lock()
        if path is not None:
            self._load(self._stat(), strict=True)

    @property
    def required(self) -> bool:
        """A key is asked for as soon as either source is configured, even a file listing none."""
        return bool(self._single) or self.path is not None

    def names(self) -> list[str]:
        self._refresh()
        return sorted(set(self._single.values()) | set(self._by_digest.values()))

    def client(self, token: str) -> str | None:
        """The client name of a token, or None when it is no current key."""
        self._refresh()
        digest = _digest(token)
        return self._single.get(digest) or self._by_digest.get(digest)

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _refresh(self) -> None:
        if self.path is None:
            return
        signature = self._stat()
        if signature != self._signature:
            with self._lock:
                if signature != self._signature:
                    self._load(signature, strict=False)

    def _load(self, signature, strict: bool) -> None:
        try:
            keys = read_keys(self.path)
        except KeyFileError as e:
            if strict:
                raise
            log.error("%s; keeping the %d keys read before", e, len(self._by_digest))
        else:
            self._by_digest = {_digest(key): name for name, key in keys.items()}
            if self._signature is not None:
                log.info("api_keys_file %s re-read: %d keys (%s)", self.path, len(keys), ", ".join(sorted(keys)))
        self._signature = signature
