"""The serving process's heap setting (kvd/engine/heap.py), in a process of
its own: it lasts as long as the process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvd.engine.heap import glibc

# A 64 MiB block allocated, written and freed, then the same again (malloc
# itself: numpy asks the kernel for huge pages, which hide the faults): the
# minor page faults of the second round, before and after the setting.
SCRIPT = """
import ctypes, json, resource
from kvd.engine.heap import keep_freed_memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def one_block():
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)

def faults_of_a_second_block():
    one_block()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_block()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_a_second_block()
kept = keep_freed_memory()
print(json.dumps({"default": default, "kept": kept, "after": faults_of_a_second_block()}))
"""


@pytest.mark.skipif(glibc() is None, reason="the setting is glibc's malloc's")
def test_a_freed_block_is_reused_not_faulted_in_again() -> None:
    """By default glibc maps a large block afresh each time, so writing it
    faults its pages in again; once the heap keeps freed memory, the next
    block of the size reuses the last one's pages."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    figures = json.loads(out.stdout)
    assert figures["kept"] is True
    # 16,384 with 4 KiB pages; 32 where the kernel gives huge pages anyway.
    assert figures["default"] >= 32, figures
    assert figures["after"] <= figures["default"] // 10, figures
