"""YAML the way people write Compose files by hand, for the renderer's templates: a command as
a block list (one argument a line), an environment as a block map, and an argument that is a
long JSON document (vLLM's ``--kv-transfer-config``) folded over lines of at most
:data:`WIDTH` characters (``>-``: YAML joins them with a space, which JSON ignores). Every
value reads back as the string it is: unquoted where YAML reads it so, else a JSON string
(a YAML double-quoted scalar), so nothing is read as a number, boolean or null."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

import yaml

WIDTH = 100  # characters of text a line, after its indentation
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_SINGLE_SPACE = re.compile(r"(?<! ) (?! )")
_YAML11_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _folded(text: str, indent: int) -> str | None:
    """``text`` (one line, no leading or trailing space) as a ``>-`` block scalar whose
    lines break at single spaces, or None when it cannot be folded back to itself."""
    lines: list[str] = []
    for word in _SINGLE_SPACE.split(text):
        if lines and len(lines[-1]) + 1 + len(word) <= WIDTH:
            lines[-1] += " " + word
        else:
            lines.append(word)
    pad = " " * indent
    block = ">-\n" + "\n".join(pad + line for line in lines)
    try:
        back = yaml.safe_load("x: " + block)["x"]
    except yaml.YAMLError:
        return None
    return block if back == text else None


def scalar(value: object, indent: int) -> str:
    """``value`` as a YAML string: a JSON string, or, for a JSON document longer than
    :data:`WIDTH`, that document with a space after each ``,`` and ``:`` folded over lines
    indented by ``indent``."""
    text = str(value)
    if len(text) > WIDTH and text[:1] in "{[":
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if doc is not None:
            spaced = json.dumps(doc, separators=(", ", ": "))
            block = _folded(spaced, indent)
            if block is not None:
                return block
    if _plain_ok(text):
        return text
    if '"' in text and "'" not in text and text.isprintable():
        return f"'{text}'"  # single-quoted: JSON's quotes stay as they are
    return json.dumps(text)


def _plain_ok(text: str) -> bool:
    """Whether ``text`` reads back as this very string unquoted (``--port``, ``vllm``; not
    ``8100``, ``true``, ``a: b`` or ``{...}``)."""
    if not text or text != text.strip() or len(text) > WIDTH or "\n" in text:
        return False
    try:
        return bool(yaml.safe_load(f"x: {text}") == {"x": text})
    except yaml.YAMLError:
        return False


def yaml_list(items: Iterable[object], indent: int) -> str:
    """A block sequence of strings at ``indent`` spaces, starting with a line break (after
    its key's colon); ``[]`` when empty."""
    pad = " " * indent
    lines = [f"\n{pad}- {scalar(item, indent + 2)}" for item in items]
    return "".join(lines) if lines else " []"


def _plain(key: str) -> bool:
    return bool(_PLAIN_KEY.match(key)) and key.lower() not in _YAML11_WORDS


def yaml_map(values: Mapping[str, object], indent: int) -> str:
    """A block mapping of strings at ``indent`` spaces, starting with a line break; ``{}``
    when empty."""
    pad = " " * indent
    lines = [f"\n{pad}{key if _plain(key) else json.dumps(key)}: "
             f"{scalar(value, indent + 2)}" for key, value in values.items()]
    return "".join(lines) if lines else " {}"
