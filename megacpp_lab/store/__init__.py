"""Table stores behind the one contract of megacpp_lab.nn.table_store.

``TableStore`` (in nn/) holds every Engram rule: create-only populate with rollback, bounds checks, keys
``engram:l{layer}:h{head}``. A backend only moves bytes. The in-process backend is
``megacpp_lab.nn.table_store.InProcessBackend``; ``megacpp_lab.store.mooncake`` puts the tables in a
Mooncake store (the optional ``mooncake`` extra and the system library libibverbs1).

Nothing is imported here, so importing this package needs neither Mooncake nor libibverbs.
"""

__all__: list[str] = []
