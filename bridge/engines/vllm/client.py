"""A thin client over a synchronous ``vllm.LLM``: the four weight-sync phases as ``collective_rpc`` calls.

It has the methods of vLLM's ``VLLMWeightSyncClient`` protocol, so a trainer that holds
the ``LLM`` in its own process drives the workers through it. ``AsyncLLM``, vLLM's HTTP
client (``HTTPVLLMWeightSyncClient``) or any object with the same four methods serve as well.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LLMClient"]

log = logging.getLogger("bridge")


class LLMClient:
    """Drives ``llm``'s workers: ``init_weight_transfer_engine`` ... ``finish_weight_update``.

    Calls block until every worker returned; a worker's exception is raised here.
    """

    def __init__(self, llm: Any) -> None:
        if not hasattr(llm, "collective_rpc"):
            raise TypeError(f"llm must be a vllm.LLM (with collective_rpc), got {type(llm).__name__}.")
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Ends the update and clears the prefix cache, whose blocks hold keys and values of the old weights."""
        self.llm.collective_rpc("finish_weight_update")
        if not self.llm.reset_prefix_cache():
            log.warning("vLLM did not clear its prefix cache after the weight update (requests were running): "
                        "their cached blocks hold keys and values computed with the previous weights.")
        if weight_version is not None:
            self.llm.llm_engine.set_weight_version(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str:
        """The version the engine serves (set by ``finish_weight_update``)."""
        return str(self.llm.llm_engine.get_weight_version())
