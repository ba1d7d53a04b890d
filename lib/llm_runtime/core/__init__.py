"""The engine core's books: a request's sequences (`sequence.py`), the scheduler that chooses each step's work
(`scheduler.py`), and the KV blocks it hands out (`block_manager.py`) and names for reuse (`prefix_cache.py`).
Nothing here touches a device: the core decides, the executor below runs."""
