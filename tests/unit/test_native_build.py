"""Building our kernels (models/native.py): one process at a time builds or checks a kernel's folder, under
a lock that dies with its holder, so a build killed midway (whose torch lock file stays behind) never makes
a later load wait forever, and a process that does wait for another's build says so."""
from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
import sys
import time

import pytest
import torch

from specstack.models import native

LOAD = "from specstack.models import native; print(native.load('attention'))"


def test_a_build_killed_midway_never_hangs_a_later_load(tmp_path):
    if not native.supported("attention"):
        pytest.skip("this CPU builds no attention kernel")
    cache = tmp_path / "cache"
    folder = cache / "kernels" / torch.__version__ / "attention"
    built = native.build_dir("attention")
    if any(built.glob("*.so")):
        shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock", "specstack.lock"))
    else:
        folder.mkdir(parents=True)
    (folder / "lock").touch()  # what torch's builder leaves when its process is killed while building
    with open(folder / "specstack.lock", "a") as held:  # another live process building it
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", LOAD], env={**os.environ, "SPECSTACK_CACHE": str(cache)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:  # it says that it waits for the live holder (however long its imports take)...
            said, deadline = "", time.monotonic() + 300
            while "waiting for another process building the attention kernel" not in said:
                assert time.monotonic() < deadline and proc.poll() is None, f"it never waited: {said!r}"
                if select.select([proc.stderr], [], [], 0.5)[0]:
                    said += proc.stderr.readline()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    try:
        out, err = proc.communicate(timeout=300)  # ...and then loads, never waiting on the dead one's file
    finally:
        proc.kill()
    assert out.strip() == "True", err
    assert not (folder / "lock").exists()
