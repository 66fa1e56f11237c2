"""Keeping secrets out of logs, config dumps and `astraflow config`.

Three things count as secret: every value a process registered (`register_secret`: a SASL
password once a client config is built from it), the value of any field whose name says it is
one (`password`, `secret`, `token`, `api_key`, `credentials`, ...), and the password part of a
URL (`s3://user:pass@host/...`, also inside longer text). `redact_tree` masks them in a config
dump; `install_log_redaction` masks them in every log record this process makes (message and
traceback), whatever handler later writes it.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

MASK = "**********"

_KNOWN: set[str] = set()
_LOCK = threading.Lock()
# Field names are split at '.', '_' and '-': a part from this set makes the field secret
# (`sasl_password`, `ssl.key.password`, `aws_secret_access_key`, `api-key`), `max_tokens` is not.
_SECRET_PARTS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "apikey", "credential", "credentials", "jaas"})
_PARTS = re.compile(r"[._-]+")
# scheme://user:password@host -> scheme://user:**********@host. The password runs to the first
# '@' (a literal '@' in a URL password must be percent-encoded); '/' and '+' are allowed since
# cloud secret keys contain them.
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s]+?)@")
# key=value / key: value / "key": "value" inside free text; the key is then checked by its parts.
_KV = re.compile(r"(?P<key>[A-Za-z][\w.-]*)(?P<sep>\"?\s*[=:]\s*\"?)(?P<val>[^\s\"',;&]+)")


def register_secret(value: str | None) -> None:
    """Masks `value` wherever it later appears in a log record or a redacted text."""
    if value and len(value) >= 4:  # shorter ones would mask common words
        with _LOCK:
            _KNOWN.add(value)


def redact_url(url: str) -> str:
    """`s3://user:pass@bucket/x` -> `s3://user:**********@bucket/x`; other URLs unchanged."""
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", url)


def redact_text(text: str) -> str:
    """Masks URL passwords, `password=...`-style pairs and every registered secret in `text`."""
    text = redact_url(text)
    text = _KV.sub(lambda m: f"{m['key']}{m['sep']}{MASK}" if is_secret_key(m["key"]) else m[0], text)
    with _LOCK:
        known = sorted(_KNOWN, key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, MASK)
    return text


def is_secret_key(key: str) -> bool:
    parts = [p.lower() for p in _PARTS.split(key) if p]
    joined = "".join(parts)
    # `basic.auth.user.info` (a schema registry's `user:password`) names no secret word: its whole value is one.
    return any(p in _SECRET_PARTS for p in parts) or any(w in joined for w in ("apikey", "privatekey", "userinfo"))


def redact_tree(obj: Any) -> Any:
    """A copy of a JSON-like tree with secret fields masked and every string redacted."""
    if isinstance(obj, dict):
        return {
            k: (MASK if is_secret_key(str(k)) and v not in (None, "", MASK) else redact_tree(v)) for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact_tree(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


_installed = False


def install_log_redaction() -> None:
    """Makes every LogRecord of this process carry a redacted message and traceback (idempotent)."""
    global _installed
    with _LOCK:
        if _installed:
            return
        _installed = True
    base = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = base(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed format string: leave it to logging's own error report
            return record
        clean = redact_text(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return record

    logging.setLogRecordFactory(factory)
