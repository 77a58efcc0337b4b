"""The engine's one thread and its OpenMP team: every torch operation of the resident model runs on a single
``miserver-engine`` thread, the only one whose torch work runs on several OpenMP threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def new_executor(threads: int | None = None) -> ThreadPoolExecutor:
    """The engine's one thread; with ``threads``, its forward passes run on that many OpenMP threads."""
    if threads is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="miserver-engine")
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="miserver-engine", initializer=torch.set_num_threads, initargs=(threads,)
    )


#: torch's thread count before the first engine started here left every other thread one (see
#: :func:`one_openmp_team`): the default of every engine of the process, a model loaded later included.
_threads_at_first_start: int | None = None


def engine_threads(threads: int | None) -> int:
    """The OpenMP threads of an engine's forward passes: ``threads``, else torch's count before any engine started."""
    global _threads_at_first_start
    if _threads_at_first_start is None:
        _threads_at_first_start = torch.get_num_threads()
    return threads if threads is not None else _threads_at_first_start


def one_openmp_team(executor: ThreadPoolExecutor) -> None:
    """Leave the engine thread the only one whose torch work runs on several OpenMP threads: every other thread (the
    event loop's, those started later) gets one from now on. GNU libgomp spins between parallel regions only while
    the threads of all its teams fit the cores; a second team of two threads on two cores (one torch operation on
    the event loop was enough) made it sleep at once, and a decode step cost twice as much (30 against 57 ms here,
    about 600 regions a step), for the rest of the process. Waits for ``executor``'s thread to have started."""
    executor.submit(torch.get_num_threads).result()
    torch.get_num_threads()  # this thread's torch threads are set up now, then set to one
    torch.set_num_threads(1)
