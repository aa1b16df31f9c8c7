"""Which allocator the Kafka ingest's Arrow buffers come from.

pyarrow's default pool is mimalloc (pyarrow 26). In the Kafka ingest, whose consumer thread
builds each batch's columns while kafka-python's IO thread receives the next fetch and the
writer thread inserts and drops the batch before, mimalloc's memory kept coming back as fresh
2 MB huge pages: ``perf`` put 48 % of the consumer thread's time in the kernel zeroing them
(``clear_page_erms`` under ``do_huge_pmd_anonymous_page``, faulted from
``mi_page_free_list_extend``), and the decoding cost 0.79-0.87 s of CPU per 320,000 GPU rows
(0.45-0.54 s of it in the kernel) against 0.33 s for the same packs decoded alone. With
jemalloc or the system allocator it cost 0.37-0.44 s (0.05-0.12 s in the kernel), and the
end-to-end run took 0.98-1.13 s instead of 1.37-1.41 s (a session's script timing the ingest
of ``python -m bench ingest``; the bench's own figures in docs/benchmarks.md). mimalloc's own settings did not help: purging never
(``MIMALLOC_PURGE_DELAY=-1``) 0.82-0.83 s, no large OS pages 0.85-0.91 s.

An operator's own choice (``ARROW_DEFAULT_MEMORY_POOL``) is left as it is, where it names a
pool this pyarrow has (else Arrow falls back to its default: warned, and replaced).
"""

from __future__ import annotations

import logging
import os

import pyarrow as pa

log = logging.getLogger(__name__)

# Arrow's environment variable naming the default pool ("jemalloc", "mimalloc", "system")
POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_ingest_pool() -> str:
    """Makes jemalloc (the system allocator where this pyarrow has no jemalloc) Arrow's default
    pool for what is allocated from now on, unless :data:`POOL_ENV` names one it has; returns the
    backend in use. Buffers allocated before keep their pool and are freed to it."""
    asked = os.environ.get(POOL_ENV)
    if asked in pa.supported_memory_backends():
        return str(pa.default_memory_pool().backend_name)
    if asked:  # Arrow said "Unsupported backend" and fell back to its default: not the operator's choice
        log.warning("%s=%r is no memory pool this pyarrow has (%s); using jemalloc or the system's",
                    POOL_ENV, asked, ", ".join(pa.supported_memory_backends()))  # fmt: skip
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc (some platforms' wheels)
        pool = pa.system_memory_pool()
    current = pa.default_memory_pool().backend_name
    if current != pool.backend_name:
        log.debug("Arrow's memory pool: %s instead of %s", pool.backend_name, current)
        pa.set_memory_pool(pool)
    return str(pool.backend_name)
